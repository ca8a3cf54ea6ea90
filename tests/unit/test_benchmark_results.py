"""A benchmark result row: its ratio, whether its target is met, and whether its floor (the least
any implementation of the guarantee must do, measured in the same run) could meet it."""

from __future__ import annotations

import pytest

from benchmarks.common import Result, table


def test_a_row_without_a_floor_says_only_whether_its_target_is_met():
    row = Result("relay", "Redis", "msg/s", 300.0, plain=100.0, target=(">=", 1.0))
    assert (row.ratio, row.met, row.floor_ratio, row.floor_met) == (3.0, True, None, None)
    assert row.as_dict()["of_floor"] is None
    assert table([row]).splitlines()[-1].endswith("| 3.00 | >= 1 (ratio) | yes |")


@pytest.mark.parametrize(("floor", "verdict"), [(80.0, "beyond"), (90.0, "within")])
def test_a_row_with_a_floor_says_whether_the_floor_itself_meets_the_target(floor, verdict):
    row = Result("worker", "Redis, optimistic", "tasks/s", 76.0, plain=100.0, target=(">=", 0.85), floor=floor)
    data = row.as_dict()
    assert row.met is False
    assert row.floor_ratio == pytest.approx(floor / 100.0)
    assert row.floor_met is (verdict == "within")
    assert (data["floor"], data["floor_met"]) == (floor, row.floor_met)
    assert data["of_floor"] == pytest.approx(76.0 / floor)
    assert table([row]).splitlines()[-1].endswith(
        f"| 0.76 | >= 0.85 (ratio) | **no** (floor {floor / 100:.2f}: {verdict} this machine; "
        f"ours {76.0 / floor:.2f} of it) |")


def test_a_row_of_rounds_gives_the_medians_and_pairs_each_ratio_within_its_round():
    """In the second round the machine ran twice as fast while plain Celery took its turn, and
    slowed down again for ours: the median of the rounds' own ratios keeps the 0.9 of the other
    two, while the best of each side, taken from different moments, would report 0.5."""
    rounds = [(90.0, 100.0, 90.0), (100.0, 200.0, 100.0), (99.0, 110.0, 99.0)]
    row = Result.of_rounds("worker", "Redis, optimistic", "tasks/s", rounds, target=(">=", 0.85))
    assert (row.ours, row.plain, row.floor) == (99.0, 110.0, 99.0), "each side's median"
    assert row.ratio == pytest.approx(0.9) and row.met is True
    assert row.floor_ratio == pytest.approx(0.9) and row.of_floor == pytest.approx(1.0)
    assert max(r[0] for r in rounds) / max(r[1] for r in rounds) == 0.5, "what the best of each would say"
    data = row.as_dict()
    assert data["rounds"] == rounds and data["ratio"] == pytest.approx(0.9)
    assert table([row]).splitlines()[-1].endswith("| 0.90 | >= 0.85 (ratio) | yes (floor 0.90: within this "
                                                  "machine; ours 1.00 of it) |")


def test_a_row_of_rounds_without_a_floor_has_none():
    row = Result.of_rounds("worker", "Redis, plain task, acks_late", "tasks/s",
                           [(80.0, 100.0, None), (45.0, 50.0, None)])
    assert (row.floor, row.floor_ratio, row.of_floor) == (None, None, None)
    assert row.ratio == pytest.approx(0.85)


def test_a_worker_variants_cpu_per_task_comes_from_the_round_of_its_median_throughput():
    from benchmarks.worker import Run

    run = Run.__new__(Run)  # no services: only the samples the measurements recorded
    run.cpu = {("bench.optimistic", False): [(500.0, {"worker": 3e-3}), (300.0, {"worker": 1e-3}),
                                             (400.0, {"worker": 2e-3})]}
    assert run.cpu_per_task("bench.optimistic", False) == {"worker": 2e-3}
    assert run.cpu_per_task("bench.plain", False) == {}, "a variant never measured has no CPU to report"
