"""The OpenAPI 3.1 document of the HTTP API, served at `GET /v1/openapi.json`.

Written as data beside the code it describes; a test validates it and checks that every route of
the application is in it. Problem types come from problems.py, so the two cannot drift.
"""

from __future__ import annotations

import functools
from typing import Any

from pigeon_mta import __version__
from pigeon_mta.api import problems, reading, suppressions
from pigeon_mta.api.compose import ATTACHMENT_FIELDS, JSON_FIELDS
from pigeon_mta.model import COMPLAINT_EVENT, EVENT_TYPE, Outcome
from pigeon_mta.store import message_pages
from pigeon_mta.store import suppression as store_suppression
from pigeon_mta.store import webhooks as store_webhooks

# The send intent's fields (intake/intent.py), in a JSON request and an outbox row alike.
_TIME_OR_SECONDS: dict[str, Any] = {
    "type": ["string", "number"],
    "description": "an RFC 3339 time with its offset, or seconds from now",
}
_INTENT_FIELDS: dict[str, Any] = {
    "expires_at": {
        **_TIME_OR_SECONDS,
        "description": "the deadline: no attempt starts after it; recipients not delivered by "
        "then expire with the category `deadline` (an RFC 3339 time, or seconds from now)",
    },
    "send_at": {
        **_TIME_OR_SECONDS,
        "description": "not attempted before it (an RFC 3339 time, or seconds from now)",
    },
    "order_key": {
        "type": "string",
        "maxLength": 200,
        "description": "within the org, mail with this key reaches each recipient in the order "
        "it was accepted: the next is not attempted until the one before is final",
    },
    "metadata": {
        "type": "object",
        "maxProperties": 10,
        "propertyNames": {"pattern": "^[a-z0-9][a-z0-9_-]{0,39}$"},
        "additionalProperties": {"type": "string", "maxLength": 500},
        "description": "the application's: shown by log and the API, carried in every webhook "
        "event of the message, never delivered",
    },
}
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
                    "content_id": {
                        "type": "string",
                        "description": "an inline part the html names as cid:CONTENT_ID",
                    },
                },
            },
        },
        "lane": {"type": "string", "description": "a lane of [lanes]; else the key's lane"},
        **_INTENT_FIELDS,
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


# What a queued message is (model.message_kind).
_KIND: dict[str, Any] = {
    "type": "string",
    "enum": ["message", "dsn"],
    "description": "dsn: a delivery status notification pigeon-mta made for the org's sender",
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
            "408": _problem("the body did not arrive within api.read_timeout"),
            "413": _problem("over limits.max_message_size"),
            "415": _problem("neither application/json nor message/rfc822"),
            "422": _problem("a bad field, address, header or lane; a reused Idempotency-Key"),
            "429": _problem(
                "the API key's rate limit is reached, or too many requests with a wrong API key "
                "came from this address",
                retry_after=True,
            ),
            "503": _problem(
                "the database is unavailable, or the process holds as many request bodies as "
                "api.max_body_memory allows",
                retry_after=True,
            ),
        },
    }


_TIME = {"type": "string", "format": "date-time"}
_NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}

_RECIPIENT_STATE: dict[str, Any] = {
    "type": "object",
    "description": "a recipient's state and last reply (what `pigeon-mta log` calls Now)",
    "required": ["id", "address", "status", "attempts"],
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "address": {"type": "string"},
        "status": {"type": "string", "enum": list(message_pages.STATUSES)},
        "attempts": {"type": "integer"},
        "next_attempt_at": {**_NULLABLE_TIME, "description": "when queued: the next attempt"},
        "code": {"type": ["integer", "null"]},
        "enhanced_code": {"type": ["string", "null"]},
        "response": {"type": ["string", "null"]},
        "updated_at": _TIME,
    },
}

_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "a delivery log record, as `pigeon-mta log QUEUE_ID --json` prints it",
    "required": ["type", "timestamp", "queue_id", "recipient"],
    "properties": {
        "type": {
            "type": "string",
            "enum": [
                "Reception",
                "Duplicate",
                *(EVENT_TYPE[outcome] for outcome in Outcome),
                COMPLAINT_EVENT,
            ],
        },
        "timestamp": _TIME,
        "queue_id": {"type": "string", "format": "uuid"},
        "message_id": {"type": ["string", "null"]},
        "org": {"type": "string", "format": "uuid"},
        "sender": {"type": "string"},
        "recipient": {"type": "string"},
        "mx": {"type": ["string", "null"]},
        "ip": {"type": ["string", "null"]},
        "code": {"type": ["integer", "null"]},
        "enhanced_code": {"type": ["string", "null"]},
        "response": {"type": ["string", "null"]},
        "tls": {"type": ["object", "null"]},
        "attempt": {"type": ["integer", "null"]},
    },
}

