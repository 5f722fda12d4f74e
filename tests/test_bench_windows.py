"""``bench_attention.py --windows`` and ``--baseline`` at tiny sizes: the windows' report carries each program's
temporary memory and page faults beside the times (the numbers docs/blockwise.md quotes), the baseline's each
side's ratios to jax.nn and their quotient, in the JSON and the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_the_baseline_comparison_reports_each_sides_ratios_to_jax_nn_and_their_quotient(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "experiments/bench_attention.py", "--baseline", str(ROOT), "--rounds", "3",
           "--gpt2-T", "64", "--modes", "fwd", "--only", "full", "--min-rounds", "3", "--max-rounds", "3",
           "--seconds-per-config", "0.1", "--block-q", "32", "--block-k", "32", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "bench_baseline.json").read_text())
    assert [len(report["runs"][side]) for side in ("ours", "baseline")] == [3, 3]
    assert list(report["summary"]) == ["gpt2-T64-N12-H64-full-fwd"]
    for impl in ("dense", "blockwise"):
        entry = report["summary"]["gpt2-T64-N12-H64-full-fwd"][impl]
        for side in ("ours", "baseline"):
            assert len(entry[side]["wall"]["runs"]) == 3 and entry[side]["wall"]["median"] > 0
        assert entry["ours_over_baseline"] == pytest.approx(
            entry["ours"]["wall"]["median"] / entry["baseline"]["wall"]["median"])
    table = (out / "bench_baseline.md").read_text()
    assert "| gpt2-T64-N12-H64-full-fwd | blockwise/xla |" in table


def test_the_baseline_comparison_refuses_a_folder_without_jaxattn_before_any_run(tmp_path):
    cmd = [sys.executable, "experiments/bench_attention.py", "--baseline", str(tmp_path), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--baseline" in proc.stderr and "jaxattn/__init__.py" in proc.stderr
    assert not (tmp_path / "o").exists()
