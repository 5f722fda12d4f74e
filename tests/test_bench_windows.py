"""``bench_attention.py --windows`` at tiny sizes: its report carries each program's temporary memory and
page faults beside the times (the numbers docs/blockwise.md quotes), in the JSON and the table."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_window_benchmark_reports_temporary_memory_and_page_faults(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "experiments/bench_attention.py", "--windows", "--window-T", "512", "--causal-T", "512",
           "--window", "64", "--window-block", "64", "--block-q", "128", "--block-k", "128",
           "--window-memory-T", "0", "--rounds", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "bench_windows.json").read_text())
    pairs = report["pairs"]
    assert [(p["kinds"], p["cfg"]["mode"]) for p in pairs] == [
        (["window", "causal"], "fwd"), (["window", "causal"], "fwd+bwd"),
        (["causal", "full"], "fwd"), (["causal", "full"], "fwd+bwd")]
    for p in pairs:
        for kind in p["kinds"]:
            # a forward+backward at T = 512 needs at least its [512, 64] float32 key gradient as a temporary
            assert p["temp_bytes"][kind] > (512 * 64 * 4 if p["cfg"]["mode"] == "fwd+bwd" else 0), (p["cfg"], kind)
            assert p["page_faults_per_call"][kind] >= 0
            assert len(p["wall"][kind]["runs"]) == 3
    table = (out / "bench_windows.md").read_text()
    assert "| temp, faults |" in table
    row = next(line for line in table.splitlines() if line.startswith("| window W=64") and "| fwd+bwd |" in line)
    assert "MiB" in row.split("|")[-3], row
