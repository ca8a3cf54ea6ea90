"""A benchmark result row: its ratio, whether its target is met, and whether its floor (the least
any implementation of the guarantee must do, measured in the same run) could meet it."""

from __future__ import annotations

import json
import statistics

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


def test_a_worker_variants_cpu_per_task_is_the_mean_over_its_blocks():
    from benchmarks.worker import mean_cpu

    def block(rate: float, worker: float) -> dict:
        return {"rate": rate, "cpu": {"worker": worker, "pool": worker / 2, "PostgreSQL": worker / 10, "broker": 0.0}}

    blocks = [block(500.0, 3e-3), block(300.0, 1e-3), block(400.0, 2.6e-3)]
    assert mean_cpu(blocks) == pytest.approx({"worker": 2.2e-3, "pool": 1.1e-3, "PostgreSQL": 2.2e-4, "broker": 0.0})
    assert mean_cpu([]) == {}, "a variant never measured has no CPU to report"


def test_a_worker_variants_cpu_note_compares_it_with_plain_and_with_its_floor():
    from benchmarks.worker import cpu_note

    ours = {"worker": 1.3e-3, "pool": 1e-3, "PostgreSQL": 2e-4, "broker": 1e-4}
    plain = {"worker": 9e-4, "pool": 8e-4, "PostgreSQL": 0.0, "broker": 1e-4}
    floor = {"worker": 1.35e-3, "pool": 9e-4, "PostgreSQL": 2.4e-4, "broker": 1e-4}
    assert cpu_note(ours, plain, floor) == ("CPU µs/task: worker 1300, pool 1000, PostgreSQL 200, broker 100 "
                                            "(+800 vs plain, +10 vs floor)")
    assert cpu_note(ours, plain).endswith("(+800 vs plain)"), "a variant without a floor compares with plain alone"
    assert cpu_note({}, plain) == ""


@pytest.mark.parametrize(("count", "k", "coverage"), [(5, 1, 1 - 2 / 32), (12, 3, 1 - 2 * 79 / 4096),
                                                     (20, 6, 1 - 2 * 21700 / 2**20)])
def test_the_median_interval_is_the_widest_pair_of_order_statistics_the_confidence_needs(count, k, coverage):
    """Between the k-th lowest and the k-th highest of n values lies the median with probability
    1 - 2 P(Binomial(n, 1/2) < k): the interval takes the largest k that keeps it at 0.9 or more."""
    from benchmarks.common import median_interval

    values = [float(v) for v in reversed(range(count))]  # any order
    assert median_interval(values) == (k - 1, count - k)
    assert coverage >= 0.9
    assert median_interval(values, confidence=coverage + 1e-9) == ((k - 2, count - k + 1) if k > 1 else None)


def test_too_few_rounds_give_no_interval_and_the_one_measurement_decides():
    from benchmarks.common import median_interval

    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None, "four values cover the median with 0.875 only"
    row = Result.of_rounds("producer", "Redis, durable", "msg/s", [(90.0, 100.0, None)] * 4, target=(">=", 0.85))
    assert row.interval is None and row.verdict == "yes"
    assert table([row]).splitlines()[-1].endswith("| 0.90 | >= 0.85 (ratio) | yes |")


def _rounds(ratios: list[float], floors: list[float] | None = None) -> list[tuple[float, float, float | None]]:
    """Rounds with plain Celery at 100 and ours (and the floor) at the given ratios."""
    return [(100.0 * ratio, 100.0, None if floors is None else 100.0 * floor)
            for ratio, floor in zip(ratios, floors or ratios, strict=True)]


@pytest.mark.parametrize(("ratios", "verdict"), [
    ([0.86, 0.87, 0.88, 0.90, 0.95], "yes"),
    ([0.70, 0.75, 0.80, 0.82, 0.84], "no"),
    ([0.80, 0.83, 0.84, 0.86, 0.90], "undecided"),  # the median misses, the highest round meets it
    ([0.84, 0.86, 0.87, 0.88, 0.95], "undecided"),  # the median meets it, the lowest round misses
])
def test_a_verdict_is_decided_only_where_the_rounds_interval_lies_on_one_side_of_the_target(ratios, verdict):
    row = Result.of_rounds("worker", "Redis, optimistic", "tasks/s", _rounds(ratios), target=(">=", 0.85))
    assert row.interval == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    assert row.verdict == verdict
    assert row.met is (statistics.median(ratios) >= 0.85), "met stays the median's own"
    cell = {"yes": "yes", "no": "**no**", "undecided": "undecided"}[verdict]
    assert table([row]).splitlines()[-1].endswith(f"| {cell}, {min(ratios):.2f}–{max(ratios):.2f} |")
    assert row.as_dict()["verdict"] == verdict


