"""Log lines about a message carry its id, task, queue and attempt as fields of the record
(``extra``), so a JSON formatter gets them as fields."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import celery_outbox
from celery_outbox.core import log_fields
from celery_outbox.vocabulary import Attempt

PACKAGE = Path(celery_outbox.__file__).parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
FIELDS = ("message_id", "task_name", "queue", "attempt")


def logger_calls_about_a_message() -> list[tuple[str, ast.Call]]:
    """Every ``logger.<level>(...)`` of the package (the audit's Spark job aside) whose arguments
    name a message's id: ``x.message_id``, or ``self.id`` of a request."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "audit" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and getattr(node.func.value, "id", None) == "logger"):
                continue
            names = {n.attr for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Attribute)}
            selves = {n.value.id for arg in node.args for n in ast.walk(arg)
                      if isinstance(n, ast.Attribute) and n.attr == "id" and isinstance(n.value, ast.Name)}
            if "message_id" in names or "self" in selves:
                found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", node))
    return found


def test_every_log_line_about_a_message_gives_its_fields():
    calls = logger_calls_about_a_message()
    assert len(calls) >= 15, "the scan finds the package's log lines about messages"
    bare = [where for where, call in calls
            if not any(keyword.arg in (None, "extra") for keyword in call.keywords)]
    assert bare == [], f"log lines about a message without its fields: {bare}"


def test_the_fields_are_the_records_attributes_and_reach_a_json_formatter():
    class JsonFormatter(logging.Formatter):
        def format(self, record):
            return json.dumps({"message": record.getMessage(), **{name: getattr(record, name) for name in FIELDS}})

    logger = logging.getLogger("celery_outbox.test_log_fields")
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 1, "about %s", ("m-1",), None,
                               extra=log_fields.fields("m-1", "shop.pay", "orders", Attempt(1, 0, 2))["extra"])
    assert json.loads(JsonFormatter().format(record)) == {
        "message": "about m-1", "message_id": "m-1", "task_name": "shop.pay", "queue": "orders", "attempt": "1.0.2"}


def test_a_broker_message_of_any_shape_gives_the_fields_it_has():
    class Message:
        headers = {"id": "m-2", "task": ["not", "text"], "retries": "3"}
        delivery_info = {"routing_key": "orders"}

    assert log_fields.of_broker_message(Message())["extra"] == {
        "message_id": "m-2", "task_name": None, "queue": "orders", "attempt": "0.0.3"}

    class Garbage:
        headers = "not a dict"
        delivery_info = None

    assert log_fields.of_broker_message(Garbage())["extra"] == {
        "message_id": None, "task_name": None, "queue": None, "attempt": "0.0.0"}

