"""The audit's report as a browser draws it (headless Chromium): marker labels that do not overlap,
a throughput line never below its zero line, and empty panels as one line of text. Each page's
screenshot is kept in ``test-artifacts/audit-report/``."""

from __future__ import annotations

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


def assert_apart(boxes: list[dict]) -> None:
    for i, one in enumerate(boxes):
        for other in boxes[i + 1:]:
            apart = (one["right"] <= other["left"] or other["right"] <= one["left"]
                     or one["bottom"] <= other["top"] or other["bottom"] <= one["top"])
            assert apart, f"{one['text']!r} overlaps {other['text']!r}: {one} {other}"


@pytest.mark.parametrize("p95, p99", [(4.8, 4.9), (0.3, 0.3), (0.26, 0.27)],
                         ids=["close-at-the-right-edge", "equal", "close-at-the-left"])
def test_close_p95_and_p99_labels_do_not_overlap(browser, tmp_path, p95, p99):
    histogram = [(0.25, 0.5, 900), (0.5, 1.0, 40), (1.0, 2.5, 0), (2.5, 5.0, 60)]
    latency = {"p50": 0.3, "p95": p95, "p99": p99, "max": 5.0}
    show(browser, tmp_path, render_report(summary(latency, 1000, 1000), histogram, [], [], []), f"markers-{p95}-{p99}")
    boxes = browser.execute_script(MARKER_BOXES)
    assert [box["text"].split()[0] for box in boxes] == ["p50", "p95", "p99"]
    assert_apart(boxes)
    plot = browser.execute_script("return document.querySelector('#latency-plot svg').getBoundingClientRect()")
    for box in boxes:
        assert plot["left"] <= box["left"] and box["right"] <= plot["right"], f"{box['text']!r} is cut off"


def test_the_throughput_line_drops_to_zero_between_bursts_and_never_below(browser, tmp_path):
    """Bursts with quiet minutes between them: straight segments, down to the zero line across the
    quiet minutes (which the aggregate leaves out), never under it."""
    throughput = [("2026-11-01T12:00:00+00:00", 900, 0), ("2026-11-01T12:01:00+00:00", 0, 900),
                  ("2026-11-01T12:02:00+00:00", 3, 2), ("2026-11-01T12:20:00+00:00", 800, 780),
                  ("2026-11-01T12:21:00+00:00", 1, 20), ("2026-11-01T12:23:00+00:00", 500, 500)]
    html = render_report(summary({"p50": None, "p95": None, "p99": None, "max": None}, 2204, 2202),
                         [], throughput, [], [])
    show(browser, tmp_path, html, "throughput-bursts")
    drawn = browser.execute_script(THROUGHPUT_POINTS)
    zero, lines = drawn["zero"], drawn["lines"]
    assert set(lines) == {"sent", "handled"}
    for name, ys in lines.items():
        assert max(ys) <= zero, f"the {name} line goes below zero: {ys}"
        assert len(ys) == len(throughput) + 3, "a zero after and before the quiet minutes 12:03-12:19, after 12:21"
    assert lines["sent"][3] == lines["sent"][4] == lines["sent"][7] == zero


def test_empty_panels_are_one_line_each(browser, tmp_path):
    html = render_report(summary({"p50": None, "p95": None, "p99": None, "max": None}), [], [], [], [])
    show(browser, tmp_path, html, "empty")
    for panel, why in (("latency-plot", "no message handled"), ("throughput-plot", "no message sent or handled"),
                       ("dead-letters-plot", "no dead letters")):
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
    assert_apart(browser.execute_script(MARKER_BOXES))
    drawn = browser.execute_script(THROUGHPUT_POINTS)
    assert all(y <= drawn["zero"] for ys in drawn["lines"].values() for y in ys)
    assert browser.execute_script("return document.querySelectorAll('#dead-letters-plot rect.dead').length") == 2
