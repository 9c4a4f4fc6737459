"""The OpenAPI 3.1 document of the HTTP API, served at `GET /v1/openapi.json`.

Written as data beside the code it describes; a test validates it and checks that every route of
the application is in it. Problem types come from problems.py, so the two cannot drift.
"""

from __future__ import annotations

import functools
from typing import Any

from pigeon_mta import __version__
from pigeon_mta.api import problems
from pigeon_mta.api.compose import ATTACHMENT_FIELDS, JSON_FIELDS

_ADDRESS = {"type": "string", "description": "addr@example.com or Name <addr@example.com>"}
_ADDRESSES = {"oneOf": [_ADDRESS, {"type": "array", "items": _ADDRESS}]}

_JSON_MESSAGE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["from"],
    "properties": {
        "from": _ADDRESS,
        "to": _ADDRESSES,
        "cc": _ADDRESSES,
        "bcc": {**_ADDRESSES, "description": "envelope recipients not named in the header"},
        "reply_to": _ADDRESSES,
        "subject": {"type": "string", "description": "no CR or LF"},
        "text": {"type": "string"},
        "html": {"type": "string"},
        "headers": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "more header fields; not those the other fields set",
        },
        "attachments": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["filename", "content"],
                "properties": {
                    "filename": {"type": "string"},
                    "content_type": {"type": "string", "default": "application/octet-stream"},
                    "content": {"type": "string", "contentEncoding": "base64"},
                },
            },
        },
        "lane": {"type": "string", "description": "a lane of [lanes]; else the key's lane"},
    },
}

_ACCEPTED: dict[str, Any] = {
    "type": "object",
    "required": ["queue_id", "message_id", "recipients"],
    "properties": {
        "queue_id": {"type": "string", "format": "uuid"},
        "message_id": {"type": ["string", "null"], "description": "the Message-ID header value"},
        "recipients": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["address", "id"],
                "properties": {
                    "address": {"type": "string"},
                    "id": {"type": ["string", "null"], "format": "uuid"},
                },
            },
        },
    },
}

_PROBLEM: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "enum": [p.uri for p in problems.ALL]},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string", "description": "one sentence naming the field at fault"},
    },
}


def _problem(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {problems.CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    if retry_after:
        answer["headers"] = {
            "Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait"}
        }
    return answer


def _send_operation() -> dict[str, Any]:
    return {
        "operationId": "sendMessage",
        "summary": "Queue a message; answered after its commit",
        "security": [{"apiKey": []}],
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "maxLength": 255},
                "description": "the same key from the same org within 24 h returns the first "
                "answer and queues nothing; with another body it is refused (422)",
            },
            {
                "name": "from",
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "description": "message/rfc822 only: the envelope sender",
            },
            {
                "name": "to",
                "in": "query",
                "required": False,
                "schema": {"type": "array", "items": {"type": "string"}},
                "style": "form",
                "explode": True,
                "description": "message/rfc822 only: the envelope recipients (repeat it)",
            },
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Message"}},
                "message/rfc822": {"schema": {"type": "string", "format": "binary"}},
            },
        },
        "responses": {
            "202": {
                "description": "queued",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Accepted"}}
                },
            },
            "400": _problem("malformed JSON or message"),
            "401": _problem("a missing, wrong or revoked API key"),
            "403": _problem("a sender address the org does not own"),
            "413": _problem("over limits.max_message_size"),
            "415": _problem("neither application/json nor message/rfc822"),
            "422": _problem("a bad field, address, header or lane; a reused Idempotency-Key"),
            "429": _problem("the API key's rate limit is reached", retry_after=True),
            "503": _problem("the database is unavailable", retry_after=True),
        },
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    assert set(_JSON_MESSAGE["properties"]) == JSON_FIELDS
    attachment = _JSON_MESSAGE["properties"]["attachments"]["items"]["properties"]
    assert set(attachment) == ATTACHMENT_FIELDS
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pigeon-mta HTTP API",
            "version": __version__,
            "description": "Send mail through pigeon-mta over HTTP, with an API key of an org "
            "(pigeon-mta apikey add ORG).",
        },
        "paths": {
            "/v1/messages": {"post": _send_operation()},
            "/v1/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "the OpenAPI 3.1 document",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Message": _JSON_MESSAGE, "Accepted": _ACCEPTED, "Problem": _PROBLEM},
        },
    }