def test_a_target_on_ours_alone_is_judged_on_the_interval_of_ours():
    row = Result.of_rounds("cleanup", "delete 1 M handled inbox rows", "rows/s",
                           [(rate, None, None) for rate in (95e3, 120e3, 125e3, 130e3, 140e3)],
                           target=(">=", 100_000))
    assert (row.plain, row.ratio, row.ours) == (None, None, 125e3)
    assert row.interval == (95e3, 140e3) and row.met is True and row.verdict == "undecided"
    assert table([row]).splitlines()[-1].endswith("| >= 100000 | undecided, 95,000–140,000 |")


@pytest.mark.parametrize(("floors", "of_floor", "floor_verdict", "at_floor", "words"), [
    ([0.70, 0.72, 0.74, 0.75, 0.80], [0.95, 1.0, 1.0, 1.02, 1.03], "beyond", True,
     "(floor 0.74, 0.70–0.80: beyond this machine; ours 1.00 of it, 0.95–1.03: at its floor)"),
    ([0.80, 0.84, 0.86, 0.88, 0.90], [0.9, 0.95, 0.97, 1.0, 1.01], "undecided", True,
     "(floor 0.86, 0.80–0.90: undecided here; ours 0.97 of it, 0.90–1.01: at its floor)"),
    ([0.90, 0.92, 0.95, 0.98, 0.99], [0.8, 0.82, 0.85, 0.9, 0.95], "within", False,
     "(floor 0.95, 0.90–0.99: within this machine; ours 0.85 of it, 0.80–0.95: short of its floor)"),
])
def test_a_floor_is_judged_by_its_own_interval_and_ours_against_it(floors, of_floor, floor_verdict, at_floor,
                                                                   words):
    """A floor's own interval says whether any implementation can meet the target here; that of
    ours / floor, whether ours is at its floor within the host's noise or measurably below it."""
    row = Result.of_rounds("worker", "RabbitMQ, optimistic", "tasks/s",
                           [(100 * f * o, 100.0, 100 * f) for f, o in zip(floors, of_floor, strict=True)],
                           target=(">=", 0.85))
    assert row.floor_interval == (pytest.approx(min(floors)), pytest.approx(max(floors)))
    assert row.of_floor_interval == (pytest.approx(min(of_floor)), pytest.approx(max(of_floor)))
    assert row.floor_verdict == floor_verdict
    assert row.at_floor is at_floor
    assert table([row]).splitlines()[-1].endswith(f"{words} |")
    data = row.as_dict()
    assert (data["floor_verdict"], data["at_floor"]) == (floor_verdict, at_floor)
    assert data["floor_interval"] == row.floor_interval


@pytest.mark.parametrize(("ours", "at_floor"), [((1.7, 1.8, 2.0, 2.2, 2.4), True), ((3.6, 3.8, 4.0, 4.4, 4.6), False)])
def test_a_latency_floor_counts_ours_at_it_when_ours_is_not_measurably_slower(ours, at_floor):
    """With a target on the lower side (a p99 ratio), ours is at its floor when the interval of
    ours / floor reaches 1 from below, and beyond, where ours is the better of the two."""
    floors = (2.6, 2.8, 3.0, 3.2, 3.4)
    row = Result.of_rounds("cleanup", "p99", "ms", [(o, 1.0, f) for o, f in zip(ours, floors, strict=True)],
                           target=("<=", 2.0))
    assert row.floor_verdict == "beyond"
    assert row.at_floor is at_floor
    assert table([row]).splitlines()[-1].endswith(": at its floor) |" if at_floor else ": short of its floor) |")


