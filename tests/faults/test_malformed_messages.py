"""Bad input under load: hypothesis generates malformed messages (missing ids, wrong types, garbage
bodies, huge headers, unknown tasks) and feeds them, between good ones, to one real worker on a
durable queue (PostgreSQL and Redis). The worker stays up, each bad message is dead-lettered with its
reason, and the good messages around them run once."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..integration.test_inbox_workers import publish_raw
from ..scenario import Scenario

GOOD_BODY = '[["x"], {}, {}]'
_ids = itertools.count()


def _id() -> str:
    return f"bad-{next(_ids)}"


not_a_string = st.one_of(st.integers(), st.lists(st.integers(), max_size=3), st.booleans(),
                         st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
not_a_count = st.one_of(st.text(min_size=1, max_size=5), st.integers(max_value=-1), st.booleans(),
                        st.lists(st.integers(), max_size=2))

missing_id = st.builds(lambda task: (GOOD_BODY, {"task": task}, "malformed"), st.just("inbox.pay"))
id_of_wrong_type = st.builds(lambda value: (GOOD_BODY, {"task": "inbox.pay", "id": value}, "malformed"),
                             not_a_string)
task_of_wrong_type = st.builds(lambda value: (GOOD_BODY, {"task": value, "id": _id()}, "malformed"),
                               not_a_string)
count_of_wrong_type = st.builds(
    lambda name, value: (GOOD_BODY, {"task": "inbox.pay", "id": _id(), name: value}, "malformed"),
    st.sampled_from(["retries", "replaced_task_nesting", "group_index"]), not_a_count)
garbage_body = st.builds(lambda junk: ("\x00{" + junk, {"task": "inbox.pay", "id": _id()}, "malformed"),
                         st.text(max_size=200))
huge_header = st.builds(
    lambda size: (GOOD_BODY, {"task": "inbox.pay", "id": _id(), "root_id": ["x" * 100] * size}, "malformed"),
    st.integers(min_value=100, max_value=2000))
unknown_task = st.builds(lambda name: (GOOD_BODY, {"task": f"nowhere.{name}", "id": _id()}, "unknown_task"),
                         st.text(alphabet="abcdefghij_", min_size=1, max_size=20))

malformed = st.one_of(missing_id, id_of_wrong_type, task_of_wrong_type, count_of_wrong_type, garbage_body,
                      huge_header, unknown_task)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    from ..conftest import unique_prefix
    from ..services import require

    scenario = Scenario(require("redis"), require("postgres"), unique_prefix(), tmp_path_factory.mktemp("faults"))
    scenario.worker(queues=[scenario.env["TEST_OTHER_QUEUE"]])
    yield scenario
    scenario.close()


def dead_letter_reasons(store) -> Counter:
    from sqlalchemy import select

    with store.begin() as conn:
        return Counter(conn.execute(select(store.tables.dead_letters.c.reason)).scalars())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(batch=st.lists(malformed, min_size=1, max_size=6))
def test_malformed_messages_are_dead_lettered_and_good_ones_around_them_run(scenario, batch):
    shop, durable = scenario.shop, scenario.env["TEST_OTHER_QUEUE"]
    store = shop.outbox.store
    before = dead_letter_reasons(store)
    good_ids = []
    for body, headers, _ in batch:
        publish_raw(shop.app, durable, body, headers)
        good_ids.append(f"good-{next(_ids)}")
        shop.pay.apply_async((good_ids[-1],), task_id=good_ids[-1], queue=durable)
    for good_id in good_ids:
        scenario.wait_events(good_id, "postrun", 1)
    assert all(len(shop.effects(good_id)) == 1 for good_id in good_ids), "the good messages ran once"
    assert dead_letter_reasons(store) - before == Counter(reason for *_, reason in batch)
    assert scenario.workers[0].process.poll() is None, "the worker is still running"
