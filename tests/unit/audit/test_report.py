"""The audit report: a self-contained HTML page with a verdict, inline SVG plots with titled axes and round
ticks, latency apart for immediate and scheduled messages, and escaped data."""

from __future__ import annotations

import re

from celery_outbox.audit.report import render_report


def summary(**changes) -> dict:
    base = {
        "generated_at": "2024-05-01T12:00:00+00:00",
        "window_start": "2024-05-01T10:00:00+00:00",
        "window_end": "2024-05-01T11:00:00+00:00",
        "sent": 1200,
        "handled": 1200,
        "lost": 0,
        "duplicates_discarded": 3,
        "dead_lettered": 7,
        "late": 2,
        "late_threshold_seconds": 30.0,
        "stuck": 0,
        "latency_seconds": {"p50": 0.012, "p95": 0.3, "p99": 1.2, "max": 95.0},
        "scheduled_latency_seconds": {"p50": 2.0, "p95": 40.0, "p99": 50.0, "max": 55.0},
        "lost_examples": [],
        "inputs": {
            "archive": {"path": "/var/lib/outbox archive", "rows": {"incoming": 1210, "dead_letters": 7, "sent": 1200}},
            "live": None,
            "coverage": {"durable_queues": {"tracked": "end_to_end", "messages": 1200},
                         "plain_queues": {"tracked": "inbox_only", "messages": 0}},
        },
    }
    return base | changes


HISTOGRAM = [(0.001, 0.01, 400), (0.01, 0.1, 500), (0.1, 1.0, 250), (1.0, 10.0, 45), (10.0, 100.0, 5)]
THROUGHPUT = [
    ("2024-05-01T10:00:00+00:00", 20, 18),
    ("2024-05-01T10:01:00+00:00", 25, 27),
    ("2024-05-01T10:03:00+00:00", 15, 15),
]
DEAD_LETTERS = [("shop.charge", "CardDeclined", 5), ("shop.ship", "max retries", 2)]
SCHEDULED = [(1.0, 2.5, 30), (2.5, 5.0, 12), (30.0, 60.0, 3)]
HISTOGRAMS = {"immediate": HISTOGRAM, "scheduled": SCHEDULED}
BY_TASK = [{"task_name": "shop.charge", "timing": "immediate", "count": 700, "p50": 0.01, "p95": 0.2, "p99": 0.9,
            "max": 12.0},
           {"task_name": "shop.charge", "timing": "scheduled", "count": 45, "p50": 2.0, "p95": 40.0, "p99": 50.0,
            "max": 55.0},
           {"task_name": "shop.ship", "timing": "immediate", "count": 500, "p50": 0.02, "p95": 0.3, "p99": 1.5,
            "max": 95.0}]


def figure(document: str, fig_id: str) -> str:
    match = re.search(rf'<figure id="{fig_id}">(.*?)</figure>', document, re.S)
    assert match, f"no figure {fig_id}"
    return match.group(1)


def svg(document: str, fig_id: str) -> str:
    body = figure(document, fig_id)
    match = re.search(r"<svg[^>]*>(.*?)</svg>", body, re.S)
    assert match and "<figcaption>" in body
    return match.group(1)


def test_report_with_data_draws_three_plots_and_says_clean():
    document = render_report(summary(), HISTOGRAMS, THROUGHPUT, DEAD_LETTERS, BY_TASK)

    assert document.startswith("<!DOCTYPE html>")
    assert re.search(r'class="verdict good">CLEAN<', document)
    assert "LOST" not in document
    latency = svg(document, "latency-plot")
    assert "<title" in latency and "Latency of messages sent at once" in latency
    assert latency.count('<rect class="bar"') == len(HISTOGRAM)
    assert latency.count("stroke-dasharray") == 3  # p50, p95 and p99 all fall in range
    assert ">1ms<" in latency and ">10s<" in latency  # ticks written humanly
    scheduled = svg(document, "scheduled-latency-plot")
    assert scheduled.count('<rect class="bar"') == len(SCHEDULED) and ">p99 50s<" in scheduled
    throughput = svg(document, "throughput-plot")
    assert "Throughput over time" in throughput
    assert throughput.count("<polyline") == 2 and ">sent<" in throughput and ">handled<" in throughput
    assert ">30<" in throughput  # the y axis's top tick, the first round count over the peak of 27
    dead = svg(document, "dead-letters-plot")
    assert "Dead letters by task and exception" in dead
    assert dead.count('<rect class="dead"') == 2 and "shop.charge · CardDeclined" in dead
    assert "no data" not in document
    assert "<td>shop.charge</td><td>700</td><td>10ms</td><td>200ms</td><td>900ms</td><td>45</td><td>2s</td>" in document