# A webhook request's body (store/webhooks.py `event_payload`, `org_event`); README "Webhooks"
# says more.
_RECIPIENT_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "what happened to a recipient of the org's mail: an outcome, or what feedback "
    "said later (`bounced` with `async`: a DSN after delivery; `complained`: a complaint report)",
    "required": ["type", "timestamp", "data"],
    "properties": {
        "type": {"type": "string", "enum": list(store_webhooks.RECIPIENT_EVENT_TYPES)},
        "timestamp": {**_TIME, "description": "when the outcome was recorded (UTC)"},
        "data": {
            "type": "object",
            "required": [
                "queue_id",
                "recipient_id",
                "recipient",
                "message_id",
                "code",
                "enhanced_code",
                "response",
                "category",
                "attempt",
                "kind",
            ],
            "properties": {
                "queue_id": {"type": "string", "format": "uuid"},
                "recipient_id": {"type": "string", "format": "uuid"},
                "recipient": {"type": "string"},
                "message_id": {"type": ["string", "null"], "description": "the Message-ID"},
                "code": {"type": ["integer", "null"]},
                "enhanced_code": {"type": ["string", "null"]},
                "response": {"type": ["string", "null"]},
                "category": {"type": ["string", "null"]},
                "attempt": {
                    "type": ["integer", "null"],
                    "description": "the recipient's delivery attempt; null for feedback",
                },
                "next_attempt_at": {
                    "type": ["string", "null"],
                    "format": "date-time",
                    "description": "`deferred`: when it is tried again; else null",
                },
                "sender": {"type": "string", "description": "the envelope sender; '' is <>"},
                "lane": {"type": "string", "description": "the lane it is delivered in"},
                "kind": _KIND,
                "metadata": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "the message's metadata (the send intent's); {} for none",
                },
                "async": {"type": "boolean", "description": "reported by feedback, later"},
                "feedback_type": {
                    "type": ["string", "null"],
                    "description": "a complaint's Feedback-Type (RFC 5965): abuse, fraud, ...",
                },
            },
        },
    },
}
_ORG_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "the org's mail stopped (`paused`) or started again (`resumed`): by its "
    "reputation (`[reputation]` thresholds) or by an operator (`pigeon-mta org pause|resume`)",
    "required": ["type", "timestamp", "data"],
    "properties": {
        "type": {"type": "string", "enum": list(store_webhooks.ORG_EVENT_TYPES)},
        "timestamp": {**_TIME, "description": "when it was paused or resumed (UTC)"},
        "data": {
            "type": "object",
            "required": ["org", "by"],
            "properties": {
                "org": {"type": "string", "description": "the org's name"},
                "by": {"type": "string", "enum": ["reputation", "operator"]},
                "reason": {"type": "string", "description": "why (`paused`), as `log` says"},
                "for_seconds": {
                    "type": ["number", "null"],
                    "description": "an operator's pause that ends by itself; null: until resumed",
                },
                "window_seconds": {"type": "number"},
                "sent": {"type": "integer"},
                "hard_bounces": {"type": "integer"},
                "complaints": {"type": "integer"},
                "bounce_rate": {"type": "number"},
                "complaint_rate": {"type": "number"},
            },
        },
    },
}
_WEBHOOK_EVENT: dict[str, Any] = {"oneOf": [_RECIPIENT_EVENT, _ORG_EVENT]}


def _webhook_operation() -> dict[str, Any]:
    def header(name: str, description: str) -> dict[str, Any]:
        return {
            "name": name,
            "in": "header",
            "required": True,
            "schema": {"type": "string"},
            "description": description,
        }

    return {
        "operationId": "webhookEvent",
        "summary": "An event POSTed to each endpoint of `pigeon-mta webhook add` that takes its "
        "type, signed as the Standard Webhooks specification says",
        "parameters": [
            header("webhook-id", "the event's id: the same on every retry, to drop repeats by"),
            header("webhook-timestamp", "Unix seconds"),
            header("webhook-signature", "v1,<base64 HMAC-SHA256 of id.timestamp.body>"),
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/WebhookEvent"}}
            },
        },
        "responses": {
            "2XX": {"description": "accepted; any other answer is retried until webhooks.max_age"}
        },
    }


