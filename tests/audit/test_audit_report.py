"""The audit's report as a browser draws it (headless Chromium): marker labels above the plot that
overlap nothing, titled axes with round ticks whose labels do not overlap, latency of scheduled
messages apart from that of immediate ones, a throughput line never below its zero line, and empty
panels as one line of text. Each page's screenshot is kept in ``test-artifacts/audit-report/``."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from celery_outbox.audit.job import AuditOptions, run_audit
from celery_outbox.audit.report import render_report

from ..browser import chromium, screenshot
from .conftest import NOW

ARTIFACTS = "audit-report"

MARKER_BOXES = """
return [...document.querySelectorAll('#latency-plot text.marker')].map(label => {
  const box = label.getBoundingClientRect();
  return {text: label.textContent, left: box.left, top: box.top, right: box.right, bottom: box.bottom};
});
"""

# every box drawn in a plot, by kind: its frame, bars, marker labels, tick labels, axis titles, legend
PLOT_BOXES = """
const box = (element, text) => {
  const b = element.getBoundingClientRect();
  return {text: text, left: b.left, top: b.top, right: b.right, bottom: b.bottom};
};
const svg = document.querySelector(arguments[0] + ' svg');
const all = selector => [...svg.querySelectorAll(selector)];
return {svg: box(svg, 'svg'), frame: box(svg.querySelector('rect.frame'), 'frame'),
        bars: all('rect.bar').map((bar, i) => box(bar, 'bar ' + i)),
        markers: all('text.marker').map(label => box(label, label.textContent)),
        legend: all('text.legend').map(label => box(label, label.textContent)),
        titles: Object.fromEntries(['x', 'y'].map(axis => [axis, all('text.axis-title.' + axis).map(
          title => box(title, title.textContent))])),
        ticks: Object.fromEntries(['x', 'y'].map(axis => [axis, all('text.tick.' + axis).map(
          tick => ({...box(tick, tick.textContent), value: Number(tick.dataset.value)}))]))};
"""

# each throughput line's points, and the zero line (the frame's bottom), in the plot's coordinates
THROUGHPUT_POINTS = """
const svg = document.querySelector('#throughput-plot svg');
const frame = svg.querySelector('rect.frame');
return {zero: frame.y.baseVal.value + frame.height.baseVal.value,
        lines: Object.fromEntries([...svg.querySelectorAll('polyline')].map(
          line => [line.getAttribute('class'), [...line.points].map(point => point.y)]))};
"""

EMPTY_PANEL = """
const panel = document.getElementById(arguments[0]);
return {tag: panel.tagName, drawings: panel.querySelectorAll('svg').length, text: panel.textContent,
        height: panel.getBoundingClientRect().height,
        line: panel.querySelector('strong').getBoundingClientRect().height};
