"""`GET /v1/openapi.json` of the real application: a valid OpenAPI 3.1 document that has every
route the application serves, and the problem types it answers with.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ── PostgreSQL
"""

from __future__ import annotations

import aiohttp
import asyncpg
from openapi_spec_validator import validate
from openapi_spec_validator.versions import consts as openapi_versions
from openapi_spec_validator.versions.shortcuts import get_spec_version

from pigeon_mta.api import problems
from pigeon_mta.api.server import build_app
from pigeon_mta.config import Settings
from pigeon_mta.intake.accept import Intake
from pigeon_mta.store.webhooks import EVENT_TYPES
from tests.integration.api_helpers import running_api


async def test_the_document_is_valid_openapi_3_1_with_every_route(pool: asyncpg.Pool) -> None:
    async with (
        running_api(pool) as api,
        aiohttp.ClientSession() as session,
        session.get(api.url + "/v1/openapi.json") as answer,
    ):
        assert answer.status == 200 and answer.content_type == "application/json"
        document = await answer.json()
    validate(document)
    assert get_spec_version(document) == openapi_versions.OPENAPIV31

    app = build_app(Settings(), pool, Intake.of(Settings(), pool))
    served = {
        (route.resource.canonical, route.method.lower())
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    described = {(path, method) for path, item in document["paths"].items() for method in item}
    assert served and served == described

    kinds = document["components"]["schemas"]["Problem"]["properties"]["type"]["enum"]
    assert kinds == [kind.uri for kind in problems.ALL]
    send = document["paths"]["/v1/messages"]["post"]
    statuses = {int(status) for status in send["responses"]} - {202}
    # Every problem the send route can give has its status described (404/405/500 are any route's).
    assert {kind.status for kind in problems.ALL} - {404, 405, 500} == statuses

    # The webhook requests pigeon-mta makes, with every event type an endpoint may take.
    body = document["webhooks"]["event"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/WebhookEvent"}
    event = document["components"]["schemas"]["WebhookEvent"]
    described_types = [t for shape in event["oneOf"] for t in shape["properties"]["type"]["enum"]]
    assert described_types == list(EVENT_TYPES)
    assert set(EVENT_TYPES) == {
        "delivered", "deferred", "bounced", "expired", "suppressed", "complained",
        "paused", "resumed",
    }  # fmt: skip