_TIMELINE: dict[str, Any] = {
    "type": "object",
    "required": ["queue_id", "kind", "message_id", "received_at", "lane", "recipients", "events"],
    "properties": {
        "queue_id": {"type": "string", "format": "uuid"},
        "kind": _KIND,
        "message_id": {"type": ["string", "null"], "description": "the Message-ID header value"},
        "sender": {"type": "string", "description": "the envelope sender; '' is the null sender"},
        "received_at": _TIME,
        "lane": {"type": "string"},
        "size": {"type": "integer"},
        "expires_at": {"type": ["string", "null"], "format": "date-time"},
        "send_at": {"type": ["string", "null"], "format": "date-time"},
        "order_key": {"type": ["string", "null"]},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "recipients": {"type": "array", "items": {"$ref": "#/components/schemas/RecipientState"}},
        "events": {
            "type": "array",
            "items": {"$ref": "#/components/schemas/Event"},
            "description": "Receptions, then attempts and duplicates in time order",
        },
    },
}

_MESSAGE_PAGE: dict[str, Any] = {
    "type": "object",
    "required": ["messages", "next_cursor"],
    "properties": {
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "queue_id",
                    "kind",
                    "message_id",
                    "received_at",
                    "lane",
                    "recipients",
                ],
                "properties": {
                    "queue_id": {"type": "string", "format": "uuid"},
                    "kind": _KIND,
                    "message_id": {"type": ["string", "null"]},
                    "received_at": _TIME,
                    "lane": {"type": "string"},
                    "recipients": {
                        "type": "array",
                        "items": {"$ref": "#/components/schemas/RecipientState"},
                    },
                },
            },
        },
        "next_cursor": {
            "type": ["string", "null"],
            "description": "pass as `cursor` for the next page; null on the last page",
        },
    },
}

_SUPPRESSION: dict[str, Any] = {
    "type": "object",
    "required": ["address", "reason", "source", "created_at", "expires_at"],
    "properties": {
        "address": {"type": "string", "description": "lower case"},
        "reason": {"type": "string"},
        "source": {
            "type": "string",
            "enum": [
                store_suppression.MANUAL,
                store_suppression.BOUNCE,
                store_suppression.COMPLAINT,
            ],
        },
        "created_at": _TIME,
        "expires_at": _NULLABLE_TIME,
    },
}

_NEW_SUPPRESSION: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["address", "reason"],
    "properties": {
        "address": {"type": "string"},
        "reason": {"type": "string", "description": "one line"},
        "expires_at": {**_TIME, "description": "in the future; none: until removed"},
    },
}


def _json(schema: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


_READ_PROBLEMS = {
    "401": _problem("a missing, wrong or revoked API key"),
    "422": _problem(
        "a parameter the server cannot store or look up (a NUL, an unpaired surrogate)"
    ),
    "429": _problem(
        "too many requests with a wrong API key came from this address (limits.max_auth_failures)",
        retry_after=True,
    ),
    "503": _problem("the database is unavailable", retry_after=True),
}

_ADDRESS_IN_PATH = {
    "name": "address",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "the suppressed address (any case)",
}


def _reading_paths() -> dict[str, Any]:
    page = _query("cursor", {"type": "string"}, "the `next_cursor` of the previous page (opaque)")
    return {
        "/v1/messages/{queue_id}": {
            "get": {
                "operationId": "getMessage",
                "summary": "A message's state and timeline: the facts of `pigeon-mta log --json`",
                "security": [{"apiKey": []}],
                "parameters": [
                    {
                        "name": "queue_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "the queue_id of the 202 answer (a UUID)",
                    }
                ],
                "responses": {
                    "200": _json("Timeline", "the message"),
                    "401": _READ_PROBLEMS["401"],
                    "422": _READ_PROBLEMS["422"],
                    "429": _READ_PROBLEMS["429"],
                    "404": _problem(
                        "no message of the key's org has this queue id: an unknown id, another "
                        "org's, and a text that is no UUID at all are answered alike, since each "
                        "names no message the key may read"
                    ),
                    "503": _READ_PROBLEMS["503"],
                },
            }
        },
        "/v1/suppressions": {
            "get": {
                "operationId": "listSuppressions",
                "summary": "The org's active suppression entries, in address order",
                "security": [{"apiKey": []}],
                "parameters": [
                    _query(
                        "limit",
                        {"type": "integer", "minimum": 1, "maximum": suppressions.MAX_LIMIT},
                        f"at most this many (default {suppressions.DEFAULT_LIMIT})",
                    ),
                    page,
                ],
                "responses": {
                    "200": {
                        "description": "a page",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["suppressions", "next_cursor"],
                                    "properties": {
                                        "suppressions": {
                                            "type": "array",
                                            "items": {"$ref": "#/components/schemas/Suppression"},
                                        },
                                        "next_cursor": {"type": ["string", "null"]},
                                    },
                                }
                            }
                        },
                    },
                    "400": _problem("a malformed or unknown query parameter"),
                    **_READ_PROBLEMS,
                },
            },
            "post": {
                "operationId": "addSuppression",
                "summary": "Stop mail to an address (as `pigeon-mta suppress add`)",
                "security": [{"apiKey": []}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/NewSuppression"}
                        }
                    },
                },
                "responses": {
                    "200": _json("Suppression", "the address was on the list: entry replaced"),
                    "201": _json("Suppression", "the address is on the list"),
                    "400": _problem("malformed JSON"),
                    "401": _READ_PROBLEMS["401"],
                    "429": _READ_PROBLEMS["429"],
                    "408": _problem("the body did not arrive within api.read_timeout"),
                    "415": _problem("not application/json"),
                    "422": _problem("a missing or wrong field, or a bad address"),
                    "503": _READ_PROBLEMS["503"],
                },
            },
        },
        "/v1/suppressions/{address}": {
            "get": {
                "operationId": "getSuppression",
                "summary": "The org's active entry for an address",
                "security": [{"apiKey": []}],
                "parameters": [_ADDRESS_IN_PATH],
                "responses": {
                    "200": _json("Suppression", "the entry"),
                    "401": _READ_PROBLEMS["401"],
                    "422": _READ_PROBLEMS["422"],
                    "429": _READ_PROBLEMS["429"],
                    "404": _problem("the address is not on the org's list"),
                    "503": _READ_PROBLEMS["503"],
                },
            },
            "delete": {
                "operationId": "removeSuppression",
                "summary": "Allow mail to an address again (as `pigeon-mta suppress remove`)",
                "security": [{"apiKey": []}],
                "parameters": [_ADDRESS_IN_PATH],
                "responses": {
                    "204": {"description": "removed"},
                    "401": _READ_PROBLEMS["401"],
                    "422": _READ_PROBLEMS["422"],
                    "429": _READ_PROBLEMS["429"],
                    "404": _problem("the address is not on the org's list"),
                    "503": _READ_PROBLEMS["503"],
                },
            },
        },
    }


