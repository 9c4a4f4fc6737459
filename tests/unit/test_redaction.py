"""The database password never reaches a log line or an error message, whatever form it takes."""

from __future__ import annotations

import pytest

from pigeon_mta.config_loader import load_settings
from pigeon_mta.redaction import redact
from pigeon_mta.store.connect import locate_database
from tests.conftest import run_pigeon

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://pigeon:hunter2@db/pigeon", "postgresql://pigeon:***@db/pigeon"),
        (
            "postgresql://pigeon@db/pigeon?password=hunter2&sslmode=require",
            "postgresql://pigeon@db/pigeon?password=***&sslmode=require",
        ),
        (
            "postgresql://pigeon:hunter2@h1:5432,h2:5433/pigeon?target_session_attrs=read-write",
            "postgresql://pigeon:***@h1:5432,h2:5433/pigeon?target_session_attrs=read-write",
        ),
        (
            "postgres://pigeon@h1,h2/pigeon?sslmode=verify-full&PASSWORD=hunter2",
            "postgres://pigeon@h1,h2/pigeon?sslmode=verify-full&PASSWORD=***",
        ),
        (
            "postgresql:///pigeon?host=/run/postgresql&password=hunter2&user=pigeon",
            "postgresql:///pigeon?host=/run/postgresql&password=***&user=pigeon",
        ),
        ("postgresql://u@db/x?sslpassword=hunter2", "postgresql://u@db/x?sslpassword=***"),
        ("postgresql://pigeon:hun@ter2@db/pigeon", "postgresql://pigeon:***@db/pigeon"),
        ("host=db password=hunter2 user=pigeon", "host=db password=*** user=pigeon"),
        ("host=db password='hun ter2' user=pigeon", "host=db password=*** user=pigeon"),
        ("postgresql://pigeon@db/pigeon", "postgresql://pigeon@db/pigeon"),
    ],
)
def test_every_form_of_password_is_redacted(url: str, shown: str) -> None:
    assert redact(url) == shown
    # In free text (an error that quotes a URL) a query value runs to the next space: what
    # follows the URL directly may be lost with it, never shown.
    assert redact(f"cannot connect to {url} (refused)") == f"cannot connect to {shown} (refused)"


def test_the_database_description_logged_at_start_has_no_password() -> None:
    url = "postgresql://pigeon@db.example/pigeon?password=hunter2"
    settings = load_settings(None, env={"PIGEON_DATABASE_URL": url})
    description = locate_database(settings).description
    assert SECRET not in description
    assert description == "PostgreSQL at postgresql://pigeon@db.example/pigeon?password=***"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://pigeon@127.0.0.1:1/pigeon?password=hunter2",
        "postgresql://pigeon:hunter2@127.0.0.1:1,127.0.0.1:2/pigeon",
        "postgresql://pigeon@127.0.0.1:port/pigeon?password=hunter2",
    ],
)
def test_a_cli_database_error_does_not_print_the_password(url: str) -> None:
    result = run_pigeon("org", "list", env={"PIGEON_DATABASE_URL": url, "PIGEON_CONFIG": ""})
    assert result.returncode == 1
    assert SECRET not in result.stderr and SECRET not in result.stdout
    assert result.stderr.startswith("pigeon-mta: cannot reach the database (PostgreSQL at ")
    assert redact(url) + "): " in result.stderr
    assert "Traceback" not in result.stderr
