"""The lab's parts 1-2 (library side): data checked against NumPy, rendering, files written atomically."""

import json
import math
import os

import numpy as np
import pytest

from jaxattn import lab
from jaxattn.io import write_json
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
    assert band["entropy_mean"]["ratio"] < 1.05 and "k_grad_norm_mean" in band
    for r, d in zip(rows, DIMS):  # the Q/K table reads the summary's medians and means
        assert r["q_grad_mean_unscaled"] == summary["q_grad_norm"]["mean"][1, list(DIMS).index(d)]
        assert r["k_grad_median_scaled"] == summary["k_grad_norm"]["median"][0, list(DIMS).index(d)]
    qk = lab.render_table(rows, columns=lab.QK_COLUMNS).splitlines()
    assert qk[0].split()[:3] == ["d_k", "|∂q|", "med"] and len(qk) == 1 + len(DIMS)


def test_laws_and_zero_fractions_render(small):
    summary = small["summaries"]["float32"]
    laws = lab.fit_laws(summary, dtype="float32")
    assert laws["fit_head_dims"] == [d for d in DIMS if d >= lab.FIT_MIN_HEAD_DIM]
    assert laws["gap_median"] == pytest.approx(probes.gap_median(16))
    text = lab.render_laws(laws)
    # float32: 1 - p_max rounds to 0 on typical unscaled rows at large d_k, so that median is not fitted
    assert "median_jacobian_norm" in text and "median_one_minus_max_weight" in text
    assert "not fitted, 0 in float32 at d_k = [" in text and "median_k_grad_norm" in text
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
    path = write_json(str(tmp_path / "out" / "part2.json"), {"summary": summary, "inf": math.inf, "flag": np.bool_(True)})
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


def test_lab_script_runs_parts_3_and_4_once_on_a_random_gpt2(tmp_path, capsys):
    import runpy
    import sys

    argv = sys.argv
    try:
        sys.argv = ["lab.py", "--parts", "3,4", "--random-gpt2", "tiny", "--out", str(tmp_path)]
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py"), run_name="__main__")
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert out.count("== Part 3") == 1 and out.count("== Part 4") == 1 and "RANDOM" in out
    data = json.loads((tmp_path / "trophy" / "trophy.json").read_text())
    assert data["model"] == "random-gpt2-tiny" and data["part4"]


def test_readout_norm_and_key_gap_closed_forms():
    # V = 1: E|N(0, 1)| = √(2/π); V → ∞: E‖r‖ → 1 (1 - 1/(4V) + …).
    assert lab.readout_norm_mean(1) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-12)
    assert lab.readout_norm_mean(400) == pytest.approx(1 - 1 / 1600, rel=1e-5)
    r = np.random.default_rng(0).standard_normal((200_000, 16)) / 4.0
    assert lab.readout_norm_mean(16) == pytest.approx(np.linalg.norm(r, axis=-1).mean(), rel=2e-3)
    # T = 1, S = 2: both keys' gap is |Z1 - Z2|, half-normal with scale √2, median √2 · Φ⁻¹(3/4).
    assert lab.key_gap_median(1, 2, samples=200_000) == pytest.approx(math.sqrt(2) * 0.6744897501960817, rel=1e-2)
    # More rows give a key more chances of a small gap.
    assert lab.key_gap_median(16, 16) < lab.key_gap_median(4, 16) < lab.key_gap_median(1, 16)


def test_lab_part2_end_to_end_in_float16_writes_its_files(tmp_path, capsys):
    """Part 2 from the script, float16 first (medians underflow to 0: reported, not fitted, no crash)."""
    import runpy
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py")
    argv = sys.argv
    try:
        sys.argv = ["lab.py", "--parts", "2", "--trials", "2", "--queries", "4", "--keys", "4", "--dtypes", "float16",
                    "--out", str(tmp_path), "--seed", "3"]
        runpy.run_path(script, run_name="__main__")
        out = capsys.readouterr().out
        sys.argv = ["lab.py", "--parts", "2", "--dtypes", "float32,float8"]
        with pytest.raises(SystemExit):
            runpy.run_path(script, run_name="__main__")
        assert "--dtypes takes a comma-separated list of float32,bfloat16,float16,float64, received 'float32,float8'" in capsys.readouterr().err
    finally:
        sys.argv = argv
    assert "Part 2b: saturation sweep in float16" in out and "not fitted, 0 in float16 at d_k = [" in out
    assert "|∂k| mean unsc" in out and "seed 3" in out
    data = json.loads((tmp_path / "part2.json").read_text())
    assert data["seed"] == 3 and len(data["table"]) == len(DIMS) and "median_k_grad_norm" in data["laws"]
    assert (tmp_path / "part2_sweep.png").read_bytes()[:4] == b"\x89PNG"
