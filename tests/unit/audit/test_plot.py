"""The report's plot parts: ticks at round values, four to six of them on a count axis, labels that fit
side by side, and marker labels in rows that never overlap."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from celery_outbox.audit.plot import (
    GAP,
    X0,
    X1,
    count_ticks,
    latency_ticks,
    log_domain,
    place_labels,
    time_ticks,
    width_of,
)


def is_round(value: float) -> bool:
    """1, 2 or 5 × 10ⁿ (or zero)."""
    if value == 0:
        return True
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return any(math.isclose(mantissa, m) for m in (1, 2, 5))


def assert_fit_side_by_side(ticks: list[tuple[float, float, str]]) -> None:
    for (x, _, label), (next_x, _, next_label) in zip(ticks, ticks[1:], strict=False):
        assert next_x - x >= (width_of(label) + width_of(next_label)) / 2 + GAP, f"{label!r} crowds {next_label!r}"


@pytest.mark.parametrize("peak", [0, 1, 3, 7, 27, 99, 100, 501, 900, 12_345, 4_100_000])
def test_count_ticks_are_four_to_six_round_steps_from_zero_past_the_peak(peak):
    ticks = count_ticks(peak)
    assert 4 <= len(ticks) <= 6 and ticks[0] == 0 and ticks[-1] >= peak
    step = ticks[1]
    assert is_round(step) and all(b - a == step for a, b in zip(ticks, ticks[1:], strict=False))


@pytest.mark.parametrize("low, high", [(0.001, 0.005), (0.25, 5.0), (0.1, 0.25), (0.001, 100.0), (0.005, 86400.0 * 3),
                                       (60.0, 900.0)])
def test_latency_ticks_are_round_fit_and_are_at_least_four(low, high):
    start, end = log_domain(low, high)
    assert start <= low and end >= high and end / start >= 10

    def x_of(value: float) -> float:
        return X0 + (X1 - X0) * math.log(value / start) / math.log(end / start)

    ticks = latency_ticks(start, end, x_of)
    assert 4 <= len(ticks) <= 9, ticks
    for _, value, label in ticks:
        unit = next(u for u in (86400, 3600, 60, 1, 0.001) if value >= u)
        assert is_round(value / unit) or (unit == 60 and value / unit in (10, 20, 50)), label
    assert_fit_side_by_side(ticks)


@pytest.mark.parametrize("span, unit", [(timedelta(minutes=3), timedelta(minutes=1)),
                                        (timedelta(minutes=23), timedelta(minutes=1)),
                                        (timedelta(seconds=40), timedelta(seconds=1)),
                                        (timedelta(hours=30), timedelta(minutes=1)),
                                        (timedelta(days=9), timedelta(hours=1))])
def test_time_ticks_sit_on_round_clock_steps_of_at_least_the_period_and_fit(span, unit):
    start = datetime(2026, 11, 1, 12, 0, 7, tzinfo=timezone.utc)
    end = start + span

    def x_of(moment: datetime) -> float:
        return X0 + (X1 - X0) * (moment - start) / span

    ticks = time_ticks(start, end, x_of, unit)
    assert 3 <= len(ticks) <= 7, [label for _, _, label in ticks]
    steps = {b - a for (_, a, _), (_, b, _) in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1 and (step := steps.pop()) >= unit.total_seconds()
    assert all(value % step == 0 for _, value, _ in ticks), "on multiples of the step"
    assert_fit_side_by_side(ticks)


@pytest.mark.parametrize("xs", [[300.0, 500.0, 500.0], [300.0, 500.0, 500.5], [X1, X1, X1], [X0, X0 + 1, X1]])
def test_marker_labels_take_rows_where_they_overlap_nothing_and_stay_inside_the_frame(xs):
    labels = [(x, f"{name} 1.2s") for x, name in zip(xs, ("p50", "p95", "p99"), strict=True)]
    placed = place_labels(labels)
    assert [label for _, _, label in placed] == [label for _, label in labels]
    for i, (row, left, label) in enumerate(placed):
        assert X0 <= left and left + width_of(label) <= X1
        for other_row, other_left, other in placed[i + 1:]:
            apart = left + width_of(label) + GAP <= other_left or other_left + width_of(other) + GAP <= left
            assert row != other_row or apart, f"{label!r} and {other!r} share a row and overlap"
