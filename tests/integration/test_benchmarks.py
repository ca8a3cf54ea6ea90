"""The benchmark command runs, measures each pair in one run and writes its table and JSON.

Small sizes (``--quick``): these tests check that the benchmarks work, never how fast anything is.
The worker benchmark's full run drains tens of thousands of messages through 24 workers; here its
harness drains a few blocks through real workers.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import MetaData, create_engine, func, insert, inspect, select

from tests.services import require

ROOT = Path(__file__).parents[2]


def test_the_django_benchmark_compares_the_outbox_with_delay_on_commit(tmp_path):
    """``python -m benchmarks django``: N messages in ``transaction.atomic()``, celery-outbox's
    durable queue against ``delay_on_commit``, both measured in the same run."""
    for service in ("postgres", "redis"):
        require(service)
    report_path = tmp_path / "results.json"
    completed = subprocess.run([sys.executable, "-m", "benchmarks", "django", "--quick", "--json", str(report_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(report_path.read_text())["results"]
    assert [r["case"] for r in results] == [
        f"Redis, N={n} in transaction.atomic() with one ORM row, durable vs delay_on_commit" for n in (1, 10, 100)]
    for result in results:
        assert result["ours"] > 0 and result["plain"] > 0
        assert abs(result["ratio"] - result["ours"] / result["plain"]) < 1e-9


def test_the_asyncio_benchmark_compares_async_units_of_work_with_plain_celery_and_the_sync_ones(tmp_path):
    """``python -m benchmarks asyncio``: async units of work (``atransaction()``, ``abegin()``) each
    writing one row and sending N tasks, against plain Celery called from the same async code (its
    ``apply_async`` in an executor) and, in the ``vs peer`` block, against the sync unit of work of
    the same kind (0.9 at N = 1); then the p99 of the event loop's lag during a burst of them."""
    for service in ("postgres", "redis"):
        require(service)
    report_path = tmp_path / "results.json"
    completed = subprocess.run([sys.executable, "-m", "benchmarks", "asyncio", "--quick", "--json", str(report_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert list(report["minutes"]) == ["asyncio"]
    results = report["results"]
    assert {r["benchmark"] for r in results} == {"asyncio"}
    plain = "vs plain Celery from asyncio (AsyncSession committed, then apply_async in an executor)"
    rows = {n: f"Redis, N={n}, one row and {n} send{'s' if n > 1 else ''} in a unit of work" for n in (1, 10, 100)}
    lag = "p99 of the event loop's lag, 100 units of work 50 at a time, each one row and one send"
    assert [r["case"] for r in results if r["versus"] is None] == [
        *(f"{rows[n]}: {way}, {plain}" for n in (1, 10, 100)
          for way in ("atransaction(), in-memory", "atransaction(), durable", "abegin(), durable")),
        f"{lag}: atransaction(), durable, vs plain Celery, apply_async in an executor",
        f"{lag}: atransaction(), in-memory, vs plain Celery, apply_async in an executor",
        f"{lag}: atransaction(), durable, vs plain Celery, apply_async on the loop"]
    against_sync = [r for r in results if r["versus"] is not None]
    assert [r["case"] for r in against_sync] == [
        f"{rows[n]}: {way}" for n in (1, 10, 100) for way in (
            "atransaction() vs transaction(), in-memory", "atransaction() vs transaction(), durable",
            "abegin() vs begin(), durable")]
    for result in results:
        assert result["ours"] > 0 and result["plain"] > 0, "both ways measured"
        assert abs(result["ratio"] - result["ours"] / result["plain"]) < 1e-9
        assert result["unit"] == ("ms" if result["case"].startswith("p99") else "units/s")
    for result in against_sync:
        assert result["versus"] == "the sync unit of work"
        assert result["target"] == (">= 0.9" if result["case"].startswith("Redis, N=1,") else None)
        assert re.fullmatch(r"plain Celery's own async way at [\d.]+ of its sync way .*", result["note"])
    assert all(r["target"] is None for r in results if r["versus"] is None), "against plain Celery: no target"
    lag_note = next(r["note"] for r in results if r["case"].startswith(lag))
    for way in ("atransaction durable", "atransaction in-memory", "plain, apply_async in an executor",
                "plain, apply_async on the loop", "the row alone, nothing sent"):
        assert re.search(rf"{re.escape(way)} p99 [\d.]+ ms, max [\d.]+ ms, [\d,]+ units/s", lag_note), lag_note

    table = completed.stdout
    assert sum(line.startswith("| asyncio |") for line in table.splitlines()) == len(results)
    assert "| the sync unit of work |" in table.split("vs peer: the denominator is the peer named", 1)[1]
    assert "\n3 targets, judged at 90% confidence or more where a row has rounds enough:\n" in table


def test_the_tenants_benchmark_compares_tenant_units_and_beats_passes_with_one_store(tmp_path):
    """``python -m benchmarks tenants``: a tenant's unit of work (``transaction(tenant=...)``, turning
    over the tenants' databases) against the default store's, in the ``vs peer`` block, with its
    floor at N = 1; then beat's recover pass over 1, a few and more tenants against the default
    store's pass, idle and with pending rows, every pending row published. The databases it made
    are dropped."""
    from benchmarks.common import POSTGRES_URL

    for service in ("postgres", "redis"):
        require(service)
    made = re.compile(r"b[0-9a-f]{10}_(default|db\d+|schemas)")
    engine = create_engine(POSTGRES_URL)

    def benchmark_databases() -> set[str]:
        with engine.connect() as conn:
            names = conn.exec_driver_sql("SELECT datname FROM pg_database").scalars()
            return {name for name in names if made.fullmatch(name)}

    before = benchmark_databases()
    report_path = tmp_path / "results.json"
    try:
        completed = subprocess.run([sys.executable, "-m", "benchmarks", "tenants", "--quick", "--json",
                                    str(report_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        left = benchmark_databases() - before
    finally:
        engine.dispose()
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert left == set(), "the benchmark's databases are dropped"
    report = json.loads(report_path.read_text())
    assert list(report["minutes"]) == ["tenants"]
    results = report["results"]
    assert {r["benchmark"] for r in results} == {"tenants"}
    units = [r for r in results if r["unit"] == "units/s"]
    case = "Redis, N={n}, one row and {n} durable send{s} in a unit of work"
    against_one_store = [case.format(n=n, s="s" if n > 1 else "") + ": transaction(tenant=...) turning over 2 "
                         "tenants' databases vs transaction() on the default store" for n in (1, 10)]
    floors = case.format(n=1, s="") + ", floor by hand: turning over 2 tenants' databases vs on one database"
    assert [r["case"] for r in units] == [against_one_store[0], floors, against_one_store[1]]
    tenant_units, floor = [units[0], units[2]], units[1]
    for result in tenant_units:
        assert result["versus"] == "the default store's unit of work" and result["target"] == ">= 0.95"
        assert re.match(r"ms per unit of work: a tenant's [\d.]+, the default store's [\d.]+ \([+-][\d.]+\)",
                        result["note"]), result["note"]
    assert re.search(r"; the default store's unit at [\d.]+ of the floor on its database alone; pings of a pooled "
                     r"connection idle over 50 ms, per unit of work \(a pass of its own\): a tenant's [\d.]+, the "
                     r"default store's [\d.]+; connections this process holds to the 2 tenants' databases: \d+$",
                     units[0]["note"]), units[0]["note"]
    assert units[0]["floor"] == floor["ours"], "the tenant unit's floor is the floor row's, turning over the tenants"
    assert abs(units[0]["of_floor"] - units[0]["ours"] / units[0]["floor"]) < 1e-9
    assert units[2]["floor"] is None, "at N = 10 the library pipelines its publishes: no floor"
    assert floor["versus"] == "the floor on one database" and floor["target"] is None
    passes = [r for r in results if r["unit"] == "s"]
    largest = "database" if "; databases: a CREATE DATABASE took" in passes[-1]["note"] else "schema of one database"
    cases = ["1 tenant, a database, its connection kept in its pool",
             "2 tenants, each a database, its connection kept in its pool",
             "2 tenants, each a database, its connections closed after its pass",
             "2 tenants, each a schema of one database, its connections closed after its pass",
             f"3 tenants, each a {largest}, its connections closed after its pass"]
    assert [r["case"] for r in passes] == [f"beat's recover pass over {case}, {state}" for state in (
        "idle stores", "10 pending rows in each store") for case in cases]
    for result in passes:
        assert result["versus"] == "the default store's pass, once per tenant" and result["target"] is None
        assert re.match(r"[\d.]+ ms a tenant; the default store's pass [\d.]+ ms", result["note"]), result["note"]
    assert re.search(r"; (databases|schemas, not databases): a CREATE DATABASE took [\d.]+ s here \(median of the "
                     r"run's first 3\); beat's own run sent one task per tenant, \d+ tasks, in \d+ ms",
                     passes[-1]["note"]), passes[-1]["note"]
    # each round's measurement the median of passes making at least 10 stores' passes: the default
    # store's 10, 1 tenant's 10, 2 tenants' 5, 3 tenants' 3 (9)
    assert passes[-1]["checks"] == {"rows published": 10 * (10 + 10 + 10 + 10 + 10 + 9)}, "every pending row, once"
    (down,) = [r for r in results if r["unit"] == "msgs/s"]
    assert down["case"] == ("Redis, a worker (prefork, 2) on 2 stores' messages mixed with a tenant's: its database "
                            "refusing sessions vs up")
    assert (down["versus"], down["target"]) == ("the same worker and queue with every tenant's database up", ">= 0.9")
    assert re.match(r"30 messages of each of 3 stores in the queue; the down tenant's parked in the default store; "
                    r"each round's ratio: [\d.]+; median pace with every tenant up \d+/s$", down["note"]), down["note"]
    assert len(units) + len(passes) + 1 == len(results)
    for result in results:
        assert result["ours"] > 0 and result["plain"] > 0, "both ways measured"
        assert abs(result["ratio"] - result["ours"] / result["plain"]) < 1e-9

    table = completed.stdout
    assert "| benchmark | case | celery-outbox | plain Celery |" not in table, "every row is against one store"
    rows = [line for line in table.split("vs peer: the denominator is the peer named", 1)[1].splitlines()
            if line.startswith("| tenants |")]
    assert len(rows) == len(results)


def test_the_peers_benchmark_compares_the_outbox_with_procrastinate_and_django_celery_outbox(tmp_path):
    """``python -m benchmarks peers``: each comparison with a peer library, both ways measured in
    the same run; its rows name the peer and its version, and print in the table's ``vs peer``
    block, apart from the rows against plain Celery."""
    from importlib.metadata import PackageNotFoundError, version

    for service in ("postgres", "redis"):
        require(service)
    try:
        peers = {name: f"{name} {version(name)}" for name in ("procrastinate", "django-celery-outbox")}
    except PackageNotFoundError as exc:
        pytest.skip(f"the peers are not installed ({exc}): the bench extra (tox installs it)")
    report_path = tmp_path / "results.json"
    completed = subprocess.run([sys.executable, "-m", "benchmarks", "peers", "--quick", "--json", str(report_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(report_path.read_text())["results"]
    assert {r["benchmark"] for r in results} == {"peers"}
    by_peer = {name: [r["case"] for r in results if r["versus"] == named] for name, named in peers.items()}
    assert sum(map(len, by_peer.values())) == len(results), "every row names its peer"
    assert by_peer["procrastinate"] == [
        "N=1 in one transaction: durable unit of work (Redis) vs defer ×1 on the caller's connection",
        *(f"N={n} in one transaction: durable unit of work (Redis) vs {how} on the caller's connection"
          for n in (10, 100) for how in (f"defer ×{n}", f"one batch_defer of {n}")),
        "one DB write per job, a queue of 20 drained by one worker of concurrency 2: IdempotentTask optimistic "
        "(Redis, prefork) vs its async job (its worker)"]
    assert by_peer["django-celery-outbox"] == [
        *(f"N={n} in transaction.atomic() with one ORM row: durable delay, published after the commit, vs {how}"
          for n in (1, 10, 100) for how in ("its delay (stored only)",
                                            "its delay and then its relay publishing the rows (batches of 500)")),
        "a backlog of 3,000 rows published to Redis in batches of 500: relay vs its relay"]
    for result in results:
        assert result["ours"] > 0 and result["plain"] > 0, "both ways measured"
        assert abs(result["ratio"] - result["ours"] / result["plain"]) < 1e-9
        assert result["target"] == ">= 1"

    table = completed.stdout
    assert "| benchmark | case | celery-outbox | plain Celery |" not in table, "no row against plain Celery"
    block = table.split("vs peer: the denominator is the peer named, not plain Celery", 1)[1]
    assert "| benchmark | case | celery-outbox | peer | peer's | ratio | target | met |" in block
    rows = [line for line in block.splitlines() if line.startswith("| peers |")]
    assert len(rows) == len(results)
    assert all(any(f"| {named} |" in row for named in peers.values()) for row in rows)
    reprinted = subprocess.run([sys.executable, "-m", "benchmarks", "--report", str(report_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert reprinted.returncode == 0, reprinted.stderr
    assert reprinted.stdout.split("\n", 1)[1] == table.replace(f"written to {report_path}\n", "")


def test_benchmark_command_prints_ratios_and_writes_them_as_json(tmp_path):
    for service in ("postgres", "redis", "rabbitmq"):
        require(service)
    report_path = tmp_path / "results.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "producer", "relay", "cleanup", "--quick", "--json", str(report_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]

    report = json.loads(report_path.read_text())
    assert report["quick"] is True
    assert {"cpu", "cores", "postgres", "redis", "celery"} <= set(report["machine"])
    results = report["results"]
    assert {r["benchmark"] for r in results} == {"producer", "relay", "cleanup"}
    assert list(report["minutes"]) == ["producer", "relay", "cleanup"], "each benchmark's time, in run order"
    assert all(minutes >= 0 for minutes in report["minutes"].values())
    assert re.search(r"^minutes: producer [\d.]+, relay [\d.]+, cleanup [\d.]+; in all \d+$", completed.stdout, re.M)
    for result in results:
        if result["plain"] is not None:  # both sides measured in this run
            assert result["plain"] > 0 and result["ours"] > 0
            assert abs(result["ratio"] - result["ours"] / result["plain"]) < 1e-9
        if result["target"] is not None:  # --quick measures one round: no interval, the round decides
            assert isinstance(result["met"], bool)
            assert result["interval"] is None and result["verdict"] == ("yes" if result["met"] else "no")

    cases = {r["case"]: r for r in results}
    for broker in ("Redis", "RabbitMQ"):
        for n in (1, 10, 100):
            assert f"{broker}, N={n} in one unit of work, in-memory" in cases
            assert f"{broker}, N={n} in one unit of work, durable" in cases
        assert cases[f"{broker}, N=100 in one unit of work, durable"]["target"] == ">= 1"
        assert cases[f"{broker}, N=100 in one unit of work, durable, delivery tracking off"]["target"] == ">= 1"
        for mode in ("", ", delivery tracking off"):
            durable, floor = (cases[f"{broker}, N=100{case}{mode}"] for case in (
                " in one unit of work, durable", ", floor: in-memory unit then the durable statements"))
            if broker == "Redis":  # publishes go out in one pipeline: the interleaved row is no floor there
                assert (durable["floor"], durable["floor_met"], durable["of_floor"]) == (None, None, None)
                continue
            assert durable["floor"] == floor["ours"], "the durable row carries its floor's measurement"
            assert abs(durable["floor_ratio"] - floor["ours"] / durable["plain"]) < 1e-9
            assert abs(durable["of_floor"] - durable["ours"] / floor["ours"]) < 1e-9
            assert durable["floor_met"] is (durable["floor_ratio"] >= 1)
        for n in (1, 10):  # the realistic rows: the unit of work also writes one row of the user's data
            case = f"{broker}, N={n} in one unit of work writing one row"
            for kind in ("in-memory", "durable"):
                assert cases[f"{case}, {kind}"]["target"] == (">= 0.9" if n == 1 else None)
            in_a_session = cases[f"{case}, durable, through a Session (outbox.transaction())"]
            assert in_a_session["target"] is None and in_a_session["plain"] == cases[f"{case}, durable"]["plain"]
            floor = cases[f"{broker}, N={n} writing one row, floor: its transaction inserting the messages' rows "
                          "by hand, marked sent, with the COMMIT in one message"]
            assert floor["target"] is None and floor["plain"] == cases[f"{case}, durable"]["plain"]
            assert floor["ours"] > 0
        realistic = cases[f"{broker}, N=1 in one unit of work writing one row, durable"]
        realistic_floor = cases[f"{broker}, N=1 writing one row, floor: its transaction inserting the messages' "
                                "rows by hand, marked sent, with the COMMIT in one message"]
        assert realistic["floor"] == realistic_floor["ours"]
        spent = re.fullmatch(r"round trips to PostgreSQL per unit of work: ([A-Za-z(), ]+), then after the commit "
                             r"([A-Za-z(), ]+) \(plain Celery's: ([A-Z, ]+)\); ms per unit of work: ours ([\d.]+), .*",
                             realistic["note"])
        assert spent, realistic["note"]
        assert spent.group(3) == "BEGIN, INSERT, COMMIT", "plain Celery's unit: its row, committed"
        assert spent.group(1) == "BEGIN, INSERT, one message (INSERT, COMMIT)", \
            "ours: the row, then the message's row sent with the COMMIT"
        assert spent.group(2) == "none", "after the commit: no round trip (the rows were stored marked sent)"
        assert float(spent.group(4)) > 0
        relay = [r for r in results if r["benchmark"] == "relay" and r["case"].startswith(broker)]
        assert len(relay) == 1 and relay[0]["target"] == ">= 1"
    cleanup = [r for r in results if r["benchmark"] == "cleanup"]
    assert [(r["unit"], r["target"]) for r in cleanup] == [("rows/s", ">= 100000"), ("ms", "<= 2"), ("ms", None)]
    for p99 in cleanup[1:]:  # --quick runs one round: its own ratio is the pooled one
        assert f"each round's ratio: {p99['ratio']:.2f}" in p99["note"], p99["note"]
    written = re.search(r"; shared_buffers (\S+); pages written out by backends during each cleanup: ([\d,]+)$",
                        cleanup[1]["note"])
    assert written, cleanup[1]["note"]
    assert written.group(1)[0].isdigit(), "the server's shared_buffers, as it says it"
    assert not cleanup[2]["note"].endswith(written.group(0)), "only the durable claims' row says it"
    durable_claims, flushless = cleanup[1], cleanup[2]
    assert durable_claims["floor"] > 0, "the floor's cleanup ran beside ours, with claims of its own"
    assert abs(durable_claims["floor_ratio"] - durable_claims["floor"] / durable_claims["plain"]) < 1e-9
    assert f"the floor's: {durable_claims['floor_ratio']:.2f}" in durable_claims["note"]
    assert isinstance(durable_claims["at_floor"], bool)
    assert flushless["floor"] is None and "floor" not in flushless["note"]

    table = completed.stdout
    assert "| benchmark | case | celery-outbox | plain Celery | ratio | target | met |" in table
    assert sum(line.startswith("| producer |") for line in table.splitlines()) == sum(
        r["benchmark"] == "producer" for r in results)
    assert str(report_path) in table
    targets = sum(r["target"] is not None for r in results)
    assert f"\n{targets} targets, judged at 90% confidence or more where a row has rounds enough:\n" in table

    reprinted = subprocess.run([sys.executable, "-m", "benchmarks", "--report", str(report_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert reprinted.returncode == 0, reprinted.stderr
    heading, again = reprinted.stdout.split("\n", 1)
    assert heading == f"run of {report['started']} (--quick)"
    assert again == table.replace(f"written to {report_path}\n", ""), "the same table and summary, from the JSON"


def test_the_contention_benchmark_relays_with_one_and_two_relays_and_checks_the_invariants(tmp_path):
    """``python -m benchmarks contention``: stranded rows relayed by one relay process and by two,
    while two recovers and two workers run; every message published, delivered and run once,
    nothing left pending, and the counts that say so in the JSON."""
    for service in ("postgres", "redis"):
        require(service)
    report_path = tmp_path / "results.json"
    completed = subprocess.run([sys.executable, "-m", "benchmarks", "contention", "--quick", "--json",
                                str(report_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result,) = json.loads(report_path.read_text())["results"]
    assert (result["benchmark"], result["case"], result["unit"], result["target"]) == (
        "contention", "Redis, two relays vs one on 300 stranded rows", "rows/s", ">= 1")
    assert result["ours"] > 0 and result["plain"] > 0 and len(result["rounds"]) == 1
    checks = result["checks"]
    messages = checks["messages"]
    assert messages == 50 + 2 * 300, "the warm-up's rows and each phase's"
    assert {name: checks[name] for name in ("delivered", "deliveries", "effects", "inbox_rows")} == dict.fromkeys(
        ("delivered", "deliveries", "effects", "inbox_rows"), messages)
    assert {name: value for name, value in checks.items() if name not in (
        "messages", "delivered", "deliveries", "effects", "inbox_rows")} == dict.fromkeys(
        ("delivered_more_than_once", "effects_more_than_once", "inbox_duplicates", "inbox_recoveries",
         "inbox_not_handled", "outgoing_left", "dead_letters"), 0)
    assert "| contention | Redis, two relays vs one on 300 stranded rows (" in completed.stdout


def test_the_contention_benchmark_names_each_broken_invariant():
    """The counts of a run where things went wrong fail it, naming what broke."""
    from benchmarks.contention import broken

    held = {"messages": 10, "delivered": 10, "delivered_more_than_once": 0, "deliveries": 10, "effects": 10,
            "effects_more_than_once": 0, "inbox_rows": 10, "inbox_duplicates": 0, "inbox_recoveries": 0,
            "inbox_not_handled": 0, "outgoing_left": 0, "dead_letters": 0}
    phases = [{"published": 10, "messages": 10, "relays": [6, 4], "recovers": 0}]
    assert broken(held, phases) == []
    problems = broken({**held, "delivered_more_than_once": 1, "deliveries": 11, "effects_more_than_once": 1,
                       "effects": 11, "inbox_duplicates": 1, "outgoing_left": 2},
                      [{**phases[0], "published": 11, "recovers": 1}])
    assert problems == [
        "a phase's relays and recovers published 11 rows of 10 (relays [6, 4], recovers 1)",
        "1 messages published twice (delivered more than once)",
        "10 of 10 messages delivered, in 11 deliveries",
        "1 claims taken twice (effects written more than once)",
        "11 effect rows and 10 inbox rows for 10 messages",
        "1 duplicates discarded by the inbox",
        "2 outgoing rows left pending",
    ]


def test_cleanup_floor_deletes_every_expired_row_and_nothing_else():
    """The hand-written cleanup the p99 target is set against deletes exactly what ours would."""
    require("postgres")
    from celery import Celery

    from benchmarks.cleanup import FLOOR_BATCH, _floor_cleanup, _load
    from benchmarks.common import POSTGRES_URL, drop_store, unique_prefix
    from celery_outbox import Outbox
    from celery_outbox.store import utcnow

    outbox = Outbox(Celery("floor-cleanup", broker="memory://", set_as_current=False), database_url=POSTGRES_URL,
                    table_prefix=unique_prefix())
    try:
        outbox.ready()
        expired = 2 * FLOOR_BATCH + 7  # two full batches and a short one
        _load(outbox, expired)
        incoming = outbox.store.tables.incoming
        now = utcnow()
        with outbox.store.begin() as conn:
            conn.execute(insert(incoming).values(
                message_id="kept", destination="", task_name="t", queue="celery", status="handled", owner=0,
                received_at=now, claimed_at=now, handled_at=now, keep_until=now.replace(year=now.year + 1)))
        deleted, seconds = _floor_cleanup(outbox)
        assert deleted == expired and seconds > 0
        with outbox.store.engine.connect() as conn:
            assert conn.execute(select(incoming.c.message_id)).scalars().all() == ["kept"]
        pooled = [outbox.store.engine.connect() for _ in range(outbox.store.engine.pool.checkedin())]
        try:
            assert [conn.exec_driver_sql("SHOW synchronous_commit").scalar_one() for conn in pooled] == \
                ["on"] * len(pooled), "the floor's connection went back to the pool committing durably again"
        finally:
            for conn in pooled:
                conn.close()
    finally:
        drop_store(outbox)


@pytest.mark.parametrize("n", [1, 3])
def test_the_producer_rows_floor_inserts_the_ids_of_the_tasks_each_unit_sends(n):
    """The realistic producer row's floor, by hand, inserts each unit's rows with new message ids,
    those of the tasks it sends (in the row, its headers and its properties), as the library
    stores them, not one set of rows again and again."""
    for service in ("postgres", "redis"):
        require(service)
    from benchmarks.common import REDIS_URL, delete_queues, drop_store
    from benchmarks.producer import build
    from benchmarks.producer_row import Floor, Orders

    app, outbox, plain, durable = build(REDIS_URL)
    orders = Orders(outbox)
    sent: list[str] = []
    try:
        floor = Floor(orders, durable, n)
        real_apply_async = plain.apply_async

        def apply_async(*args, **kwargs):
            sent.append(kwargs["task_id"])
            return real_apply_async(*args, **kwargs)

        plain.apply_async = apply_async
        floor.send(plain, 2, n)
        outgoing = outbox.store.tables.outgoing
        with outbox.store.engine.connect() as conn:
            rows = conn.execute(select(outgoing.c.message_id, outgoing.c.headers, outgoing.c.properties)
                                .order_by(outgoing.c.id)).all()
        assert len(sent) == len(set(sent)) == 2 * n, "new task ids for every message"
        assert [row.message_id for row in rows] == sent, "each row carries the id of the task sent after it"
        for row in rows:
            headers, properties = json.loads(row.headers), json.loads(row.properties)
            assert headers["id"] == row.message_id and properties["correlation_id"] == row.message_id
    finally:
        orders.close()
        delete_queues(app, [f"{outbox.settings.table_prefix}plain", f"{outbox.settings.table_prefix}durable"])
        drop_store(outbox)
        app.close()


def test_worker_benchmark_drains_blocks_of_each_variant_through_one_real_worker():
    """One worker drains the blocks of every variant in turn: each message runs its body once, the
    inbox rows of ours and of the floors written by hand end handled, and each block has its
    throughput and the CPU it took, by part."""
    require("postgres")
    require("redis")
    from benchmarks.common import REDIS_URL
    from benchmarks.cpu import CPU_PARTS
    from benchmarks.worker import Run

    tasks = ["bench.plain", "bench.optimistic", "bench.floor", "bench.floor_eager"]
    run = Run(REDIS_URL, "write")
    try:
        rounds = run.blocks(tasks, rounds=2, block=10, warm_up=3)
        effects = run.metadata.tables[f"{run.env['BENCH_PREFIX']}effects"]
        inbox = run.outbox.store.tables.incoming
        with run.outbox.engine.connect() as conn:
            written = conn.execute(select(func.count()).select_from(effects)).scalar_one()
            handled = dict(conn.execute(select(inbox.c.task_name, func.count()).where(inbox.c.status == "handled")
                                        .group_by(inbox.c.task_name)).all())
            others = conn.execute(select(func.count()).select_from(inbox).where(inbox.c.status != "handled")
                                  ).scalar_one()
        leftover = list(run.marks.scan_iter(f"{run.marks_key}:*"))
    finally:
        run.close()
    assert written == len(tasks) * (3 + 2 * 10), "each body's one write, once"
    assert handled == {task: 3 + 2 * 10 for task in tasks[1:]} and others == 0
    assert [sorted(each) for each in rounds] == [sorted(tasks)] * 2
    for each in rounds:
        for block in each.values():
            assert block["rate"] > 0 and set(block["cpu"]) == set(CPU_PARTS)
            assert all(spent >= 0 for spent in block["cpu"].values())
    assert leftover == [], "the marks are read once and deleted"


def test_worker_benchmark_measures_the_durable_queue_beside_the_plain_one():
    """A durable round: the plain task's messages stored by the outbox and relayed to the durable
    queue, drained by one worker, then the same through the plain queue by another, then the
    optimistic IdempotentTask's and the durable-queue task's floor's by a third and a fourth, and
    the optimistic IdempotentTask's from the durable queue by a fifth."""
    require("postgres")
    require("redis")
    from benchmarks.common import REDIS_URL
    from benchmarks.worker import DURABLE, DURABLE_FLOOR, DURABLE_OPTIMISTIC, OPTIMISTIC, PLAIN, Run

    run = Run(REDIS_URL, "write")
    try:
        measured = run.durable_round(15)
        effects = run.metadata.tables[f"{run.env['BENCH_PREFIX']}effects"]
        with run.outbox.engine.connect() as conn:
            written = conn.execute(select(func.count()).select_from(effects)).scalar_one()
    finally:
        run.close()
    assert set(measured) == {DURABLE, PLAIN, OPTIMISTIC, DURABLE_FLOOR, DURABLE_OPTIMISTIC}
    assert all(block["rate"] > 0 for block in measured.values())
    assert written == 5 * 15, "each block's messages ran once each"


def test_worker_benchmark_measures_a_worker_that_is_a_node_beside_one_that_is_not():
    """A node round: the optimistic IdempotentTask's messages drained by a worker that is a node and
    by one that is not (``BENCH_WITHOUT_NODE``), each a worker of its own; each message runs once."""
    require("postgres")
    require("redis")
    from benchmarks.common import REDIS_URL
    from benchmarks.worker import NODE, WITHOUT_NODE, Run

    run = Run(REDIS_URL, "write")
    try:
        measured = run.node_round(1, 15)
        effects = run.metadata.tables[f"{run.env['BENCH_PREFIX']}effects"]
        with run.outbox.engine.connect() as conn:
            written = conn.execute(select(func.count()).select_from(effects)).scalar_one()
    finally:
        run.close()
    assert set(measured) == {NODE, WITHOUT_NODE}
    assert all(block["rate"] > 0 for block in measured.values())
    assert written == 2 * 15, "each block's messages ran once each"


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_worker_benchmark_floor_runs_a_redelivered_message_no_second_time(style):
    """A floor is an inbox too: a second delivery of a message finds its row and runs no body."""
    require("postgres")
    from benchmarks import worker_app
    from benchmarks.common import POSTGRES_URL, REDIS_URL, drop_store, unique_prefix

    prefix = unique_prefix()
    app, outbox, metadata = worker_app.create(REDIS_URL, POSTGRES_URL, prefix, "bench_q", "bench_dq", "write",
                                              REDIS_URL)
    outbox.ready()
    metadata.create_all(outbox.engine)
    effects, inbox = metadata.tables[f"{prefix}effects"], outbox.store.tables.incoming
    floor = worker_app.Floor(POSTGRES_URL, inbox.name, outbox.store.tables.outgoing.name)

    def body(n: int):
        return lambda connection: connection.execute(insert(effects).values(n=n))

    try:
        run = getattr(floor, style)
        for n in (1, 2):  # the same message twice, each delivery with its own body's write
            run("message-1", "bench.floor", "bench_q", body(n))
        run("message-2", "bench.floor", "bench_q", body(3))
        with outbox.engine.connect() as conn:
            written = sorted(conn.execute(select(effects.c.n)).scalars())
            statuses = dict(conn.execute(select(inbox.c.message_id, inbox.c.status)).all())
    finally:
        floor.close()
        metadata.drop_all(outbox.engine)
        drop_store(outbox)
    assert written == [1, 3]
    assert statuses == {"message-1": "handled", "message-2": "handled"}


# a Python program that burns the given CPU seconds
BURN = "import sys, time\nend = time.process_time() + {}\nwhile time.process_time() < end: pass\n"


def test_worker_benchmark_counts_cpu_of_the_worker_its_pool_postgres_and_the_broker():
    """``cpu_seconds`` gives the CPU of the session's leader (the worker's main process) to
    "worker", that of the session's other processes (its pool) to "pool", and finds PostgreSQL's
    and the broker's processes."""
    require("postgres")
    require("redis")
    from benchmarks.cpu import CPU_PARTS, cpu_seconds

    child = BURN.format(0.6) + "print('burnt', flush=True)\nsys.stdin.readline()"
    leader = subprocess.Popen(  # burns 0.3 s itself, then starts a child that burns 0.6 s and waits
        [sys.executable, "-c", BURN.format(0.3) + "import subprocess\n"
         f"child = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=subprocess.PIPE, "
         "stdout=subprocess.PIPE, text=True)\nchild.stdout.readline()\nprint('burnt', flush=True)\n"
         "sys.stdin.readline()\nchild.stdin.close()\nchild.wait()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout.readline().strip() == "burnt"
        spent = cpu_seconds(leader.pid)
    finally:
        leader.stdin.close()
        leader.wait(timeout=30)
    assert set(spent) == set(CPU_PARTS) == {"worker", "pool", "PostgreSQL", "broker"}
    # at the clock's 10 ms ticks: the leader's 0.3 s and its start, not its child's 0.6 s
    assert 0.25 <= spent["worker"] < 0.55, spent
    assert spent["pool"] >= 0.55, spent
    assert spent["PostgreSQL"] > 0 and spent["broker"] > 0, spent
    ended = cpu_seconds(leader.pid)
    assert ended["worker"] == ended["pool"] == 0, "an ended session spends nothing"


def test_worker_benchmark_cpu_of_a_block_never_goes_below_zero_when_a_process_ends():
    """A process that ends between a block's two readings is not counted (its CPU would otherwise
    leave the part's sum: a pool process, another client's PostgreSQL backend); the processes
    that run at the end count from the start."""
    from benchmarks.cpu import cpu_by_process, spent_between

    child = BURN.format(0.4) + "print('burnt', flush=True)\nsys.stdin.readline()"
    leader = subprocess.Popen(  # starts a child that burns 0.4 s and waits; ends it; burns 0.3 s itself
        [sys.executable, "-c", "import subprocess, sys\n"
         f"child = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=subprocess.PIPE, "
         "stdout=subprocess.PIPE, text=True)\nchild.stdout.readline()\nprint('child burnt', flush=True)\n"
         "sys.stdin.readline()\nchild.stdin.close()\nchild.wait()\n" + BURN.format(0.3)
         + "print('burnt', flush=True)\nsys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout.readline().strip() == "child burnt"
        start = cpu_by_process(leader.pid)
        assert sum(start["pool"].values()) >= 0.35, start
        leader.stdin.write("\n")
        leader.stdin.flush()
        assert leader.stdout.readline().strip() == "burnt"
        spent = spent_between(start, cpu_by_process(leader.pid))
    finally:
        leader.stdin.close()
        leader.wait(timeout=30)
    assert spent["pool"] == 0, "the ended child is not counted, and takes nothing away"
    assert 0.25 <= spent["worker"] < 0.55, spent
    assert all(seconds >= 0 for seconds in spent.values()), spent


def test_attempt_cost_runs_each_variant_through_celerys_tracer_and_leaves_no_tables(monkeypatch):
    """``python -m benchmarks.attempt`` runs the worker benchmark's tasks in one process, each
    with its real database work, and drops the tables it made."""
    require("postgres")
    from benchmarks import attempt
    from benchmarks.common import POSTGRES_URL, unique_prefix

    prefixes = []

    def recorded_prefix() -> str:  # the tables' prefix of each run: other tests make tables meanwhile
        prefixes.append(unique_prefix())
        return prefixes[-1]

    monkeypatch.setattr(attempt, "unique_prefix", recorded_prefix)
    engine = create_engine(POSTGRES_URL)
    try:
        for _, task_name in attempt.VARIANTS:
            assert attempt.run_tasks(task_name, 3, "write") > 0, task_name
        assert len(prefixes) == len(attempt.VARIANTS), "each variant on tables of its own"
        left = [name for name in inspect(engine).get_table_names() if name.startswith(tuple(prefixes))]
        assert left == [], "the tables each variant made are dropped"
    finally:
        engine.dispose()


def test_attempt_cost_counts_the_tasks_between_its_marks_apart_from_start_up():
    """Under callgrind, one process's count is split at the marks after the first quarter of the
    tasks and after the last: the part between them holds the tasks after the first quarter,
    and start-up (the imports, the tables) is counted before it."""
    require("postgres")
    from benchmarks import attempt

    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    counted = attempt.instructions("bench.optimistic", 6, "noop")
    assert counted.tasks == 5, "the first of six tasks is warming up, before the first mark"
    assert counted.counted > 0 and counted.after > 0
    assert counted.before > 10 * counted.per_task, "start-up is counted before the first mark, not per task"


def test_the_calibration_is_measured_on_the_real_services_and_leaves_nothing_behind(monkeypatch):
    """A full run's first step times plain Celery's unit of work writing one row (PostgreSQL, then
    a publish to Redis): the host's slowdown against the reference host; its tables are dropped
    after."""
    for service in ("postgres", "redis"):
        require(service)
    from benchmarks import producer
    from benchmarks.common import POSTGRES_URL, unique_prefix
    from benchmarks.pace import REFERENCE_MS, measure

    prefix = unique_prefix()
    monkeypatch.setattr(producer, "unique_prefix", lambda: prefix)
    engine = create_engine(POSTGRES_URL)
    made: list[str] = []
    real_create_all = MetaData.create_all

    def create_all(metadata, *args, **kwargs):
        made.extend(metadata.tables)
        return real_create_all(metadata, *args, **kwargs)

    monkeypatch.setattr(MetaData, "create_all", create_all)
    try:
        calibration = measure()
        left = [name for name in inspect(engine).get_table_names() if name.startswith(prefix)]
    finally:
        engine.dispose()
    assert calibration.ms_per_unit > 0
    assert calibration.slowdown == pytest.approx(calibration.ms_per_unit / REFERENCE_MS)
    assert f"{prefix}orders" in made, "the calibration wrote its rows in a table of its own"
    assert left == [], "the calibration's tables are dropped"
