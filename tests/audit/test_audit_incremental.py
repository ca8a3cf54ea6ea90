"""Incremental audits: a run into the same --out reads only the archive files its ledger has not
covered, plus the messages still open, and reports what a full run of the whole archive reports."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from celery_outbox.audit import ledger as ledger_module
from celery_outbox.audit.archive import ParquetArchiver
from celery_outbox.audit.job import AuditOptions, run_audit

from .conftest import T0, dead_letter, incoming, sent

DAY = timedelta(days=1)
#: figures a run fills in for itself: when and where it ran, the rows it read, its ledger
OF_THE_RUN = ("generated_at", "spark", "ledger")
AGGREGATES = ("latency_by_task", "latency_by_hour", "throughput", "dead_letters", "lost")


def count_files(archive: Path) -> int:
    return sum(1 for _ in archive.rglob("*.parquet"))


def write_day(archiver: ParquetArchiver, day: int) -> None:
    """One day of traffic, ``day`` days after T0, with messages that end on a later day.

    Messages ``d{day}-{n}``: n < 6 sent and handled the same day (n = 1 late, n = 2 with duplicates
    discarded, n = 5 retried first); n = 6 and 7 sent today within the grace period of an audit
    two hours into the day, and handled the next day (7 after a retry today), both late; n = 8
    dead-lettered; n = 9 sent today, never handled (lost). A message of the
    day before ends today, and yesterday's inbox batch is archived again, as an at-least-once
    archive may. A poison letter of no send on day 0."""
    base = T0 + day * DAY

    def at(n, of_day=day):
        return T0 + of_day * DAY + timedelta(minutes=n + 90 * (n in (6, 7)))

    def named(row, n, of_day=day):
        row.message_id = f"d{of_day}-{n}"
        return row

    def took(n):
        return timedelta(seconds=0.2 + n / 10 + 90 * (n == 1))

    sends = [named(sent(n, at(n)), n) for n in range(10)]
    handled = [named(incoming(n, "handled", at(n) + took(n), duplicates=3 * (n == 2)), n) for n in range(6)]
    handled += [named(incoming(5, "retried", at(5) + timedelta(seconds=0.1)), 5),
                named(incoming(7, "retried", at(7) + timedelta(seconds=1)), 7),
                named(incoming(8, "dead", at(8) + timedelta(seconds=1)), 8)]
    letters = [dead_letter(100 * day + 8, f"d{day}-8", "failed", "ValueError")]
    if day == 0:
        letters.append(dead_letter(1, "poison-1", "poison", None))
    if day > 0:  # yesterday's 6 and 7 end today, 6 late; yesterday's inbox batch archived again
        handled += [named(incoming(6, "handled", at(6, day - 1) + timedelta(seconds=200)), 6, day - 1),
                    named(incoming(7, "handled", base + timedelta(seconds=3)), 7, day - 1)]
        handled += [named(incoming(n, "handled", at(n, day - 1) + took(n), duplicates=3 * (n == 2)), n, day - 1)
                    for n in range(5)]
    archiver.archive("sent", sends)
    archiver.archive("incoming", handled)
    archiver.archive("dead_letters", letters)


def audit(out: Path, archive: Path, spark, now, **options) -> dict:
    return run_audit(AuditOptions(out=str(out), archive=str(archive), now=now, **options), spark)


def comparable(summary: dict) -> dict:
    """The summary without what only says how the run went (the archive rows it read included)."""
    kept = {key: value for key, value in summary.items() if key not in OF_THE_RUN}
    kept["inputs"] = dict(kept["inputs"], archive=dict(kept["inputs"]["archive"], rows=None))
    return kept


def aggregates(out: Path) -> dict[str, list[dict]]:
    return {name: sorted(pq.read_table(out / "aggregates" / name).to_pylist(), key=repr) for name in AGGREGATES}


# The days whose incremental run is compared with a full run of the same archive: the first
# incremental run (on the first run's ledger) and the last (on a chain of incremental ledgers).
# Day 0's run is a full run itself; day 2's comparison repeats day 3's.
COMPARED_DAYS = (1, 3)


def test_each_run_reads_only_the_new_files_and_reports_what_a_full_run_reports(spark, tmp_path):
    archive, out = tmp_path / "archive", tmp_path / "daily"
    archiver = ParquetArchiver(str(archive))
    covered = 0
    for day in range(4):
        write_day(archiver, day)
        now = T0 + day * DAY + timedelta(hours=2)
        files = count_files(archive)
        daily = audit(out, archive, spark, now)
        if day in COMPARED_DAYS:
            full = audit(tmp_path / f"full-{day}", archive, spark, now)
            assert comparable(daily) == comparable(full), f"day {day}"
            assert aggregates(out) == aggregates(tmp_path / f"full-{day}"), f"day {day}"
            assert full["ledger"]["files_read"] == files
        ledger = daily["ledger"]
        assert ledger["mode"] == ("full" if day == 0 else "incremental")
        assert ledger["files_covered_before"] == covered and ledger["files_read"] == files - covered
        assert daily["inputs"]["archive"]["rows"]["sent"] == 10, "the new day's sends alone were read"
        covered = files
    # day 3: days 0 and 1 are settled (ended, a day older than the newest row); what is open is carried
    assert ledger["sends_settled"] > ledger["sends_settled_before"] > 0
    assert ledger["messages_carried"] == 15, \
        "day 3, day 2's 6 and 7 (within a day of the watermark) and 9, and the lost d0-9 and d1-9: not the history"
    assert daily["lost"] == 4 and sorted(e["message_id"] for e in daily["lost_examples"]) == [
        "d0-9", "d1-9", "d2-9", "d3-9"], "lost messages are carried however old"
    assert daily["sent"] == 40 and daily["handled"] == 30 and daily["dead_lettered"] == 5
    assert daily["duplicates_discarded"] == 12 and daily["late"] == 10


def test_a_message_open_at_the_watermark_ends_in_a_later_run(spark, tmp_path):
    archive, out = tmp_path / "archive", tmp_path / "out"
    archiver = ParquetArchiver(str(archive))
    archiver.archive("sent", [sent(1, T0)])
    first = audit(out, archive, spark, T0 + timedelta(hours=3))
    assert first["lost"] == 1 and first["handled"] == 0
    late = incoming(1, "handled", T0 + 5 * DAY)
    archiver.archive("incoming", [late])
    second = audit(out, archive, spark, T0 + 5 * DAY)
    assert second["ledger"]["mode"] == "incremental" and second["ledger"]["files_read"] == 1
    assert (second["lost"], second["handled"], second["late"]) == (0, 1, 1)
    assert second["latency_seconds"]["max"] == pytest.approx(5 * 86400)


def test_a_ledger_of_another_basis_or_full_reads_everything(spark, tmp_path):
    archive, out = tmp_path / "archive", tmp_path / "out"
    archiver = ParquetArchiver(str(archive))
    write_day(archiver, 0)
    now = T0 + timedelta(hours=2)
    audit(out, archive, spark, now)
    changed = audit(out, archive, spark, now, late_after_seconds=30.0)
    assert changed["ledger"]["mode"] == "full"
    assert changed["ledger"]["why_full"] == "the ledger was made with late_after_seconds 60.0, this run has 30.0"
    forced = audit(out, archive, spark, now, late_after_seconds=30.0, full=True)
    assert (forced["ledger"]["mode"], forced["ledger"]["why_full"]) == ("full", "--full")
    again = audit(out, archive, spark, now, late_after_seconds=30.0)
    assert again["ledger"]["mode"] == "incremental" and again["ledger"]["files_read"] == 0
    assert comparable(again) == comparable(forced)
    assert ledger_folders(out) == [json.loads((out / "ledger" / "current.json").read_text())["run"]], \
        "each replaced ledger is deleted"


def test_a_run_that_fails_before_its_ledger_is_in_force_leaves_the_last_one(spark, tmp_path, monkeypatch):
    archive, out = tmp_path / "archive", tmp_path / "out"
    archiver = ParquetArchiver(str(archive))
    write_day(archiver, 0)
    audit(out, archive, spark, T0 + timedelta(hours=2))
    in_force = json.loads((out / "ledger" / "current.json").read_text())
    write_day(archiver, 1)
    real_write = ledger_module.write_text

    def crash_on_the_pointer(spark_session, uri, text):
        if uri.endswith("current.json"):
            raise OSError("the disk is gone")
        real_write(spark_session, uri, text)

    monkeypatch.setattr(ledger_module, "write_text", crash_on_the_pointer)
    now = T0 + DAY + timedelta(hours=2)
    with pytest.raises(OSError):
        audit(out, archive, spark, now)
    monkeypatch.undo()
    assert json.loads((out / "ledger" / "current.json").read_text()) == in_force
    resumed = audit(out, archive, spark, now)
    assert resumed["ledger"]["mode"] == "incremental"
    assert resumed["ledger"]["files_read"] == count_files(archive) - resumed["ledger"]["files_covered_before"] > 0
    assert comparable(resumed) == comparable(audit(tmp_path / "full", archive, spark, now))
    assert len(ledger_folders(out)) == 1, "the failed run's folder is deleted too"


def ledger_folders(out: Path) -> list[str]:
    return [path.name for path in (out / "ledger").iterdir() if path.name.startswith("run-")]


def test_a_one_off_audit_keeps_no_ledger_and_reports_the_same(spark, tmp_path):
    archive = tmp_path / "archive"
    archiver = ParquetArchiver(str(archive))
    for day in range(2):
        write_day(archiver, day)
    now = T0 + DAY + timedelta(hours=2)
    one_off = audit(tmp_path / "one-off", archive, spark, now, ledger=False)
    assert one_off["ledger"] == {"mode": "full", "why_full": "--no-ledger", "recorded": False}
    assert not (tmp_path / "one-off" / "ledger").exists()
    assert comparable(one_off) == comparable(audit(tmp_path / "kept", archive, spark, now))


def test_a_row_stamped_ahead_of_the_runs_clock_does_not_move_the_watermark_past_it(spark, tmp_path):
    """A node whose clock runs 30 days fast archives one row; then cleanup's at-least-once archive
    repeats five handled rows. The incremental run still reports what a full run reports: the
    watermark is bounded by the run's own clock, so the repeated messages were still carried."""
    archive, out = tmp_path / "archive", tmp_path / "daily"
    archiver = ParquetArchiver(str(archive))
    write_day(archiver, 0)
    ahead = incoming(3, "handled", T0 + 30 * DAY)
    ahead.message_id = "ahead-3"
    archiver.archive("incoming", [ahead])
    first = audit(out, archive, spark, T0 + timedelta(hours=2))
    assert first["ledger"]["watermark"] <= (T0 + timedelta(hours=2)).replace(tzinfo=None).isoformat()
    repeats = [incoming(n, "handled", T0 + timedelta(minutes=n, seconds=1)) for n in range(5)]
    for n, row in enumerate(repeats):
        row.message_id = f"d0-{n}"
    archiver.archive("incoming", repeats)
    now = T0 + timedelta(hours=3)
    daily = audit(out, archive, spark, now)
    assert daily["ledger"]["mode"] == "incremental"
    assert comparable(daily) == comparable(audit(tmp_path / "full", archive, spark, now))