def test_the_verdicts_sort_every_target_into_one_group():
    from benchmarks.common import verdicts

    met = Result.of_rounds("relay", "Redis", "msg/s", _rounds([1.2] * 5), target=(">=", 1.0))
    beyond = Result.of_rounds("worker", "Redis, eager", "tasks/s", _rounds([0.6] * 5, [0.6] * 5), target=(">=", 0.75))
    below = Result.of_rounds("worker", "Redis, optimistic", "tasks/s", _rounds([0.5] * 5, [0.6] * 5),
                             target=(">=", 0.85))
    undecided = Result.of_rounds("cleanup", "p99", "ms", _rounds([1.5, 1.8, 2.0, 2.2, 2.5]), target=("<=", 2.0))
    missed = Result.of_rounds("worker", "RabbitMQ, optimistic", "tasks/s", _rounds([0.7] * 5, [0.9] * 5),
                              target=(">=", 0.85))
    at_undecided_floor = Result.of_rounds("producer", "RabbitMQ, N=100", "msg/s",
                                          _rounds([0.8] * 5, [0.8, 0.82, 0.85, 0.88, 0.9]), target=(">=", 0.85))
    untargeted = Result("producer", "Redis, N=1", "msg/s", 10.0, plain=20.0)
    lines = verdicts([met, beyond, below, undecided, missed, at_undecided_floor, untargeted]).splitlines()
    assert lines[0].startswith("6 targets")
    assert lines[1:] == [
        "- met: 1", "  - relay, Redis",
        "- beyond this machine (missed or undecided; the floor misses too), ours at its floor: 1",
        "  - worker, Redis, eager",
        "- beyond this machine (missed or undecided; the floor misses too), ours short of its floor: 1",
        "  - worker, Redis, optimistic",
        "- undecided (the rounds straddle the target): 1", "  - cleanup, p99",
        "- missed, ours at its floor (whether the floor meets the target, this host cannot tell): 1",
        "  - producer, RabbitMQ, N=100",
        "- missed: 1", "  - worker, RabbitMQ, optimistic",
    ]


def test_rounds_take_turns_forward_then_backward_and_report_in_the_order_given():
    from benchmarks.common import in_rounds

    calls: list[str] = []

    def measure(name: str, value: float):
        def run() -> float:
            calls.append(name)
            return value + len(calls) / 100
        return run

    rounds = in_rounds(3, measure("a", 1.0), measure("b", 2.0), measure("c", 3.0))
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert rounds == [pytest.approx([1.01, 2.02, 3.03]), pytest.approx([1.06, 2.05, 3.04]),
                      pytest.approx([1.07, 2.08, 3.09])]


def test_a_row_read_back_from_its_json_is_the_row_that_was_written():
    from benchmarks.common import verdicts

    rounds = _rounds([0.8, 0.82, 0.86, 0.9, 0.91], [0.85] * 5)
    rows = [Result.of_rounds("worker", "Redis, optimistic", "tasks/s", rounds, target=(">=", 0.85),
                             note="CPU µs/task: worker 1"),
            Result.of_rounds("cleanup", "delete 1 M", "rows/s", [(1e5, None, None)] * 5, target=(">=", 100_000)),
            Result("audit", "1 M", "envelopes/s", 2e4)]
    again = [Result.from_dict(json.loads(json.dumps(row.as_dict()))) for row in rows]
    assert again == rows
    assert table(again) == table(rows) and verdicts(again) == verdicts(rows)


