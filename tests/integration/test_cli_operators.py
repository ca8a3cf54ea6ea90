"""What the operator commands print: message-derived text escaped, no secret of the store's URL,
durations checked; each run as a real ``celery -A ... outbox`` subprocess."""

from __future__ import annotations

import json

from celery_outbox.store import Store, build_engine, utcnow
from celery_outbox.vocabulary import DeadLetterReason

from ..conftest import drop_store
from ..services import free_port, require
from .test_cli_schema import run

HOSTILE = "\x1b[2J\rfake\x00"


def hostile_dead_letter() -> dict:
    return {
        "message_id": f"id{HOSTILE}", "destination": "", "task_name": f"tasks.evil{HOSTILE}",
        "queue": f"q{HOSTILE}", "reason": "failed", "exception_type": f"Boom{HOSTILE}",
        "exception_message": f"message{HOSTILE}", "traceback": f"Traceback\n  line{HOSTILE}\n",
        "exchange": "", "routing_key": f"q{HOSTILE}", "body": f'[[], {{}}, "{HOSTILE}"]'.encode(),
        "content_type": "application/json", "content_encoding": "utf-8",
        "headers": '{"task": "tasks.evil\\u001b[2J\\r"}', "properties": "{}", "failed_at": utcnow(),
    }


def assert_no_control_characters(text: str) -> None:
    for char in ("\x1b", "\r", "\x00"):
        assert char not in text, f"{char!r} reached the terminal"


def test_message_text_is_escaped_in_every_listing(sqlite_url, table_prefix):
    store = Store(build_engine(sqlite_url), table_prefix)
    store.migrate()
    try:
        with store.begin() as conn:
            store.insert_dead_letters(conn, [hostile_dead_letter()])
        letter_id = str(store.list_dead_letters(store.dead_letter_filter())[0].id)
        for command in (["dead-letters", "list"], ["dead-letters", "show", letter_id], ["status"],
                        ["dead-letters", "list", "--json"], ["status", "--json"]):
            result = run(*command, url=sqlite_url, prefix=table_prefix)
            assert result.returncode == 0, result.stderr
            # status groups the dead letters of task names the app does not register as "other"
            assert ("other" if command[0] == "status" else "tasks.evil") in result.stdout, result.stdout
            assert_no_control_characters(result.stdout + result.stderr)
        shown = run("dead-letters", "show", letter_id, url=sqlite_url, prefix=table_prefix).stdout
        assert "tasks.evil\\x1b[2J\\rfake\\x00" in shown
        assert "message\\x1b[2J\\rfake\\x00" in shown
        assert "Traceback\n  line\\x1b" in shown, "a traceback keeps its line breaks"
    finally:
        drop_store(store)


def test_a_duration_too_long_is_a_usage_error(sqlite_url, table_prefix):
    for option in (["purge", "--older-than", "9" * 400], ["list", "--since", "99999999999d"]):
        result = run("dead-letters", *option, url=sqlite_url, prefix=table_prefix)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "Invalid value" in result.stderr


SECRETS = ("userinfo-s3cret", "query-s3cret", "keypass-s3cret")


def secret_url(port: int) -> str:
    return (f"postgresql+psycopg://postgres:{SECRETS[0]}@127.0.0.1:{port}/test"
            f"?password={SECRETS[1]}&sslpassword={SECRETS[2]}&sslmode=prefer")


def assert_no_secret(result) -> None:
    for secret in SECRETS:
        assert secret not in result.stdout + result.stderr, f"{secret} printed by {result.args[-1]}"


def test_no_password_of_the_url_is_printed_when_the_database_is_down(table_prefix):
    url = secret_url(free_port())
    for command in (["migrate"], ["status"], ["recover"], ["dead-letters", "list"]):
        result = run(*command, url=url, prefix=table_prefix)
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert "cannot use the message store at postgresql+psycopg://postgres:***@127.0.0.1" in result.stderr
        assert "password=***" in result.stderr and "sslpassword=***" in result.stderr
        assert_no_secret(result)


def test_no_password_of_the_url_is_printed_when_the_database_is_up(table_prefix):
    require("postgres")
    url = secret_url(5432)
    store = Store(build_engine(url), table_prefix)
    try:
        outputs = {}
        for command in (["migrate"], ["status"], ["status", "--json"], ["recover"], ["cleanup"],
                        ["dead-letters", "list"]):
            result = run(*command, url=url, prefix=table_prefix)
            assert result.returncode == 0, result.stderr
            assert_no_secret(result)
            outputs[" ".join(command)] = result.stdout
        shown = "postgresql+psycopg://postgres:***@127.0.0.1:5432/test?password=***&sslmode=prefer&sslpassword=***"
        assert f"store: {shown}" in outputs["migrate"] and f"store: {shown}" in outputs["status"]
    finally:
        drop_store(store)


def test_every_dead_letter_reason_is_a_filter_that_finds_its_letters(sqlite_url, table_prefix):
    """``--reason`` takes each ``DeadLetterReason`` and lists only its letters; any other is a
    usage error naming the reasons."""
    store = Store(build_engine(sqlite_url), table_prefix)
    store.migrate()
    try:
        with store.begin() as conn:
            store.insert_dead_letters(conn, [{"message_id": f"m-{reason.value}", "reason": reason.value,
                                              "task_name": f"tasks.{reason.value}", "failed_at": utcnow()}
                                             for reason in DeadLetterReason])
        for reason in DeadLetterReason:
            result = run("dead-letters", "list", "--json", "--reason", reason.value, url=sqlite_url,
                         prefix=table_prefix)
            assert result.returncode == 0, result.stderr
            listed = [json.loads(line) for line in result.stdout.splitlines()]
            assert [(letter["message_id"], letter["reason"]) for letter in listed] == \
                [(f"m-{reason.value}", reason.value)]
        refused = run("dead-letters", "list", "--reason", "lost", url=sqlite_url, prefix=table_prefix)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert all(repr(reason.value) in refused.stderr for reason in DeadLetterReason), refused.stderr
    finally:
        drop_store(store)
