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
    calls = []
    data = lab.sweep(7, head_dims=DIMS, num_trials=8, num_queries=32, num_keys=16, value_dim=4, dtypes=("float32",),
                     progress=lambda *a: calls.append(a))
    return dict(data, progress_calls=calls)


def test_sweep_says_which_program_runs(small):
    assert small["progress_calls"] == [(0, 1, f"float32: {len(DIMS)} d_k x 8 trials"), (1, 1, "done")]


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
        sys.argv = ["lab.py", "--parts", "1", "--out", str(tmp_path), "--seed", "5", "--no-cache"]
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py"), run_name="__main__")
        captured = capsys.readouterr()
        out = captured.out
        assert "seed 5" in out and str(tmp_path) in out and "verified" in out
        assert out.splitlines()[1] == "compiled programs: not kept"
        assert captured.err.startswith("part 1: attention on 4 tokens ... ")  # progress goes to stderr
        assert json.loads((tmp_path / "part1.json").read_text())["seed"] == 5
        sys.argv = ["lab.py", "--parts", "9"]
        with pytest.raises(SystemExit):
            runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py"), run_name="__main__")
        assert "not available" in capsys.readouterr().err
    finally:
        sys.argv = argv


@pytest.mark.slow  # a whole lab run, end to end: `make test-slow`
def test_lab_script_runs_parts_3_and_4_once_on_a_random_gpt2(tmp_path, capsys):
    import runpy
    import sys

    argv = sys.argv
    try:
        sys.argv = ["lab.py", "--parts", "3,4", "--random-gpt2", "tiny", "--out", str(tmp_path), "--no-cache"]
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py"), run_name="__main__")
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert out.count("== Part 3") == 1 and out.count("== Part 4") == 1 and "RANDOM" in out
    data = json.loads((tmp_path / "trophy" / "trophy.json").read_text())
    assert data["model"] == "random-gpt2-tiny" and data["part4"]
    for name in ("trophy_difference.png", "trophy_focus.png"):
        assert (tmp_path / "trophy" / name).read_bytes().startswith(b"\x89PNG")
    assert "<script" in (tmp_path / "trophy" / "trophy.html").read_text()


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


@pytest.mark.slow  # a whole lab run, end to end: `make test-slow`
def test_lab_part2_end_to_end_in_float16_writes_its_files(tmp_path, capsys):
    """Part 2 from the script, float16 first (medians underflow to 0: reported, not fitted, no crash)."""
    import runpy
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py")
    argv = sys.argv
    try:
        sys.argv = ["lab.py", "--parts", "2", "--trials", "2", "--queries", "4", "--keys", "4", "--dtypes", "float16",
                    "--out", str(tmp_path), "--seed", "3", "--no-cache"]
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


# ----------------------------------------------------------------------------------------------------
# Degenerate data: a fit that cannot be made is reported, never raised (fit_laws, render_laws, the script).
# ----------------------------------------------------------------------------------------------------

_LAW_STATS = ("jacobian_norm", "logit_grad_norm", "q_grad_norm", "k_grad_norm", "entropy")
_FITTED_KEYS = ("median_jacobian_norm", "median_logit_grad_norm", "median_q_grad_norm", "median_k_grad_norm",
                "median_one_minus_max_weight", "mean_jacobian_norm", "mean_entropy", "mean_logit_grad_norm",
                "mean_one_minus_max_weight", "mean_q_grad_norm", "mean_k_grad_norm")


def _spoiled(summary, value, *, at):
    """A copy of ``summary`` whose unscaled statistics (means and medians) are ``value`` at ``d_k = at``."""
    import copy

    out = copy.deepcopy(summary)
    i = list(summary["head_dims"]).index(at)
    for name in _LAW_STATS:
        for stat in ("mean", "median"):
            out[name][stat][1, i] = value
    for stat in ("mean", "median"):  # 1 - max weight takes the same value
        out["max_weight"][stat][1, i] = 1 - value
    return out


def _check_reported(laws, reason, tmp_path):
    """Every fitted law is reported as not fitted, its reason matching the regex ``reason``, and the laws render
    and are written as JSON without error."""
    import re

    for key in _FITTED_KEYS:
        assert re.search(reason, laws[key]["not_fitted"]), (key, laws[key])
    lines = lab.render_laws(laws).splitlines()
    for key in _FITTED_KEYS:
        (line,) = [line for line in lines if line.split()[0] == key]
        assert "not fitted, " in line and re.search(reason, line), line
    data = json.loads(write_json(str(tmp_path / "laws.json"), laws).read_text())
    assert all(re.search(reason, data[key]["not_fitted"]) for key in _FITTED_KEYS)


