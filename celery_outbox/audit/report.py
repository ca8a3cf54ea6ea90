"""Render the self-contained HTML report of a delivery audit.

No transaction: the Spark job computes every number; this module turns plain Python data into one
page: a verdict, big-number tiles, what the audit read, four inline SVG plots (``plot``) and two
small tables, with latency shown apart for messages sent at once and scheduled ones (docs/audit.md).
No JavaScript, no external CSS, fonts or URLs; every text that comes from data is escaped.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from itertools import pairwise

from celery_outbox.audit.aggregates import Timing, Tracking
from celery_outbox.audit.plot import (
    PLOT_H,
    X0,
    X1,
    Frame,
    W,
    count_ticks,
    esc,
    human,
    latency_ticks,
    log_domain,
    place_labels,
    text,
    time_domain,
    time_ticks,
    width_of,
)

__all__ = ["render_report"]

H = 260  # the least height of the dead letters' plot
TOP, BOTTOM = 16, 40  # the dead letters' plot: margins above and below its frame
GREEN, RED, AMBER, BLUE = "#1a7f37", "#cf222e", "#9a6700", "#0969da"
MAX_DEAD_LETTER_BARS = 15
LABEL_CHARS = 44
PERIOD = {"second": timedelta(seconds=1), "minute": timedelta(minutes=1), "hour": timedelta(hours=1)}
NO_LATENCY = {"p50": None, "p95": None, "p99": None, "max": None}

CSS = f"""
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 60rem;
  color: #1f2328; padding: 0 1rem; }}
