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