@pytest.mark.parametrize("value, what", [(0.0, "0"), (-0.5, "negative"), (math.nan, "not finite"), (math.inf, "not finite")])
def test_fit_laws_reports_statistics_it_cannot_fit(small, tmp_path, value, what):
    # The statistic is `value` at d_k = 1024 (1 - max weight may already be 0 at other d_k in float32).
    laws = lab.fit_laws(_spoiled(small["summaries"]["float32"], value, at=1024), dtype="float32")
    _check_reported(laws, rf"{what} in float32 at d_k = \[[^\]]*\b1024\b", tmp_path)


@pytest.mark.parametrize("min_head_dim, fitted", [(4096, [4096]), (10_000, [])])
def test_fit_laws_reports_too_few_head_dims(small, tmp_path, min_head_dim, fitted):
    import re

    laws = lab.fit_laws(small["summaries"]["float32"], dtype="float32", min_head_dim=min_head_dim)
    assert laws["fit_head_dims"] == fitted
    _check_reported(laws, re.escape(f"needs at least 2 distinct d_k >= {min_head_dim}, the sweep has {fitted}"), tmp_path)


def test_constant_fit_and_scaled_band_on_zeros(small):
    from jaxattn.lab import _saturation

    with pytest.raises(ValueError, match="fitted constant C is 0"):
        _saturation._fit_constant(np.array([256.0, 1024.0]), np.zeros(2))
    summary = _spoiled(small["summaries"]["float32"], 0.0, at=1024)
    for name in _LAW_STATS:
        summary[name]["mean"][0] = 0.0  # the scaled band's min is 0: its ratio is inf, not a division by zero
    band = lab.scaled_band(summary)
    assert band["entropy_mean"] == {"min": 0.0, "max": 0.0, "ratio": math.inf}


