"""``python -m benchmarks [NAME ...] [--quick] [--scale S] [--json PATH]``: run the benchmarks,
print the table. ``python -m benchmarks --report PATH``: print the table of a run from its JSON
again.

Each benchmark measures celery-outbox and plain Celery in the same run, on the same
services, and reports throughputs and their ratio; the table says which targets hold. A full run
first measures the host's pace (``pace``), which sets the units of work a round runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from datetime import datetime, timezone

from . import pace
from .common import Options, Result, machine, table, verdicts

BENCHMARKS = ("producer", "worker", "relay", "contention", "cleanup", "audit", "django", "peers", "asyncio",
              "tenants")
#: The module of each benchmark whose name is not its module's (``asyncio`` would shadow the standard library's)
MODULES = {"asyncio": "async_units"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that they run, not how fast")
    parser.add_argument("--scale", type=float, metavar="S",
                        help="the share of the full units of work a round runs (default: set for each benchmark by "
                             "the host's pace, to keep a full run within its budget; 1 runs the full sizes)")
    parser.add_argument("--json", default="benchmarks/results.json", help="where to write the results")
    parser.add_argument("--report", metavar="PATH", help="run nothing: print the table and summary of the results "
                        "written to PATH by an earlier run")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report)
    if args.scale is not None and not 0 < args.scale <= 1:
        parser.error(f"--scale must be above 0 and at most 1, not {args.scale}")
    names = args.names or list(BENCHMARKS)
    started = datetime.now(timezone.utc)
    calibration = None if args.quick or args.scale is not None else pace.measure()
    budget = None if calibration is None else pace.Budget(names, calibration.slowdown)
    results: list[Result] = []
    minutes: dict[str, float] = {}
    scales: dict[str, float] = {}
    for name in names:
        began = time.monotonic()
        scale = args.scale if args.scale is not None else budget.scale_for(name) if budget else 1.0
        scales[name] = round(scale, 3)
        print(f"benchmark {name} ..." + ("" if args.quick else f" ({scale:.2f} of its full sizes)"),
              file=sys.stderr, flush=True)
        module = importlib.import_module(f"benchmarks.{MODULES.get(name, name)}")
        results.extend(module.run(Options(quick=args.quick, scale=scale)))
        took = (time.monotonic() - began) / 60
        minutes[name] = round(took, 1)
        if budget is not None:
            budget.ran(name, took)
        print(f"benchmark {name}: {minutes[name]} min", file=sys.stderr, flush=True)
    written = {"started": started.isoformat(timespec="seconds"), "quick": args.quick, "machine": machine(),
               "scales": None if args.quick else scales,
               "calibration_ms": None if calibration is None else round(calibration.ms_per_unit, 3),
               "minutes": minutes, "results": [result.as_dict() for result in results]}
    with open(args.json, "w") as handle:
        json.dump(written, handle, indent=2)
    _print(results, written["machine"], minutes, _scaled(written))
    print(f"written to {args.json}")
    return 0


def report(path: str) -> int:
    """Print the table and summary of the results at ``path``, as the run that wrote them did."""
    try:
        with open(path) as handle:
            written = json.load(handle)
        results = [Result.from_dict(row) for row in written["results"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"python -m benchmarks --report: cannot read the results in {path}: {exc!r}", file=sys.stderr)
        return 2
    print(f"run of {written.get('started', 'an unknown time')}" + (" (--quick)" if written.get("quick") else ""))
    _print(results, written.get("machine", {}), written.get("minutes", {}), _scaled(written))
    return 0


def _scaled(written: dict) -> str:
    """What share of its full units of work each benchmark's rounds ran, and what set it."""
    if written.get("quick"):
        return "sizes: quick"
    scales, calibration = written.get("scales"), written.get("calibration_ms")
    if not scales:
        return "sizes: full"
    why = "given (--scale)" if calibration is None else \
        f"by the host's pace: plain Celery's unit of work writing one row took {calibration:.2f} ms here"
    return f"sizes, the share of the full units of work a round ran: " \
           f"{', '.join(f'{name} {scale:.2f}' for name, scale in scales.items())} ({why})"


def _print(results: list[Result], machine_described: dict, minutes: dict[str, float], sizes: str) -> None:
    print(table(results))
    print(f"\n{verdicts(results)}")
    print(f"\nmachine: {machine_described}")
    print(sizes)
    if minutes:
        print(f"minutes: {', '.join(f'{name} {each}' for name, each in minutes.items())}; "
              f"in all {sum(minutes.values()):.0f}")


if __name__ == "__main__":
    sys.exit(main())
