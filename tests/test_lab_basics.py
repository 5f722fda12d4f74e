"""The lab's parts 1-2 (library side): data checked against NumPy, rendering, files written atomically."""

import json
import math
import os

import numpy as np
import pytest

from jaxattn import _lab_basics as lab
from jaxattn import probes

DIMS = probes.DEFAULT_HEAD_DIMS


def test_part1_rows_sum_to_one_and_match_numpy():
    data = lab.part1(3)
    q, k, v = (data[n].astype(np.float64) for n in ("q", "k", "v"))
    z = q @ k.T / math.sqrt(q.shape[1])
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(data["weights"], p, atol=1e-6)
    np.testing.assert_allclose(data["out"], p @ v, atol=1e-5)
    assert data["rows_ok"] and data["max_row_error"] <= 1e-6
    text = lab.render_part1(data)
    assert "verified: every row sums to 1 within 1e-06" in text
    assert "row sums of A: 1.000 1.000 1.000 1.000" in text
    assert f"{data['weights'][0, 0]:7.3f}" in text and f"{data['q'][1, 2]:7.3f}" in text


def test_part1_reports_a_failed_check():
    data = dict(lab.part1(0), rows_ok=False, max_row_error=2e-3)
    assert "CHECK FAILED" in lab.render_part1(data)


def test_side_by_side_unscaled_is_sharper():
    data = lab.side_by_side(0, num_tokens=6, head_dims=(64, 512))
    for row in data["rows"]:
        assert row["entropy_unscaled"].mean() < row["entropy_scaled"].mean()
        assert np.all(row["entropy_scaled"] <= math.log(6) + 1e-6)
    text = lab.render_side_by_side(data)
    assert "d_k = 512" in text and "H unscaled" in text


@pytest.fixture(scope="module")
def small():
    # The same static configuration as tests/test_probes.py's small sweep, so the compiled program is reused.
    return lab.sweep(7, head_dims=DIMS, num_trials=8, num_queries=32, num_keys=16, value_dim=4, dtypes=("float32",))


def test_sweep_table_columns_and_ratios(small):
    summary = small["summaries"]["float32"]
    rows = lab.sweep_table(summary)
    assert [r["d_k"] for r in rows] == list(DIMS)
    for r in rows:
        assert abs(r["var_qk"] / r["d_k"] - 1) < 0.1
        assert r["grad_median_ratio"] == pytest.approx(r["grad_median_scaled"] / r["grad_median_unscaled"])
    assert rows[-1]["grad_median_ratio"] > 1e3  # the unscaled typical row has almost no gradient left
    text = lab.render_table(rows)
    assert text.splitlines()[0].split()[:2] == ["d_k", "Var(q·k)"] and len(text.splitlines()) == 1 + len(DIMS)
    md = lab.render_table(rows, markdown=True)
    assert md.startswith("| d_k | Var(q·k) |") and md.count("\n") == 1 + len(DIMS)
    band = lab.scaled_band(summary)
    assert band["entropy_mean"]["ratio"] < 1.05


def test_laws_and_zero_fractions_render(small):
    summary = small["summaries"]["float32"]
    laws = lab.fit_laws(summary, dtype="float32")
    assert laws["fit_head_dims"] == [d for d in DIMS if d >= lab.FIT_MIN_HEAD_DIM]
    assert laws["gap_median"] == pytest.approx(probes.gap_median(16))
    text = lab.render_laws(laws)
    assert "median_jacobian_norm" in text and "not fitted: it rounds to 0 in float32" in text
    with pytest.raises(ValueError, match="underflowed"):
        probes.fit_power_law([1, 2], [1.0, 0.0])
    zeros = lab.zero_fractions(small)
    assert zeros["float32"]["underflow_gap"] == pytest.approx(126 * math.log(2))
    assert len(zeros["float32"]["measured"]) == len(DIMS)
    assert "float32" in lab.render_zero_fractions(zeros, DIMS)


def test_files_are_written_atomically_and_parse(small, tmp_path):
    summary = small["summaries"]["float32"]
    zeros = lab.zero_fractions(small)
    fig = lab.plot_sweep(summary, zeros, title="test")
    png = lab.save_figure(fig, str(tmp_path / "out" / "sweep.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    path = lab.write_json(str(tmp_path / "out" / "part2.json"), {"summary": summary, "inf": math.inf, "flag": np.bool_(True)})
    with open(path) as f:
        data = json.load(f)
    assert data["summary"]["head_dims"] == list(DIMS) and data["inf"] == "inf" and data["flag"] is True
    assert sorted(os.listdir(tmp_path / "out")) == ["part2.json", "sweep.png"]  # no temporary file left


def test_lab_script_runs_part1_and_rejects_missing_parts(tmp_path, capsys):
    import runpy
    import sys

    argv = sys.argv
    try:
        sys.argv = ["lab.py", "--parts", "1", "--out", str(tmp_path), "--seed", "5"]
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py"), run_name="__main__")
        out = capsys.readouterr().out
        assert "seed 5" in out and str(tmp_path) in out and "verified" in out
        assert json.loads((tmp_path / "part1.json").read_text())["seed"] == 5
        sys.argv = ["lab.py", "--parts", "9"]
        with pytest.raises(SystemExit):
            runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py"), run_name="__main__")
        assert "not available" in capsys.readouterr().err
    finally:
        sys.argv = argv