# ----------------------------------------------------------------------------------------------------
# The script, in-process: main(argv) on tiny sweeps, bad arguments and bad output folders.
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab_script():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "lab.py")
    spec = importlib.util.spec_from_file_location("lab_script_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root):
    """Every path under ``root`` (files and folders, hidden ones included), relative."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


TINY = ["--parts", "2", "--trials", "1", "--queries", "2", "--keys", "2", "--dtypes", "float32", "--no-cache"]


def _run_sweep_and_check_laws(lab_script, out, capsys, argv):
    lab_script.main(argv + ["--out", str(out)])
    stdout = capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["part2.json", "part2_sweep.png"]  # nothing temporary left
    laws = json.loads((out / "part2.json").read_text())["laws"]
    not_fitted = [k for k in _FITTED_KEYS if "not_fitted" in laws[k]]
    for key in _FITTED_KEYS:  # each law is either fitted (numbers) or says why not
        assert ("not_fitted" in laws[key]) != ("C" in laws[key] or "b" in laws[key]), laws[key]
    for key in not_fitted:
        assert f"{key}" in stdout and f"not fitted, {laws[key]['not_fitted']}" in stdout
    return laws, not_fitted, stdout


@pytest.mark.slow  # a whole lab run, end to end: `make test-slow`
def test_lab_tiny_sweep_writes_part2_and_says_which_fits_were_not_made(lab_script, tmp_path, capsys):
    # 1 trial × 2 rows × 2 keys: means underflow to 0 at large d_k too, not only medians (this crashed the fit).
    laws, not_fitted, stdout = _run_sweep_and_check_laws(lab_script, tmp_path / "out", capsys, TINY)
    assert "median_one_minus_max_weight" in not_fitted and any(k.startswith("mean_") for k in not_fitted)
    assert all(laws[k]["not_fitted"].startswith("0 in float32 at d_k = [") for k in not_fitted)
    assert "wrote " in stdout and "part2.json" in stdout


@pytest.mark.slow  # a whole lab run, end to end: `make test-slow`
def test_lab_single_head_dim_sweep_writes_part2(lab_script, tmp_path, capsys, monkeypatch):
    # One d_k: the table, band, zero fractions and figure work; no law can be fitted on one point.
    monkeypatch.setattr(probes, "DEFAULT_HEAD_DIMS", (1024,))
    laws, not_fitted, _ = _run_sweep_and_check_laws(lab_script, tmp_path / "out", capsys, TINY)
    assert not_fitted == list(_FITTED_KEYS)
    assert all("needs at least 2 distinct d_k >= 256, the sweep has [1024]" in laws[k]["not_fitted"] for k in _FITTED_KEYS)


def test_lab_asks_for_the_compilation_cache_unless_told_not_to(lab_script, tmp_path, capsys, monkeypatch):
    calls = []

    def recorder(path=None, *, enabled=True):  # stands in for jaxattn.io.use_compilation_cache: no global change
        calls.append(enabled)
        return tmp_path / "cache" if enabled else None

    monkeypatch.setitem(lab_script.main.__globals__, "use_compilation_cache", recorder)
    lab_script.main(["--parts", "1", "--out", str(tmp_path / "out")])
    assert capsys.readouterr().out.splitlines()[1] == f"compiled programs: kept in {tmp_path / 'cache'} (--no-cache: not kept)"
    lab_script.main(["--parts", "1", "--out", str(tmp_path / "out"), "--no-cache"])
    assert capsys.readouterr().out.splitlines()[1] == "compiled programs: not kept"
    assert calls == [True, False]


def test_lab_environment_variable_keeps_the_cache_off(lab_script, tmp_path, capsys, monkeypatch):
    import jax

    monkeypatch.setenv("JAXATTN_NO_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    lab_script.main(["--parts", "1", "--out", str(tmp_path / "out")])
    assert capsys.readouterr().out.splitlines()[1] == "compiled programs: not kept"
    assert not (tmp_path / "xdg").exists() and jax.config.jax_compilation_cache_dir != str(tmp_path / "xdg" / "jaxattn")


def _expect_usage_error(lab_script, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        lab_script.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    return captured.err.strip().splitlines()


@pytest.mark.parametrize(
    "flag, value, bound",
    [("--trials", "0", "a positive int"), ("--trials", "-3", "a positive int"), ("--trials", "two", "a positive int"),
     ("--queries", "0", "a positive int"), ("--queries", "1.5", "a positive int"),
     ("--trials-per-batch", "0", "a positive int"), ("--trials-per-batch", "-1", "a positive int"),
     ("--keys", "1", "an int >= 2"), ("--keys", "0", "an int >= 2"), ("--keys", "", "an int >= 2"),
     ("--seed", "-1", "an int >= 0"), ("--seed", "x", "an int >= 0")],
)
def test_lab_rejects_bad_numbers_in_one_line(lab_script, tmp_path, capsys, flag, value, bound):
    out = tmp_path / "out"
    lines = _expect_usage_error(lab_script, ["--parts", "1,2", "--out", str(out), f"{flag}={value}"], capsys)
    errors = [line for line in lines if "error:" in line]
    assert errors == [lines[-1]] and f"error: argument {flag}: must be {bound}" in lines[-1]
    assert lines[-1].endswith(f"received {value!r}")
    assert lines[0].startswith("usage: ") and all(line.startswith(" ") for line in lines[1:-1])  # argparse's usage
    assert not out.exists() and _tree(tmp_path) == []


def _expect_folder_error(lab_script, argv, capsys, *, says):
    lines = _expect_usage_error(lab_script, argv, capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


@pytest.mark.parametrize(
    "layout, out, parts, says",
    [
        ({"f": "file"}, "f", "1", "exists and is not a folder"),
        ({"f": "file"}, "f/sub", "1", "is not a folder"),
        ({"f": "file"}, "f/sub/deeper", "2", "is not a folder"),
        ({"d/part1.json": "dir"}, "d", "1", "part1.json' is a folder, but part 1 writes a file there"),
        ({"d/part1.json": "dir"}, "d", "1,2", "part1.json' is a folder, but part 1 writes a file there"),
        ({"d/part2.json": "dir"}, "d", "1,2", "part2.json' is a folder, but part 2 writes a file there"),
        ({"d/part2_sweep.png/x": "file"}, "d", "2", "part2_sweep.png' is a folder, but part 2 writes a file there"),
        ({"d/trophy": "file"}, "d", "3", "trophy' exists and is not a folder, but parts 3-4 write into it"),
        ({"d/trophy/trophy.json": "dir"}, "d", "4", "trophy.json' is a folder, but parts 3-4 write a file there"),
    ],
)
def test_lab_rejects_output_folders_that_cannot_take_the_results(lab_script, tmp_path, capsys, layout, out, parts, says):
    for rel, kind in layout.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir() if kind == "dir" else p.write_text("x")
    before = _tree(tmp_path)
    _expect_folder_error(lab_script, ["--parts", parts, "--out", str(tmp_path / out)], capsys, says=says)
    assert _tree(tmp_path) == before  # nothing created, nothing removed
    if "f" in layout:
        assert (tmp_path / "f").read_text() == "x"


def test_lab_rejects_an_empty_output_folder_name(lab_script, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _expect_folder_error(lab_script, ["--parts", "1", "--out", ""], capsys, says="--out is empty")
    assert _tree(tmp_path) == []


@pytest.mark.parametrize("out", ["/proc", "/proc/jaxattn-lab-test/out"])
def test_lab_rejects_unwritable_output_folders(lab_script, capsys, out):
    _expect_folder_error(lab_script, ["--parts", "1", "--out", out], capsys, says="cannot write there")
    assert not os.path.exists("/proc/jaxattn-lab-test")


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), OSError(30, "Read-only file system")])
def test_lab_unwritable_folder_leaves_nothing_behind(lab_script, tmp_path, capsys, monkeypatch, error):
    # As root chmod does not stop writes: make the write check itself fail, after the folders were created.
    import tempfile

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    (tmp_path / "kept").mkdir()
    _expect_folder_error(lab_script, ["--parts", "1", "--out", str(tmp_path / "kept" / "new" / "out")], capsys,
                         says=f"cannot write there ({error.strerror})")
    assert _tree(tmp_path) == ["kept"]  # the folders it made are gone, the one that was there stays