"""


@pytest.fixture(scope="module")
def browser():
    with chromium(window="1200,1600") as driver:
        yield driver


def summary(latency: dict, sent: int = 0, handled: int = 0) -> dict:
    return {"lost": 0, "window_start": "2026-11-01T12:00:00+00:00", "window_end": "2026-11-01T13:00:00+00:00",
            "generated_at": "2026-11-01T15:00:00+00:00", "lost_examples": [], "sent": sent, "handled": handled,
            "dead_lettered": 0, "duplicates_discarded": 0, "late": 0, "late_threshold_seconds": 60.0, "stuck": None,
            "latency_seconds": latency, "throughput_unit": "minute",
            "inputs": {"archive": {"path": "/archive", "rows": {"incoming": handled, "dead_letters": 0, "sent": sent}},
                       "live": None,
                       "coverage": {"durable_queues": {"tracked": "end_to_end", "messages": sent},
                                    "plain_queues": {"tracked": "inbox_only", "messages": 0}}}}


def show(browser, tmp_path, html: str, name: str):
    page = tmp_path / f"{name}.html"
    page.write_text(html)
    browser.get(page.as_uri())
    screenshot(browser, ARTIFACTS, name)


def assert_apart(boxes: list[dict], others: list[dict] | None = None) -> None:
    """No two of ``boxes`` overlap (or, given ``others``, no box of ``boxes`` overlaps one of those)."""
    for i, one in enumerate(boxes):
        for other in boxes[i + 1:] if others is None else others:
            apart = (one["right"] <= other["left"] or other["right"] <= one["left"]
                     or one["bottom"] <= other["top"] or other["bottom"] <= one["top"])
            assert apart, f"{one['text']!r} overlaps {other['text']!r}: {one} {other}"


def is_round(value: float) -> bool:
    """1, 2 or 5 × 10ⁿ, or zero."""
    if value == 0:
        return True
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return any(math.isclose(mantissa, m) for m in (1, 2, 5))


def assert_legible(drawn: dict, x_title: str, y_title: str) -> None:
    """Titled axes, four ticks or more on each (counts from zero, a round step apart), whose labels
    overlap nothing; every text inside the plot's SVG; marker labels above the frame, overlapping
    nothing."""
    texts = [*drawn["markers"], *drawn["legend"], *drawn["ticks"]["x"], *drawn["ticks"]["y"],
             *drawn["titles"]["x"], *drawn["titles"]["y"]]
    assert [t["text"] for t in drawn["titles"]["x"]] == [x_title]
    assert [t["text"] for t in drawn["titles"]["y"]] == [y_title]
    for axis in ("x", "y"):
        assert len(drawn["ticks"][axis]) >= 4, f"{axis}: {[t['text'] for t in drawn['ticks'][axis]]}"
    counts = [tick["value"] for tick in drawn["ticks"]["y"]]
    step = counts[1] - counts[0]
    assert counts[0] == 0 and is_round(step) and counts == [i * step for i in range(len(counts))], counts
    assert_apart(texts)
    assert_apart(texts, drawn["bars"])
    for box in texts:
        assert drawn["svg"]["left"] <= box["left"] and box["right"] <= drawn["svg"]["right"], f"{box} is cut off"
        assert drawn["svg"]["top"] <= box["top"] and box["bottom"] <= drawn["svg"]["bottom"], f"{box} is cut off"
    for marker in drawn["markers"]:
        assert marker["bottom"] <= drawn["frame"]["top"], f"{marker['text']!r} is not above the plot"


@pytest.mark.parametrize("p50, p95, p99", [(0.3, 4.8, 4.9), (0.3, 0.3, 0.3), (0.26, 0.26, 0.27), (0.3, 4.9, 4.9),
                                            (0.3, 4.99, 5.0)],
                         ids=["close-at-the-right-edge", "all-equal", "close-at-the-left", "p95-is-p99",
                              "within-a-pixel-at-the-top-bar"])
def test_percentile_labels_sit_above_the_plot_and_overlap_nothing(browser, tmp_path, p50, p95, p99):
    """The tallest bar reaches the frame's top; the labels sit above it, apart from each other, the
    bars, the ticks and the axis titles, even where the lines coincide."""
    histogram = [(0.25, 0.5, 900), (0.5, 1.0, 40), (1.0, 2.5, 0), (2.5, 5.0, 900)]
    latency = {"p50": p50, "p95": p95, "p99": p99, "max": 5.0}
    html = render_report(summary(latency, 1840, 1840), {"immediate": histogram}, [], [], [])
    show(browser, tmp_path, html, f"markers-{p50}-{p95}-{p99}")
    boxes = browser.execute_script(MARKER_BOXES)
    assert [box["text"].split()[0] for box in boxes] == ["p50", "p95", "p99"]
    assert_legible(browser.execute_script(PLOT_BOXES, "#latency-plot"), "latency (log scale)", "messages")


@pytest.mark.parametrize("minutes, peak", [(3, 27), (23, 900), (60 * 30, 12_345)], ids=["3m", "23m", "30h"])
def test_axes_are_titled_with_round_ticks_that_do_not_overlap(browser, tmp_path, minutes, peak):
    start = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
    throughput = [((start + timedelta(minutes=m)).isoformat(), peak if m % 7 == 0 else peak // 3, peak // 2)
                  for m in range(0, minutes + 1, max(minutes // 40, 1))]
    histogram = [(0.005, 0.01, 3), (0.01, 0.025, peak), (0.025, 0.05, peak // 2), (0.05, 0.1, 7), (0.1, 0.25, 1)]
    latency = {"p50": 0.012, "p95": 0.04, "p99": 0.09, "max": 0.2}
    html = render_report(summary(latency, peak, peak), {"immediate": histogram}, throughput, [], [])
    show(browser, tmp_path, html, f"axes-{minutes}m")
    assert_legible(browser.execute_script(PLOT_BOXES, "#latency-plot"), "latency (log scale)", "messages")
    drawn = browser.execute_script(PLOT_BOXES, "#throughput-plot")
    assert_legible(drawn, "time (UTC)", "messages per minute")
    values = [tick["value"] for tick in drawn["ticks"]["x"]]
    assert len({b - a for a, b in zip(values, values[1:], strict=False)}) == 1, "evenly spaced times"
    assert all(value % 60 == 0 for value in values), "on whole minutes"


def test_scheduled_latency_is_shown_apart_from_immediate_latency(browser, tmp_path):
    """Scheduled messages have their own tiles, plot and per-task columns, counted from their due
    time; the headline tiles and the first plot are the immediate messages' alone."""
    immediate = {"p50": 0.012, "p95": 0.04, "p99": 0.09, "max": 0.2}
    scheduled = {"p50": 1.5, "p95": 4.0, "p99": 4.5, "max": 4.9}
    report = summary(immediate, 1300, 1300) | {"scheduled_latency_seconds": scheduled}
    by_task = [{"task_name": "shop.pay", "timing": "immediate", "count": 1000, **immediate},
               {"task_name": "shop.pay", "timing": "scheduled", "count": 300, **scheduled}]
    histograms = {"immediate": [(0.01, 0.025, 600), (0.025, 0.05, 350), (0.05, 0.1, 40), (0.1, 0.25, 10)],
                  "scheduled": [(1.0, 2.5, 200), (2.5, 5.0, 100)]}
    show(browser, tmp_path, render_report(report, histograms, [], [], by_task), "scheduled-apart")
    tiles = browser.execute_script("return [...document.querySelectorAll('.tile')].map(t => t.innerText)")
    tiles = {label: value for value, label in (tile.split("\n") for tile in tiles)}
    assert tiles["p50, sent at once"] == "12ms" and tiles["p50, scheduled (from due)"] == "1.5s"
    for plot, values in (("#latency-plot", immediate), ("#scheduled-latency-plot", scheduled)):
        drawn = browser.execute_script(PLOT_BOXES, plot)
        assert [marker["text"] for marker in drawn["markers"]] == [
            f"p50 {values['p50'] * 1000:g}ms" if values["p50"] < 1 else f"p50 {values['p50']:g}s",
            *(f"{name} {values[name] * 1000:g}ms" if values[name] < 1 else f"{name} {values[name]:g}s"
              for name in ("p95", "p99"))]
        assert_legible(drawn, "latency (log scale)", "messages")
    table = browser.execute_script("return [...document.querySelectorAll('table')].pop().innerText")
    assert "sent at once: from sent" in table and "scheduled (countdown/eta): from due" in table
    assert "shop.pay\t1,000\t12ms\t40ms\t90ms\t300\t1.5s\t4s\t4.5s" in table


