"""Render the self-contained HTML report of a delivery audit.

The Spark job computes every number; this module only turns plain Python data into one HTML document meant to be
looked at rather than read: a verdict, big-number tiles, what the audit read, three inline SVG plots and two small
tables. A plot with nothing to show is one line of text instead. The plots stay legible on real data: marker labels
that would overlap move to a row of their own, and the throughput line is drawn through its points only (no
smoothing), down to zero across periods without traffic, never below it.
No JavaScript, no external CSS, fonts or URLs; every text that comes from data is escaped.
"""

from __future__ import annotations

import html
import math
from datetime import datetime, timedelta
from itertools import pairwise

from celery_outbox.audit.aggregates import Tracking

W, H = 720, 260  # default viewBox of a plot
LEFT, RIGHT, TOP, BOTTOM = 56, 24, 16, 40  # margins around the plot frame inside the viewBox
X0, X1, Y0, Y1 = LEFT, W - RIGHT, TOP, H - BOTTOM
PW, PH = X1 - X0, Y1 - Y0
GREEN, RED, AMBER, BLUE = "#1a7f37", "#cf222e", "#9a6700", "#0969da"
MAX_DEAD_LETTER_BARS = 15
LABEL_CHARS = 44
CHAR_W = 8.0  # the widest a character of the plots' 12px text gets, on average, in common sans-serif fonts
ROW_H = 16  # a row of 12px text, with room between rows
PERIOD = {"second": timedelta(seconds=1), "minute": timedelta(minutes=1), "hour": timedelta(hours=1)}

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
svg .marker {{ fill: {RED}; stroke: #fff; stroke-width: 3px; paint-order: stroke; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ border-bottom: 1px solid #d0d7de; padding: .3rem .8rem; text-align: left; }}
"""


def _esc(value: object) -> str:
    return html.escape(str(value))


def _human(seconds: float | None) -> str:
    """A duration the way a person writes it: 5ms, 1.2s, 3m, 2h, 4d; an em dash when unknown."""
    if seconds is None:
        return "—"
    if math.isinf(seconds):
        return "∞"
    units = ((86400, "d"), (3600, "h"), (60, "m"), (1, "s"))
    divisor, unit = next(((d, u) for d, u in units if abs(seconds) >= d), (0.001, "ms"))
    return f"{seconds / divisor:.1f}".rstrip("0").rstrip(".") + unit


def _text(x: float, y: float, content: object, anchor: str = "middle", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{_esc(content)}</text>'


def _figure(fig_id: str, title: str, caption: str, body: str, height: int = H) -> str:
    """Wrap plot elements in a framed, titled SVG."""
    frame_h = height - TOP - BOTTOM
    return (
        f'<figure id="{fig_id}"><svg viewBox="0 0 {W} {height}" role="img" aria-labelledby="{fig_id}-title">'
        f'<title id="{fig_id}-title">{_esc(title)}</title>'
        f'<rect class="frame" x="{X0}" y="{TOP}" width="{PW}" height="{frame_h}"/>{body}</svg>'
        f"<figcaption><strong>{_esc(title)}</strong> — {_esc(caption)}</figcaption></figure>"
    )


def _empty(fig_id: str, title: str, why: str) -> str:
    """A plot with nothing to draw: one line of text in its place."""
    return f'<p class="empty" id="{fig_id}"><strong>{_esc(title)}</strong> — {_esc(why)}</p>'


def _compact(count: int) -> str:
    """A count short enough for the plots' axis: 950, 12.3k, 4.1M."""
    for size, suffix in ((10**9, "G"), (10**6, "M"), (10**4, "k")):
        if count >= size:
            return f"{count / size:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{count:,}"


def _marker_labels(markers: list[tuple[float, str]]) -> str:
    """The labels of the latency plot's marker lines (x, text), each beside its line: right of it,
    or left of it where the frame ends; a label that would overlap one placed before it goes to
    the next row down. Widths are estimated from ``CHAR_W``."""
    placed: list[tuple[int, float, float]] = []  # row, left, right
    parts = []
    for x, label in markers:
        width = CHAR_W * len(label)
        anchor, left = ("start", x + 4) if x + 4 + width <= X1 else ("end", x - 4 - width)
        row = next(r for r in range(len(markers)) if not any(
            placed_row == r and left < right + 4 and placed_left < left + width + 4
            for placed_row, placed_left, right in placed))
        placed.append((row, left, left + width))
        parts.append(_text(x + 4 if anchor == "start" else x - 4, Y0 + 14 + ROW_H * row, label, anchor,
                           ' class="marker"'))
    return "".join(parts)


def _latency_plot(histogram: list[tuple[float, float, int]], latency: dict) -> str:
    title = "Latency from sent to handled"
    peak = max((count for _, _, count in histogram), default=0)
    if peak <= 0:
        return _empty("latency-plot", title, "no message handled")
    bw = PW / len(histogram)
    parts = [_text(X0 - 6, Y0 + 10, _compact(peak), "end"), _text(X0 - 6, Y1, 0, "end")]
    for i, (low, high, count) in enumerate(histogram):
        h = PH * count / peak
        parts.append(
            f'<rect class="bar" x="{X0 + i * bw + 1:.1f}" y="{Y1 - h:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{h:.1f}"><title>{_esc(f"{_human(low)}–{_human(high)}: {count:,}")}</title></rect>'
        )
    edges = [low for low, _, _ in histogram] + [histogram[-1][1]]
    step = math.ceil(len(edges) / 9)
    parts += [_text(X0 + j * bw, Y1 + 16, _human(edges[j])) for j in range(0, len(edges), step)]
    markers = []
    for name in ("p50", "p95", "p99"):
        value = latency.get(name)
        bucket = next((i for i, (lo, hi, _) in enumerate(histogram) if value is not None and lo <= value <= hi), None)
        if bucket is None:
            continue
        low, high, _ = histogram[bucket]
        fraction = (value - low) / (high - low) if high > low and not math.isinf(high) else 0.5
        x = X0 + (bucket + fraction) * bw
        parts.append(f'<line x1="{x:.1f}" y1="{Y0}" x2="{x:.1f}" y2="{Y1}" stroke="{RED}" stroke-dasharray="5 4"/>')
        markers.append((x, f"{name} {_human(value)}"))
    parts.append(_marker_labels(markers))
    total = sum(count for _, _, count in histogram)
    caption = f"{total:,} handled messages in {len(histogram)} buckets; dashed lines mark p50, p95 and p99"
    return _figure("latency-plot", title, caption, "".join(parts))


def _with_zeros(throughput: list[tuple[str, int, int]], unit: str) -> list[tuple[datetime, int, int]]:
    """The periods with their times, and a zero period after and before each run of periods without
    traffic (which the aggregate leaves out), so the line drops to zero across them rather than
    drawing a slope over them."""
    step = PERIOD[unit]
    rows = [(datetime.fromisoformat(period), sent, handled) for period, sent, handled in throughput]
    filled = rows[:1]
    for previous, row in pairwise(rows):
        gap = row[0] - previous[0]
        if gap > step:
            filled.append((previous[0] + step, 0, 0))
        if gap > 2 * step:
            filled.append((row[0] - step, 0, 0))
        filled.append(row)
    return filled


def _throughput_plot(throughput: list[tuple[str, int, int]], unit: str = "minute") -> str:
    title = "Throughput over time"
    if not throughput:
        return _empty("throughput-plot", title, "no message sent or handled")
    rows = _with_zeros(throughput, unit)
    peak = max(max(sent, handled) for _, sent, handled in rows)
    first, span = rows[0][0], (rows[-1][0] - rows[0][0]).total_seconds()
    xs = [X0 + ((moment - first).total_seconds() / span if span else 0.5) * PW for moment, _, _ in rows]
    parts = [_text(X0 - 6, Y0 + 10, _compact(peak), "end"), _text(X0 - 6, Y1, 0, "end")]
    for column, colour, name in ((1, BLUE, "sent"), (2, GREEN, "handled")):
        # straight segments between the counts, each at or above the zero line (Y1)
        points = [(x, min(Y1, Y1 - PH * row[column] / max(peak, 1))) for x, row in zip(xs, rows, strict=True)]
        if len(points) == 1:  # a single period: a short dash, since one point draws nothing
            points = [(points[0][0] - 8, points[0][1]), (points[0][0] + 8, points[0][1])]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(
            f'<polyline class="{name}" points="{coords}" fill="none" stroke="{colour}" stroke-width="2" '
            'stroke-linejoin="round"/>'
        )
        lx = X0 + PW / 2 + (column - 2) * 90 + 10  # the legend, centred under the frame, between the axis labels
        parts.append(f'<line x1="{lx}" y1="{Y1 + 28}" x2="{lx + 20}" y2="{Y1 + 28}" stroke="{colour}" '
                     'stroke-width="3"/>')
        parts.append(_text(lx + 26, Y1 + 32, name, "start"))
    if len(throughput) == 1:
        parts.append(_text(xs[0], Y1 + 16, throughput[0][0]))
    else:
        parts += [_text(X0, Y1 + 16, throughput[0][0], "start"), _text(X1, Y1 + 16, throughput[-1][0], "end")]
    sent, handled = sum(row[1] for row in throughput), sum(row[2] for row in throughput)
    caption = (f"messages per {unit} ({len(throughput):,} {unit}s with traffic): "
               f"{sent:,} sent, {handled:,} handled")
    return _figure("throughput-plot", title, caption, "".join(parts))


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
            f"<g><title>{_esc(f'{label}: {count:,}')}</title>{_text(X0 + 6, y + 4, short, 'start')}"
            f'<rect class="dead" x="{bar_x0}" y="{y - 8:.1f}" width="{w:.1f}" height="16"/>'
            f"{_text(bar_x0 + w + 6, y + 4, f'{count:,}', 'start')}</g>"
        )
    shown = f"top {len(rows)} of {len(dead_letters)}" if len(dead_letters) > len(rows) else f"all {len(rows)}"
    caption = f"{sum(r[2] for r in dead_letters):,} dead letters; {shown} task/exception pairs"
    return _figure("dead-letters-plot", title, caption, "".join(parts), height)


def _tiles(summary: dict) -> str:
    latency, stuck = summary["latency_seconds"], summary["stuck"]
    tiles = [
        ("sent", f"{summary['sent']:,}", ""),
        ("handled", f"{summary['handled']:,}", ""),
        ("lost", f"{summary['lost']:,}", "bad" if summary["lost"] else "good"),
        ("dead-lettered", f"{summary['dead_lettered']:,}", "warn" if summary["dead_lettered"] else ""),
        ("duplicates discarded", f"{summary['duplicates_discarded']:,}", ""),
        (
            f"late (> {_human(summary['late_threshold_seconds'])})",
            f"{summary['late']:,}",
            "warn" if summary["late"] else "",
        ),
        (
            "stuck" if stuck is not None else "stuck (live tables not read)",
            "—" if stuck is None else f"{stuck:,}",
            "warn" if stuck else "",
        ),
        ("p50 latency", _human(latency["p50"]), ""),
        ("p99 latency", _human(latency["p99"]), ""),
        ("max latency", _human(latency["max"]), ""),
    ]
    return (
        '<section class="tiles">'
        + "".join(
            f'<div class="tile {cls}"><b>{_esc(value)}</b><span>{_esc(label)}</span></div>'
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
    return '<ul class="inputs" id="inputs">' + "".join(f"<li>{_esc(line)}</li>" for line in lines) + "</ul>"


def _table(headers: tuple[str, ...], rows: list[tuple[object, ...]], empty: str) -> str:
    if not rows:
        return f"<p>{_esc(empty)}</p>"
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_report(
    summary: dict,
    latency_histogram: list[tuple[float, float, int]],
    throughput: list[tuple[str, int, int]],
    dead_letters: list[tuple[str, str, int]],
    latency_by_task: list[dict],
) -> str:
    """Return the whole HTML document."""
    lost = summary["lost"]
    verdict = "CLEAN" if lost == 0 else f"{lost:,} LOST"
    window = f"{summary['window_start'] or 'the beginning'} → {summary['window_end'] or 'now'}"
    examples = summary["lost_examples"]
    lost_rows = [(e["message_id"], e["task_name"], e["destination"], e["sent_at"]) for e in examples]
    task_rows = [
        (r["task_name"], f"{r['count']:,}", *(_human(r[key]) for key in ("p50", "p95", "p99", "max")))
        for r in latency_by_task
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Delivery audit: {verdict}</title><style>{CSS}</style></head>
<body><header><h1>Delivery audit <span class="verdict {"good" if lost == 0 else "bad"}">{verdict}</span></h1>
<p class="meta">window {_esc(window)} · generated {_esc(summary["generated_at"])}</p></header>
{_tiles(summary)}
{_inputs(summary["inputs"])}
{_latency_plot(latency_histogram, summary["latency_seconds"])}
{_throughput_plot(throughput, summary.get("throughput_unit", "minute"))}
{_dead_letters_plot(dead_letters)}
<h2>Lost messages{f" (showing {len(examples)} of {lost:,})" if lost > len(examples) else ""}</h2>
{_table(("message id", "task", "destination", "sent at"), lost_rows, "No message was lost.")}
<h2>Latency by task</h2>
{_table(("task", "handled", "p50", "p95", "p99", "max"), task_rows, "No message was handled.")}
</body></html>
"""