def test_a_row_against_a_peer_prints_in_the_vs_peer_block_naming_the_peer():
    """A row whose denominator is a peer library, not plain Celery, prints below the rows against
    plain Celery, under a header that says so, with the peer's name and version in a column of
    its own; the verdicts name it, and its JSON carries it."""
    from benchmarks.common import verdicts

    against_celery = Result.of_rounds("relay", "Redis", "msg/s", _rounds([1.2] * 5), target=(">=", 1.0))
    against_peer = Result.of_rounds("peers", "N=1 vs defer", "msg/s", _rounds([0.3] * 5), target=(">=", 1.0),
                                    versus="procrastinate 3.10.0")
    blocks = table([against_peer, against_celery]).split("\n\n")
    assert blocks[0].splitlines()[0] == "| benchmark | case | celery-outbox | plain Celery | ratio | target | met |"
    assert [line for line in blocks[0].splitlines() if line.startswith("| relay")] != []
    assert "peers" not in blocks[0]
    assert blocks[1].startswith("vs peer: the denominator is the peer named, not plain Celery")
    header, rule, row = blocks[2].splitlines()
    assert header == "| benchmark | case | celery-outbox | peer | peer's | ratio | target | met |"
    assert row == ("| peers | N=1 vs defer | 30.0 msg/s | procrastinate 3.10.0 | 100 msg/s | 0.30 | >= 1 (ratio) "
                   "| **no**, 0.30–0.30 |")
    assert "  - peers, N=1 vs defer (vs procrastinate 3.10.0)" in verdicts([against_peer, against_celery])
    written = json.loads(json.dumps(against_peer.as_dict()))
    assert written["versus"] == "procrastinate 3.10.0" and Result.from_dict(written) == against_peer
    assert json.loads(json.dumps(against_celery.as_dict()))["versus"] is None
    only_peers = table([against_peer])
    assert only_peers.startswith("vs peer:") and "plain Celery |" not in only_peers


@pytest.mark.parametrize("full, quick, scale, units", [
    (450, 20, 1.0, 450), (450, 20, 0.5, 225), (450, 20, 0.01, 20), (1_000_000, 50_000, 0.37, 370_000)])
def test_a_full_runs_units_of_work_follow_the_hosts_pace_and_never_fall_below_the_quick_size(full, quick, scale,
                                                                                              units):
    from benchmarks.common import Options

    options = Options(scale=scale)
    assert options.units(full, quick) == units
    assert options.size(16, 1) == 16, "rounds and seconds do not follow the pace"
    assert Options(quick=True, scale=scale).units(full, quick) == quick


def test_a_full_run_on_the_reference_host_runs_the_budgets_share_of_the_full_sizes_and_a_slower_host_less():
    """Before any benchmark has run, the calibration's slowdown sets the scale: the budget over the
    reference's minutes on the reference host, half of that on a host twice as slow, never more
    than the full sizes on a faster one. A run of some benchmarks gets the scale the full run would
    give them."""
    from benchmarks.pace import BUDGET_MINUTES, REFERENCE_MINUTES, Budget

    share = BUDGET_MINUTES / sum(REFERENCE_MINUTES.values())
    names = list(REFERENCE_MINUTES)
    assert Budget(names, 1.0).scale_for("producer") == pytest.approx(share)
    assert Budget(names, 2.0).scale_for("producer") == pytest.approx(share / 2)
    assert Budget(names, 0.1).scale_for("producer") == 1.0
    assert Budget(["worker", "relay"], 2.0).scale_for("worker") == pytest.approx(share / 2)


def test_each_next_benchmarks_scale_follows_the_pace_the_run_has_shown_and_keeps_to_the_budget():
    """A benchmark that took longer than the calibration foretold makes the next ones smaller, so
    that the run's minutes, at the pace seen, end within the budget; one that went faster makes
    them larger, at most the full sizes; never below the least scale."""
    from benchmarks.pace import BUDGET_MINUTES, LEAST_SCALE, REFERENCE_MINUTES, Budget

    names = list(REFERENCE_MINUTES)
    budget = Budget(names, 1.0)
    first = budget.scale_for("producer")
    budget.ran("producer", 2 * REFERENCE_MINUTES["producer"] * first)  # twice as slow as foretold
    assert budget.slowdown == pytest.approx(2.0)
    second = budget.scale_for("worker")
    left = sum(REFERENCE_MINUTES[name] for name in names[1:])
    assert budget.spent + 2.0 * left * second == pytest.approx(BUDGET_MINUTES), "the rest, at that pace, fits"
    assert second < first

    fast = Budget(names, 1.0)
    scale = fast.scale_for("producer")
    fast.ran("producer", 0.25 * REFERENCE_MINUTES["producer"] * scale)
    assert fast.scale_for("worker") == 1.0

    late = Budget(names, 1.0)
    late.scale_for("producer")
    late.ran("producer", BUDGET_MINUTES)
    assert late.scale_for("worker") == LEAST_SCALE
    assert late.scales == {"producer": pytest.approx(BUDGET_MINUTES / sum(REFERENCE_MINUTES.values()), abs=1e-3),
                           "worker": LEAST_SCALE}
