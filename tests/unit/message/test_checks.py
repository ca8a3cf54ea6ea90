"""The checks that say whether a message can run (``celery_outbox.message.checks``): malformed
headers are named, an unregistered task before anything else; good headers pass."""

from __future__ import annotations

import pytest

from celery_outbox.message.checks import malformed_reason

GOOD = {"task": "t.add", "id": "abc", "retries": 0, "timelimit": [None, None], "eta": None, "root_id": "abc"}


@pytest.mark.parametrize(
    "change, reason, words",
    [
        ({"id": None}, "malformed", "header 'id'"),
        ({"id": ""}, "malformed", "header 'id'"),
        ({"id": 5}, "malformed", "header 'id'"),
        ({"task": None}, "malformed", "header 'task'"),
        ({"retries": "1"}, "malformed", "'retries'"),
        ({"retries": -1}, "malformed", "'retries'"),
        ({"replaced_task_nesting": 1.5}, "malformed", "'replaced_task_nesting'"),
        ({"eta": 12}, "malformed", "'eta'"),
        ({"timelimit": "soon"}, "malformed", "'timelimit'"),
        ({"timelimit": [1, "x"]}, "malformed", "'timelimit'"),
        ({"task": "t.unknown"}, "unknown_task", "not registered"),
        ({"task": "t.unknown", "eta": 12}, "unknown_task", "not registered"),  # Celery looks at the name first
    ],
)
def test_malformed_headers_are_named(change, reason, words):
    verdict = malformed_reason({**GOOD, **change}, {"t.add"})
    assert verdict is not None and verdict[0] == reason and words in verdict[1]


def test_good_headers_pass_and_non_mappings_do_not():
    assert malformed_reason(GOOD, {"t.add"}) is None
    assert malformed_reason(["not", "a", "dict"], {"t.add"})[0] == "malformed"