def test_the_throughput_line_drops_to_zero_between_bursts_and_never_below(browser, tmp_path):
    """Bursts with quiet minutes between them: straight segments, down to the zero line across the
    quiet minutes (which the aggregate leaves out), never under it."""
    throughput = [("2026-11-01T12:00:00+00:00", 900, 0), ("2026-11-01T12:01:00+00:00", 0, 900),
                  ("2026-11-01T12:02:00+00:00", 3, 2), ("2026-11-01T12:20:00+00:00", 800, 780),
                  ("2026-11-01T12:21:00+00:00", 1, 20), ("2026-11-01T12:23:00+00:00", 500, 500)]
    html = render_report(summary({"p50": None, "p95": None, "p99": None, "max": None}, 2204, 2202),
                         {}, throughput, [], [])
    show(browser, tmp_path, html, "throughput-bursts")
    drawn = browser.execute_script(THROUGHPUT_POINTS)
    zero, lines = drawn["zero"], drawn["lines"]
    assert set(lines) == {"sent", "handled"}
    for name, ys in lines.items():
        assert max(ys) <= zero, f"the {name} line goes below zero: {ys}"
        assert len(ys) == len(throughput) + 3, "a zero after and before the quiet minutes 12:03-12:19, after 12:21"
    assert lines["sent"][3] == lines["sent"][4] == lines["sent"][7] == zero


def test_empty_panels_are_one_line_each(browser, tmp_path):
    html = render_report(summary({"p50": None, "p95": None, "p99": None, "max": None}), {}, [], [], [])
    show(browser, tmp_path, html, "empty")
    for panel, why in (("latency-plot", "no message sent at once handled"),
                       ("scheduled-latency-plot", "no scheduled message handled"),
                       ("throughput-plot", "no message sent or handled"), ("dead-letters-plot", "no dead letters")):
        shown = browser.execute_script(EMPTY_PANEL, panel)
        assert shown["tag"] == "P" and shown["drawings"] == 0 and shown["text"].endswith(why), shown
        assert shown["height"] < 1.5 * shown["line"], f"{panel} takes more than one line: {shown}"


def test_the_report_of_an_audit_is_legible(browser, spark, known_archive, tmp_path):
    """The known archive's p95 and p99 are one and the same latency (its 2-minute outlier), and
    its dead letters fill their panel."""
    latency = run_audit(AuditOptions(out=str(tmp_path / "out"), archive=known_archive, now=NOW),
                        spark)["latency_seconds"]
    assert latency["p95"] == latency["p99"]
    browser.get((tmp_path / "out" / "report.html").as_uri())
    screenshot(browser, ARTIFACTS, "known-archive")
    assert_legible(browser.execute_script(PLOT_BOXES, "#latency-plot"), "latency (log scale)", "messages")
    assert_legible(browser.execute_script(PLOT_BOXES, "#throughput-plot"), "time (UTC)", "messages per minute")
    drawn = browser.execute_script(THROUGHPUT_POINTS)
    assert all(y <= drawn["zero"] for ys in drawn["lines"].values() for y in ys)
    assert browser.execute_script("return document.querySelectorAll('#dead-letters-plot rect.dead').length") == 2
