"""``python -m benchmarks [NAME ...] [--quick] [--json PATH]``: run the benchmarks, print the table.

Each benchmark measures celery-outbox and plain Celery in the same run, on the same
services, and reports throughputs and their ratio; the table says which targets hold.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from datetime import datetime, timezone

from .common import Options, Result, machine, table, verdicts

BENCHMARKS = ("producer", "worker", "relay", "cleanup", "audit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that they run, not how fast")
    parser.add_argument("--json", default="benchmarks/results.json", help="where to write the results")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick)
    results: list[Result] = []
    started = datetime.now(timezone.utc)
    for name in args.names or BENCHMARKS:
        began = time.monotonic()
        print(f"benchmark {name} ...", file=sys.stderr, flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        results.extend(module.run(options))
        print(f"benchmark {name}: {time.monotonic() - began:.0f}s", file=sys.stderr, flush=True)
    report = {"started": started.isoformat(timespec="seconds"), "quick": args.quick, "machine": machine(),
              "results": [result.as_dict() for result in results]}
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=2)
    print(table(results))
    print(f"\n{verdicts(results)}")
    print(f"\nmachine: {report['machine']}\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