def test_lost_messages_turn_the_verdict_red_and_are_listed():
    examples = [
        {
            "message_id": f"msg-{i}",
            "task_name": "shop.charge",
            "destination": "celery",
            "sent_at": "2024-05-01T10:00:00+00:00",
        }
        for i in range(3)
    ]
    document = render_report(
        summary(lost=42, handled=1158, lost_examples=examples), HISTOGRAMS, THROUGHPUT, DEAD_LETTERS, BY_TASK
    )

    assert re.search(r'class="verdict bad">42 LOST<', document)
    assert "CLEAN" not in document
    for example in examples:
        assert f"<td>{example['message_id']}</td>" in document
    assert "showing 3 of 42" in document


def test_empty_inputs_render_no_data_placeholders():
    empty = summary(
        sent=0,
        handled=0,
        dead_lettered=0,
        late=0,
        stuck=None,
        window_start=None,
        window_end=None,
        latency_seconds={"p50": None, "p95": None, "p99": None, "max": None},
    )
    document = render_report(empty, {}, [], [], [])

    for fig_id in ("latency-plot", "scheduled-latency-plot", "throughput-plot", "dead-letters-plot"):
        panel = re.search(rf'<p class="empty" id="{fig_id}">(.*?)</p>', document, re.S)
        assert panel and "\n" not in panel.group(1), f"{fig_id}: an empty panel is one line of text"
        assert f'<figure id="{fig_id}">' not in document
    assert "<svg" not in document
    assert "CLEAN" in document


def test_degenerate_data_never_divides_by_zero():
    document = render_report(summary(), {"immediate": [(0.0, 0.0, 0)]}, [("2024-05-01T10:00:00", 0, 0)],
                             [("t", "e", 0)], [])

    assert '<p class="empty" id="latency-plot">' in document, "a histogram of zeros has nothing to draw"
    assert svg(document, "throughput-plot").count("<polyline") == 2
    assert '<rect class="dead"' in svg(document, "dead-letters-plot")


def test_text_from_data_is_escaped():
    evil = "<script>alert(1)</script>"
    examples = [{"message_id": evil, "task_name": evil, "destination": evil, "sent_at": evil}]
    document = render_report(
        summary(lost=1, lost_examples=examples, generated_at=evil,
                inputs=summary()["inputs"] | {"archive": {"path": evil, "rows": {"sent": 1}}}),
        HISTOGRAMS,
        [("2024-05-01T10:00:00+00:00", 1, 1), ("2024-05-01T10:01:00+00:00", 2, 2)],
        [(evil, evil, 3)],
        [{"task_name": evil, "timing": "scheduled", "count": 1, "p50": 0.1, "p95": 0.1, "p99": 0.1, "max": 0.1}],
    )

    assert "<script" not in document
    assert "&lt;script&gt;" in document


def test_report_is_self_contained():
    many_dead = [(f"task.{i}", "Boom", 100 - i) for i in range(40)]
    document = render_report(summary(), HISTOGRAMS, THROUGHPUT, many_dead, BY_TASK)

    assert "http://" not in document and "https://" not in document
    assert not re.search(r"\b(src|href)=", document)
    assert "@import" not in document and "url(" not in document
    assert svg(document, "dead-letters-plot").count('<rect class="dead"') == 15


def test_counts_on_the_axes_are_written_short():
    from celery_outbox.audit.report import _compact

    assert [_compact(n) for n in (950, 5_000, 12_345, 15_000, 4_100_000, 2 * 10**9)] == [
        "950", "5,000", "12.3k", "15k", "4.1M", "2G"]
