"""The audit benchmark runs: at small sizes (``--quick``) it checks every run's answer against what
its generator planted, a full run and the incremental second run alike; never how fast they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import require_spark

ROOT = Path(__file__).parents[2]


def test_the_audit_benchmark_checks_a_full_and_an_incremental_run(tmp_path):
    require_spark()
    report_path = tmp_path / "results.json"
    completed = subprocess.run([sys.executable, "-m", "benchmarks", "audit", "--quick", "--json", str(report_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(report_path.read_text())["results"]
    assert [r["case"] for r in results] == ["Spark job on 20 k archived envelopes",
                                            "second run, 20 k archived + 2 k new: incremental"]
    assert all(r["ours"] > 0 for r in results)
    assert "for a full run of the same archive that keeps no ledger" in results[1]["note"]
    progress = completed.stderr
    assert "20,000 + 2,000 messages, incremental: audit in" in progress
    assert "20,000 + 2,000 messages, full, no ledger: audit in" in progress