h1 {{ margin-bottom: .2rem; }} h2 {{ margin-top: 2rem; font-size: 1.1rem; }}
.verdict {{ color: #fff; padding: .1rem .6rem; border-radius: .4rem; margin-left: .5rem; }}
.verdict.good {{ background: {GREEN}; }} .verdict.bad {{ background: {RED}; }}
.meta {{ color: #656d76; margin-top: 0; }}
.tiles {{ display: flex; flex-wrap: wrap; gap: .75rem; margin: 1.5rem 0; }}
.tile {{ border: 1px solid #d0d7de; border-radius: .5rem; padding: .6rem 1rem; min-width: 7rem; }}
.tile b {{ display: block; font-size: 1.8rem; font-variant-numeric: tabular-nums; }}
.tile span {{ color: #656d76; font-size: .85rem; }}
.tile.bad b {{ color: {RED}; }} .tile.good b {{ color: {GREEN}; }} .tile.warn b {{ color: {AMBER}; }}
figure {{ margin: 1.5rem 0; }} figcaption {{ color: #656d76; font-size: .9rem; }}
svg {{ width: 100%; height: auto; font-size: 12px; }}
svg .frame {{ fill: #f6f8fa; stroke: #d0d7de; }} svg .bar {{ fill: {BLUE}; }} svg .dead {{ fill: {RED}; }}
svg text {{ fill: #1f2328; }} p.empty {{ margin: 1rem 0; color: #656d76; }}
.inputs {{ color: #656d76; font-size: .9rem; padding-left: 1.2rem; }}
svg .marker {{ fill: {RED}; }} svg .halo {{ stroke: #fff; stroke-width: 4px; }}
svg .grid {{ stroke: #d0d7de; stroke-width: 1px; }}
svg .tick {{ fill: #656d76; }} svg .axis-title {{ fill: #656d76; font-weight: 600; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ border-bottom: 1px solid #d0d7de; padding: .3rem .8rem; text-align: left; }}
th[colspan] {{ text-align: center; border-bottom-color: #8c959f; }}
"""


def _figure(fig_id: str, title: str, caption: str, svg: str) -> str:
    """A plot's SVG with its title and caption."""
    return (f'<figure id="{fig_id}">{svg}'
            f"<figcaption><strong>{esc(title)}</strong> — {esc(caption)}</figcaption></figure>")


def _framed(fig_id: str, title: str, body: str, height: int) -> str:
    """The dead letters' SVG: titled, framed by ``TOP`` and ``BOTTOM``."""
    return (f'<svg viewBox="0 0 {W} {height}" role="img" aria-labelledby="{fig_id}-title">'
            f'<title id="{fig_id}-title">{esc(title)}</title>'
            f'<rect class="frame" x="{X0}" y="{TOP}" width="{X1 - X0}" height="{height - TOP - BOTTOM}"/>{body}</svg>')


def _empty(fig_id: str, title: str, why: str) -> str:
    """A plot with nothing to draw: one line of text in its place."""
    return f'<p class="empty" id="{fig_id}"><strong>{esc(title)}</strong> — {esc(why)}</p>'


def _compact(count: int) -> str:
    """A count short enough for the plots' axis: 950, 12.3k, 4.1M."""
    for least, size, suffix in ((10**9, 10**9, "G"), (10**6, 10**6, "M"), (10**4, 10**3, "k")):
        if count >= least:
            return f"{count / size:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{count:,}"


def _latency_plot(fig_id: str, title: str, start_word: str, histogram: list[tuple[float, float, int]],
                  latency: dict, empty: str) -> str:
    """A latency histogram on a log axis, its percentiles as dashed lines labelled above the frame."""
    peak = max((count for _, _, count in histogram), default=0)
    if peak <= 0:
        return _empty(fig_id, title, empty)
    # a bucket from zero is drawn from a fifth of its top, the open-ended last one to the maximum
    spans = [(low or high / 5, high if not math.isinf(high) else max(latency.get("max") or 0, 2 * low), count)
             for low, high, count in histogram]
    start, end = log_domain(spans[0][0], spans[-1][1])

    def x_of(value: float) -> float:
        value = min(max(value, start), end)
        return X0 + (X1 - X0) * math.log(value / start) / math.log(end / start)

    markers = [(name, latency[name]) for name in ("p50", "p95", "p99") if latency.get(name) is not None]
    labels = place_labels([(x_of(value), f"{name} {human(value)}") for name, value in markers])
    frame = Frame(rows=max((row for row, _, _ in labels), default=0) + 1)
    ticks = count_ticks(peak)
    parts = [frame.y_axis(ticks, _compact)]
    for (low, high, count), (raw_low, raw_high, _) in zip(spans, histogram, strict=True):
        h = PLOT_H * count / ticks[-1]
        left, right = x_of(low), x_of(high)
        parts.append(
            f'<rect class="bar" x="{left + 1:.1f}" y="{frame.bottom - h:.1f}" width="{max(right - left - 2, 1):.1f}" '
            f'height="{h:.1f}"><title>{esc(f"{human(raw_low)}–{human(raw_high)}: {count:,}")}</title></rect>')
    for _, value in markers:
        x = x_of(value)
        parts.append(f'<line class="halo" x1="{x:.1f}" y1="{frame.top}" x2="{x:.1f}" y2="{frame.bottom}"/>'
                     f'<line x1="{x:.1f}" y1="{frame.top}" x2="{x:.1f}" y2="{frame.bottom}" stroke="{RED}" '
                     'stroke-width="2" stroke-dasharray="5 4"/>')
    parts.append(frame.x_axis(latency_ticks(start, end, x_of)))
    parts += [text(left, frame.row_y(row), label, "start", ' class="marker"') for row, left, label in labels]
    total = sum(count for _, _, count in histogram)
    caption = (f"{total:,} handled messages, latency from {start_word} to handled; dashed lines mark p50, p95 and "
               "p99")
    svg = frame.svg(fig_id, title, "".join(parts), "latency (log scale)", "messages")
    return _figure(fig_id, title, caption, svg)


def _with_zeros(throughput: list[tuple[str, int, int]], unit: str) -> list[tuple[datetime, int, int]]:
    """The periods with their times, and a zero period after and before each run of periods without
    traffic (which the aggregate leaves out), so the line drops to zero across them rather than
    drawing a slope over them."""
    step = PERIOD[unit]
    rows = [(_aware(datetime.fromisoformat(period)), sent, handled) for period, sent, handled in throughput]
    filled = rows[:1]
    for previous, row in pairwise(rows):
        gap = row[0] - previous[0]
        if gap > step:
            filled.append((previous[0] + step, 0, 0))
        if gap > 2 * step:
            filled.append((row[0] - step, 0, 0))
        filled.append(row)
    return filled


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _throughput_plot(throughput: list[tuple[str, int, int]], unit: str = "minute") -> str:
    """Messages sent and handled per period, as two lines over a time axis; the legend above the frame."""
    title = "Throughput over time"
    if not throughput:
        return _empty("throughput-plot", title, "no message sent or handled")
    rows = _with_zeros(throughput, unit)
    first, last = time_domain([rows[0][0], rows[-1][0]], PERIOD[unit])
    span = (last - first).total_seconds()

    def x_of(moment: datetime) -> float:
        return X0 + (X1 - X0) * (moment - first).total_seconds() / span

    frame = Frame()
    ticks = count_ticks(max(max(sent, handled) for _, sent, handled in rows))
    parts = [frame.y_axis(ticks, _compact)]
    legend_x = X1 - sum(26 + width_of(name) + 16 for name in ("sent", "handled")) + 16
    for column, colour, name in ((1, BLUE, "sent"), (2, GREEN, "handled")):
        # straight segments between the counts, each at or above the zero line (the frame's bottom)
        points = [(x_of(row[0]), min(frame.bottom, frame.bottom - PLOT_H * row[column] / ticks[-1])) for row in rows]
        if len(points) == 1:  # a single period: a short dash, since one point draws nothing
            points = [(points[0][0] - 8, points[0][1]), (points[0][0] + 8, points[0][1])]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline class="{name}" points="{coords}" fill="none" stroke="{colour}" stroke-width="2" '
                     'stroke-linejoin="round"/>')
        y = frame.row_y(0)
        parts.append(f'<line x1="{legend_x}" y1="{y - 4}" x2="{legend_x + 20}" y2="{y - 4}" stroke="{colour}" '
                     'stroke-width="3"/>')
        parts.append(text(legend_x + 26, y, name, "start", ' class="legend"'))
        legend_x += 26 + width_of(name) + 16
    parts.append(frame.x_axis(time_ticks(first, last, x_of, PERIOD[unit])))
    sent, handled = sum(row[1] for row in throughput), sum(row[2] for row in throughput)
    caption = (f"messages per {unit} ({len(throughput):,} {unit}s with traffic, from {throughput[0][0]} to "
               f"{throughput[-1][0]}): {sent:,} sent, {handled:,} handled")
    svg = frame.svg("throughput-plot", title, "".join(parts), "time (UTC)", f"messages per {unit}")
    return _figure("throughput-plot", title, caption, svg)


def _dead_letters_plot(dead_letters: list[tuple[str, str, int]]) -> str:
    title = "Dead letters by task and exception"
    rows = dead_letters[:MAX_DEAD_LETTER_BARS]
    if not rows:
        return _empty("dead-letters-plot", title, "no dead letters")
    height = max(H, TOP + BOTTOM + 24 * len(rows))
    row_h = (height - TOP - BOTTOM) / len(rows)
    bar_x0, bar_w = X0 + 6 + 7 * LABEL_CHARS, X1 - X0 - 7 * LABEL_CHARS - 60
    peak = max(max(count for _, _, count in rows), 1)
    parts = []
    for i, (task, reason, count) in enumerate(rows):
        label = f"{task} · {reason}"
        short = label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "…"
        y, w = TOP + i * row_h + row_h / 2, max(bar_w * count / peak, 1)
        parts.append(
            f"<g><title>{esc(f'{label}: {count:,}')}</title>{text(X0 + 6, y + 4, short, 'start')}"
            f'<rect class="dead" x="{bar_x0}" y="{y - 8:.1f}" width="{w:.1f}" height="16"/>'
            f"{text(bar_x0 + w + 6, y + 4, f'{count:,}', 'start')}</g>"
        )
    shown = f"top {len(rows)} of {len(dead_letters)}" if len(dead_letters) > len(rows) else f"all {len(rows)}"
    caption = f"{sum(r[2] for r in dead_letters):,} dead letters; {shown} task/exception pairs"
    return _figure("dead-letters-plot", title, caption, _framed("dead-letters-plot", title, "".join(parts), height))


def _tiles(summary: dict) -> str:
    latency, stuck = summary["latency_seconds"], summary["stuck"]
    scheduled = summary.get("scheduled_latency_seconds") or NO_LATENCY
    tiles = [
        ("sent", f"{summary['sent']:,}", ""),
        ("handled", f"{summary['handled']:,}", ""),
        ("lost", f"{summary['lost']:,}", "bad" if summary["lost"] else "good"),
        ("dead-lettered", f"{summary['dead_lettered']:,}", "warn" if summary["dead_lettered"] else ""),
        ("duplicates discarded", f"{summary['duplicates_discarded']:,}", ""),
        (
            f"late (> {human(summary['late_threshold_seconds'])})",
            f"{summary['late']:,}",
            "warn" if summary["late"] else "",
        ),
        (
            "stuck" if stuck is not None else "stuck (live tables not read)",
            "—" if stuck is None else f"{stuck:,}",
            "warn" if stuck else "",
        ),
        ("p50, sent at once", human(latency["p50"]), ""),
        ("p99, sent at once", human(latency["p99"]), ""),
        ("max, sent at once", human(latency["max"]), ""),
    ]
    if scheduled["p50"] is not None:
        tiles += [("p50, scheduled (from due)", human(scheduled["p50"]), ""),
                  ("p99, scheduled (from due)", human(scheduled["p99"]), "")]
    return (
        '<section class="tiles">'
        + "".join(
            f'<div class="tile {cls}"><b>{esc(value)}</b><span>{esc(label)}</span></div>'
            for label, value, cls in tiles
        )
        + "</section>"
    )


def _inputs(read: dict) -> str:
    """What the audit read (the archive, the live tables, with their rows) and what it covers, one
    line each."""
    archive, live, coverage = read["archive"], read["live"], read["coverage"]
    lines = ["no archive read" if not archive else f"read the archive at {archive['path']}: "
             + ", ".join(f"{kind} {rows:,}" for kind, rows in archive["rows"].items()) + " rows"]
    if live:
        pending = live["pending"]
        lines.append(f"read the live tables at {live['url']}: "
                     + ", ".join(f"{name} {rows:,}" for name, rows in live["rows"].items())
                     + f" rows; still holding {pending['outgoing_unsent']:,} unsent, "
                     f"{pending['outgoing_unacknowledged']:,} sent and unacknowledged, "
                     f"{pending['incoming_running']:,} running")
    else:
        lines.append("live tables not read (--jdbc-url): messages still in them may show as lost")
    durable, plain = coverage["durable_queues"], coverage["plain_queues"]
    lines.append(f"durable queues: {durable['messages']:,} messages sent, " + (
        "followed end to end" if durable["tracked"] == Tracking.END_TO_END else "no send recorded: inbox rows only"))
    lines.append(f"plain queues (and sends not recorded): {plain['messages']:,} messages with inbox rows only; "
                 "a lost one cannot show")
    return '<ul class="inputs" id="inputs">' + "".join(f"<li>{esc(line)}</li>" for line in lines) + "</ul>"


def _table(headers: tuple[str, ...], rows: list[tuple[object, ...]], empty: str, groups: str = "") -> str:
    """A table of ``rows`` under ``headers`` (and a row of column ``groups`` above them), or a line
    saying ``empty``."""
    if not rows:
        return f"<p>{esc(empty)}</p>"
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead>{groups}<tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _latency_table(latency_by_task: list[dict]) -> str:
    """Per task, the count and p50, p95, p99 of its messages sent at once and of its scheduled ones."""
    by_task: dict[str, dict[str, dict]] = {}
    for row in latency_by_task:
        by_task.setdefault(row["task_name"], {})[row.get("timing", Timing.IMMEDIATE.value)] = row
    rows = []
    for task, timings in sorted(by_task.items()):
        cells: list[object] = [task]
        for timing in Timing:
            row = timings.get(timing.value)
            cells += ["0", "—", "—", "—"] if row is None else [
                f"{row['count']:,}", *(human(row[key]) for key in ("p50", "p95", "p99"))]
        rows.append(tuple(cells))
    groups = ('<tr><th></th><th colspan="4">sent at once: from sent</th>'
              '<th colspan="4">scheduled (countdown/eta): from due</th></tr>')
    return _table(("task", *("handled", "p50", "p95", "p99") * 2), rows, "No message was handled.", groups)


def render_report(
    summary: dict,
    latency_histograms: dict[str, list[tuple[float, float, int]]],
    throughput: list[tuple[str, int, int]],
    dead_letters: list[tuple[str, str, int]],
    latency_by_task: list[dict],
) -> str:
    """Return the whole HTML document: ``latency_histograms`` and the rows of ``latency_by_task``
    (``task_name``, ``timing``, ``count``, ``p50``, ``p95``, ``p99``) are per ``Timing`` value."""
    lost = summary["lost"]
    verdict = "CLEAN" if lost == 0 else f"{lost:,} LOST"
    window = f"{summary['window_start'] or 'the beginning'} → {summary['window_end'] or 'now'}"
    examples = summary["lost_examples"]
    lost_rows = [(e["message_id"], e["task_name"], e["destination"], e["sent_at"]) for e in examples]
    immediate = _latency_plot("latency-plot", "Latency of messages sent at once", "sent",
                              latency_histograms.get(Timing.IMMEDIATE.value, []), summary["latency_seconds"],
                              "no message sent at once handled")
    scheduled = _latency_plot("scheduled-latency-plot", "Latency of scheduled messages (countdown/eta)", "due",
                              latency_histograms.get(Timing.SCHEDULED.value, []),
                              summary.get("scheduled_latency_seconds") or NO_LATENCY, "no scheduled message handled")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Delivery audit: {verdict}</title><style>{CSS}</style></head>
<body><header><h1>Delivery audit <span class="verdict {"good" if lost == 0 else "bad"}">{verdict}</span></h1>
<p class="meta">window {esc(window)} · generated {esc(summary["generated_at"])}</p></header>
{_tiles(summary)}
{_inputs(summary["inputs"])}
{immediate}
{scheduled}
{_throughput_plot(throughput, summary.get("throughput_unit", "minute"))}
{_dead_letters_plot(dead_letters)}
<h2>Lost messages{f" (showing {len(examples)} of {lost:,})" if lost > len(examples) else ""}</h2>
{_table(("message id", "task", "destination", "sent at"), lost_rows, "No message was lost.")}
<h2>Latency by task</h2>
{_latency_table(latency_by_task)}
</body></html>
"""