def _list_operation() -> dict[str, Any]:
    return {
        "operationId": "listMessages",
        "summary": "The org's messages, newest first, a page at a time",
        "description": "Besides the parameters below, `metadata.NAME=value` (as many as "
        "wanted) keeps the messages whose metadata has each NAME with that value.",
        "security": [{"apiKey": []}],
        "parameters": [
            _query(
                "recipient",
                {"type": "string"},
                "only messages to this address: as it was sent, or in lower case (the "
                "spellings `pigeon-mta log ADDRESS` looks for)",
            ),
            _query("message_id", {"type": "string"}, "only messages with this Message-ID"),
            _query(
                "status",
                {"type": "string", "enum": list(message_pages.STATUSES)},
                "only messages with a recipient in this state (with `recipient`: that one's)",
            ),
            _query(
                "since",
                {"type": "string", "format": "date-time"},
                "only messages received at or after this time (UTC unless an offset is given; "
                "write '+' as %2B)",
            ),
            _query(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": reading.MAX_LIMIT},
                f"at most this many (default {reading.DEFAULT_LIMIT})",
            ),
            _query(
                "cursor",
                {"type": "string"},
                "the `next_cursor` of the previous page (opaque); mail that arrives while "
                "paging sorts before the first page, so no message is shown twice or skipped",
            ),
        ],
        "responses": {
            "200": _json("MessagePage", "a page"),
            "400": _problem("a malformed or unknown query parameter (the detail names it)"),
            **_READ_PROBLEMS,
        },
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    assert set(_JSON_MESSAGE["properties"]) == JSON_FIELDS
    attachment = _JSON_MESSAGE["properties"]["attachments"]["items"]["properties"]
    assert set(attachment) == ATTACHMENT_FIELDS
    assert set(_NEW_SUPPRESSION["properties"]) == suppressions.FIELDS
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pigeon-mta HTTP API",
            "version": __version__,
            "description": "Send mail through pigeon-mta over HTTP, with an API key of an org "
            "(pigeon-mta apikey add ORG).",
        },
        "paths": {
            "/v1/messages": {"post": _send_operation(), "get": _list_operation()},
            **_reading_paths(),
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
        "webhooks": {"event": {"post": _webhook_operation()}},
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Message": _JSON_MESSAGE,
                "Accepted": _ACCEPTED,
                "Problem": _PROBLEM,
                "RecipientState": _RECIPIENT_STATE,
                "Event": _EVENT,
                "Timeline": _TIMELINE,
                "MessagePage": _MESSAGE_PAGE,
                "Suppression": _SUPPRESSION,
                "NewSuppression": _NEW_SUPPRESSION,
                "WebhookEvent": _WEBHOOK_EVENT,
            },
        },
    }
