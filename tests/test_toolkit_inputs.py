"""Edge cases of the toolkit and the experiment scripts: NaN that must not vanish, empty or malformed
arguments refused by name before any work, workers that are stopped when a multi-process run times out."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import gpt2, interventions, models
from jaxattn import io as jio

ROOT = Path(__file__).resolve().parent.parent


def _tree(root):
    """Every path under ``root`` (files and folders, hidden ones included), relative."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


def _script(name):
    """``experiments/<name>`` imported as a module (its functions can then be replaced by a test)."""
    spec = importlib.util.spec_from_file_location(f"experiment_{Path(name).stem}", ROOT / "experiments" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _usage_error(capsys, call):
    """Run ``call()``, which must exit through argparse (status 2); its stderr."""
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 2
    return capsys.readouterr().err


def _softmax_maps(rng, L, N, T):
    """Causal softmax maps ``[L, N, T, T]``."""
    logits = np.where(np.tril(np.ones((T, T), bool)), 3 * rng.standard_normal((L, N, T, T)), -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------
# head_scores: a NaN among the real rows makes the head's score NaN
# ----------------------------------------------------------------------------------------------------


def test_head_scores_keeps_a_nan_at_a_real_row():
    maps = _softmax_maps(np.random.default_rng(0), 1, 3, 5)
    ids = np.array([1, 2, 3, 4, 5], np.int32)
    maps[0, 1, 3, 0] = np.nan  # row 3, key 0: not row 3's previous token (key 2)
    for kind in ("previous_token", "sink"):
        if kind == "sink":
            maps[0, 1, 3, 0], maps[0, 1, 3, 2] = 0.25, np.nan  # key 2 is not row 3's sink target (key 0)
        got = np.asarray(interventions.head_scores(maps, ids, kind))
        assert np.isnan(got[0, 1]), (kind, got)
        assert np.all(np.isfinite(got[0, [0, 2]])), (kind, got)  # the other heads keep their scores
        jitted = np.asarray(jax.jit(lambda m, i: interventions.head_scores(m, i, kind))(maps, ids))
        assert np.isnan(jitted[0, 1]) and np.all(np.isfinite(jitted[0, [0, 2]]))


def test_head_scores_keeps_a_nan_at_a_real_row_of_a_padded_batch():
    rng = np.random.default_rng(1)
    maps = np.stack([_softmax_maps(rng, 2, 2, 6) for _ in range(2)])  # [B, L, N, T, T]
    ids = np.array([[0, 0, 4, 5, 4, 5], [7, 8, 7, 8, 9, 9]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    maps[0, :, :, :2, :] = np.nan  # padded rows: never counted
    maps[0, :, :, 2:, :2] = 0.0
    clean = np.asarray(interventions.head_scores(maps, ids, "induction", attention_mask=mask))
    assert np.all(np.isfinite(clean))
    maps[1, 1, 0, 4, 1] = np.nan  # a real row and key of sequence 1, layer 1, head 0
    got = np.asarray(interventions.head_scores(maps, ids, "induction", attention_mask=mask))
    assert np.isnan(got[1, 1, 0])
    keep = np.ones(got.shape, bool)
    keep[1, 1, 0] = False
    np.testing.assert_array_equal(got[keep], clean[keep])


def test_head_scores_ignores_a_nan_at_a_padded_key_of_a_real_row():
    maps = _softmax_maps(np.random.default_rng(2), 1, 2, 4)
    mask = np.array([0, 1, 1, 1])
    maps[..., 1:, 0] = np.nan  # the padded key's column in the real rows
    got = np.asarray(interventions.head_scores(maps, np.arange(4, dtype=np.int32), "previous_token", attention_mask=mask))
    assert np.all(np.isfinite(got))


# ----------------------------------------------------------------------------------------------------
# experiments/heads.py's benchmark: NaN differences reported, no tables refused; the loop of forwards
# ----------------------------------------------------------------------------------------------------


def test_benchmark_tables_reports_a_nan_table_as_a_nan_difference():
    bench = _script("heads.py").benchmark_tables
    nan_table = lambda way: jnp.array([1.0, jnp.nan])  # noqa: E731
    ones = lambda way: jnp.ones(2)  # noqa: E731
    for tables in ({"ones": ones, "nan": nan_table}, {"nan": nan_table, "ones": ones}):  # either order
        r = bench(tables, repeats=1)
        assert all(np.isnan(v) for v in r["max_difference"].values()), r["max_difference"]
        assert all(np.isnan(v) for v in r["max_relative_difference"].values()), r["max_relative_difference"]
    # NaN in one way only: that way's difference is NaN
    only_loop = {"ones": ones, "t": lambda way: jnp.array([1.0, jnp.nan]) if way == "loop" else jnp.ones(2)}
    r = bench(only_loop, repeats=1)
    assert np.isnan(r["max_difference"]["loop"]) and np.isnan(r["max_relative_difference"]["loop"])
    # finite tables keep their numbers
    r = bench({"a": ones, "b": lambda way: jnp.full(2, 2.0) + (way == "loop")}, repeats=1)
    assert r["max_difference"] == {"fast": 0.0, "loop": 1.0}
    assert r["max_relative_difference"]["loop"] == pytest.approx(0.5)


@pytest.mark.parametrize("tables", [{}, [], None])
def test_benchmark_tables_refuses_no_tables_by_name(tables):
    with pytest.raises(ValueError, match=r"^tables must be a non-empty mapping \{name: run\}, received "):
        _script("heads.py").benchmark_tables(tables, repeats=1)


@pytest.mark.slow
def test_the_benchmarks_loop_of_forwards_gives_the_library_tables():
    """The baseline ``heads.py --parts bench`` times (a Python loop of jitted whole forwards, written with the
    public API) computes the tables the library computes in one program: a head ablation, a head patch and
    a position patch, on a tiny GPT-2."""
    loop_of_forwards = _script("heads.py").loop_of_forwards
    config = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    params = jax.tree.map(lambda w: w * 50 if w.ndim >= 2 else w, gpt2.init_params(0, config))  # effects to see
    ids, other = np.arange(3, 9)[None] % 40, np.arange(10, 16)[None] % 40
    bound = interventions.bind(gpt2, params, config, ids[0])
    source = interventions.bind(gpt2, params, config, other[0])
    metric = lambda out: out.logits[-1, 5] - out.logits[-1, 7]  # noqa: E731
    captured = source(capture=("z", "resid_pre")).captured
    cases = [(None, None, interventions.ablation_effects(bound, metric)),
             ("z", captured["z"], interventions.patching_effects(bound, metric, captured["z"])),
             ("resid_pre", captured["resid_pre"],
              interventions.patching_effects(bound, metric, captured["resid_pre"], name="resid_pre"))]
    for name, value, table in cases:
        looped = np.asarray(loop_of_forwards(bound, metric, name=name, value=value)())
        assert looped.shape == table.shape and np.abs(looped).max() > 1e-4, name
        np.testing.assert_allclose(looped, np.asarray(table), rtol=0, atol=1e-5 * np.abs(looped).max())


# ----------------------------------------------------------------------------------------------------
# pad_to_bucket: buckets and an empty input checked
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("buckets", ["ab", "16", (), (16, 8), (8, 8), (0, 16), (-4, 16), (4.0, 16), (True, 16), 16, None])
def test_pad_to_bucket_refuses_buckets_that_are_not_increasing_positive_ints(buckets):
    with pytest.raises(ValueError, match=r"^buckets must be a non-empty sequence of increasing positive ints, "
                                         r"received ") as e:
        models.pad_to_bucket(np.arange(3), buckets=buckets)
    assert repr(buckets) in str(e.value)


def test_pad_to_bucket_refuses_an_empty_input_ids():
    for empty in (np.array([], int), []):
        with pytest.raises(ValueError, match=r"^input_ids must hold at least one token id, received an empty sequence"):
            models.pad_to_bucket(empty)


def test_pad_to_bucket_takes_increasing_buckets_of_any_int_kind():
    ids, mask = models.pad_to_bucket(np.arange(5), buckets=np.array([4, 8]))
    assert ids.shape == (8,) and mask.tolist() == [True] * 5 + [False] * 3
    assert models.pad_to_bucket([3], buckets=[1])[0].tolist() == [3]
    with pytest.raises(ValueError, match=r"^pad_id must be an int token id, received 0\.5"):
        models.pad_to_bucket([3], pad_id=0.5)


# ----------------------------------------------------------------------------------------------------
# prepare_output_folder: a null byte refused by name before anything is made
# ----------------------------------------------------------------------------------------------------


def test_prepare_output_folder_refuses_a_null_byte_by_name_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for out in ("a\x00b", str(tmp_path / "new" / "a\x00b"), b"x\x00y"):
        with pytest.raises(jio.OutputFolderError, match=r"^--out '.*' is not a usable path: it holds a null byte \(\\x00\)$"):
            jio.prepare_output_folder(out, ["x.json"])
    with pytest.raises(jio.OutputFolderError, match=r"^--json 'a\\x00b' is not a usable path: it holds a null byte"):
        jio.prepare_output_folder("a\x00b", argument="--json")
    with pytest.raises(ValueError, match=r"^targets: 'x\\x00\.json' holds a null byte"):
        jio.prepare_output_folder(tmp_path / "out", ["x\x00.json"])
    assert _tree(tmp_path) == []


# ----------------------------------------------------------------------------------------------------
# Experiment scripts: arguments checked before any model loads, one usage line, exit 2
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--chunk", "0"], "argument --chunk: must be a positive int, received '0'"),
    (["--chunk", "x"], "argument --chunk: must be a positive int, received 'x'"),
    (["--repeats", "0"], "argument --repeats: must be a positive int, received '0'"),
    (["--top", "-1"], "argument --top: must be a positive int, received '-1'"),
    (["--reference", "-1"], "argument --reference: must be an int >= 0, received '-1'"),
    (["--parts", "bench", "--ways", "fast,slow"], "--ways takes a comma-separated list of distinct ways of fast, map, "
                                                  "loop, received 'fast,slow'"),
])
def test_heads_script_refuses_bad_arguments_before_loading_a_model(tmp_path, monkeypatch, capsys, argv, says):
    heads = _script("heads.py")

    def no_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(heads, "load", no_load)
    monkeypatch.chdir(tmp_path)
    err = _usage_error(capsys, lambda: heads.main(["--random-gpt2", "tiny", *argv, "--out", str(tmp_path / "out")]))
    assert says in err and "Traceback" not in err, err
    assert _tree(tmp_path) == []


@pytest.mark.parametrize("mesh", ["abc", "2", "2x", "x2", "0x2", "2x-1", "2x3x1", "2X3", "²x1"])
def test_bench_mesh_refuses_a_mesh_not_of_the_form_data_x_model(capsys, mesh):
    bench = _script("bench_mesh.py")
    err = _usage_error(capsys, lambda: bench.main(["--model", "tiny", "--mesh", mesh]))
    assert f"argument --mesh: must be DATAxMODEL, two positive ints such as 2x3, received {mesh!r}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, says", [
    (["--batch", "0"], "argument --batch: must be a positive int, received '0'"),
    (["--repeats", "2"], "argument --repeats: must be an int >= 3, received '2'"),
    (["--table-T", "1"], "argument --table-T: must be an int >= 2, received '1'"),
    (["--T", "8", "--table-T", "16"], "--table-T 16 must be at most --T 8"),
])
def test_bench_mesh_refuses_bad_sizes_before_loading_a_model(capsys, monkeypatch, argv, says):
    bench = _script("bench_mesh.py")
    monkeypatch.setattr(bench, "_model", lambda *a: (_ for _ in ()).throw(AssertionError("the model was loaded")))
    err = _usage_error(capsys, lambda: bench.main(["--model", "tiny", *argv]))
    assert says in err, err


def test_bench_mesh_refuses_a_mesh_larger_than_the_devices_before_loading_a_model():
    """The command line on 2 host devices: a 2 x 2 mesh needs 4, refused before the model is made."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_mesh.py"), "--model", "tiny",
                           "--mesh", "2x2"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--mesh 2x2 needs 4 devices, and there are 2" in proc.stderr
    assert "model tiny" not in proc.stdout  # the model was never made


@pytest.mark.parametrize("mesh", ["bogus", "2x", "0x1", "1x2x3"])
def test_load_memory_refuses_a_mesh_not_of_the_form_data_x_model(capsys, monkeypatch, mesh):
    load_memory = _script("load_memory.py")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a load was started")))
    err = _usage_error(capsys, lambda: load_memory.main(["--mesh", mesh]))
    assert f"argument --mesh: must be DATAxMODEL, two positive ints such as 2x3, received {mesh!r}" in err, err


def test_load_memory_refuses_a_missing_path_before_starting_a_load(capsys, monkeypatch):
    load_memory = _script("load_memory.py")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a load was started")))
    err = _usage_error(capsys, lambda: load_memory.main(["--path", "/no/such/model.gguf"]))
    assert "argument --path" not in err and "--path '/no/such/model.gguf': no such file or folder" in err, err


def test_load_memory_script_refuses_a_bad_mesh_on_the_command_line():
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "load_memory.py"), "--mesh", "bogus"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "argument --mesh: must be DATAxMODEL" in proc.stderr


# ----------------------------------------------------------------------------------------------------
# multihost.py: sizes checked before any worker starts; workers stopped on a timeout or a failure
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--processes", "0"], "argument --processes: must be an int >= 2, received '0'"),
    (["--processes", "1"], "argument --processes: must be an int >= 2, received '1'"),
    (["--devices-per-process", "0"], "argument --devices-per-process: must be a positive int, received '0'"),
    (["--timeout", "0"], "argument --timeout: must be a number of seconds > 0, received '0'"),
    (["--timeout", "nan"], "argument --timeout: must be a number of seconds > 0, received 'nan'"),
    (["--mesh", "abc"], "argument --mesh: must be DATAxMODEL, two positive ints such as 2x3, received 'abc'"),
    (["--mesh", "2x2"], "--mesh 2x2 must cover every device: --processes 2 x --devices-per-process 3 = 6, and 2 x 2 = 4"),
    (["--mesh", "1x6"], "the data axis of --mesh 1x6 (1) must be a multiple of --processes (2)"),
    (["--mesh", "3x2", "--processes", "3", "--devices-per-process", "2"],
     "the data axis of --mesh 3x2 (3) must be a multiple of --processes (3), each process feeding its own rows, "
     "and divide the batch of 4 sequences"),
])
def test_multihost_refuses_bad_sizes_before_starting_a_worker(capsys, monkeypatch, argv, says):
    multihost = _script("multihost.py")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a worker started")))
    err = _usage_error(capsys, lambda: multihost.main(["--model", "tiny", *argv]))
    assert says in err and "Traceback" not in err, err


def _alive(pid):
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _fake_workers(tmp_path, fail_first=False):
    """A ``worker_command`` whose workers each start a child, write both pids, and sleep (worker 0 exits 3
    at once with ``fail_first``)."""
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}')\n"
            "if sys.argv[2] == 'fail': sys.exit(3)\n"
            "time.sleep(120)\n")

    def command(args, process_id, port):
        mode = "fail" if fail_first and process_id == 0 else "sleep"
        return [sys.executable, "-c", code, str(tmp_path / f"pids{process_id}"), mode]

    return command


def _pids(tmp_path, n, wait=30):
    t = time.monotonic() + wait
    while time.monotonic() < t and not all((tmp_path / f"pids{i}").is_file() for i in range(n)):
        time.sleep(0.05)
    return [int(p) for i in range(n) if (tmp_path / f"pids{i}").is_file()
            for p in (tmp_path / f"pids{i}").read_text().split()]


def test_multihost_timeout_stops_every_worker_and_what_it_started(tmp_path, capsys, monkeypatch):
    multihost = _script("multihost.py")
    monkeypatch.setattr(multihost, "worker_command", _fake_workers(tmp_path))
    status = multihost.main(["--model", "tiny", "--processes", "2", "--devices-per-process", "2", "--mesh", "2x2",
                             "--timeout", "3"])
    pids = _pids(tmp_path, 2, wait=0)
    err = capsys.readouterr().err
    assert status == 1
    assert err.strip() == "error: the workers did not finish within --timeout 3 s; stopped processes 0, 1 and all they started"
    assert len(pids) == 4, "the fake workers did not start in time"
    deadline = time.monotonic() + 10  # a killed grandchild is reaped by whoever adopted it
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def test_multihost_failed_worker_stops_the_others_at_once(tmp_path, capsys, monkeypatch):
    multihost = _script("multihost.py")
    monkeypatch.setattr(multihost, "worker_command", _fake_workers(tmp_path, fail_first=True))
    status = multihost.main(["--model", "tiny", "--processes", "2", "--devices-per-process", "2", "--mesh", "2x2",
                             "--timeout", "100"])
    err = capsys.readouterr().err
    # stopped by the failure, not by the timeout (which would say so)
    assert status == 1 and "process 0 failed (3)" in err and "did not finish within" not in err, err
    pids = _pids(tmp_path, 2, wait=0)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids[2:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids[2:])  # worker 1 and its child


def _marked(marker):
    """Pids of running processes whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes() and _alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_multihost_script_timeout_exits_1_with_a_message_and_leaves_no_worker():
    """The command line, end to end: real workers, still starting when the time runs out."""
    marker = f"JAXATTN_TEST_MARK=multihost-{uuid.uuid4()}"
    name, value = marker.split("=")
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "multihost.py"), "--model", "tiny",
                           "--processes", "2", "--devices-per-process", "2", "--mesh", "2x2", "--timeout", "1"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, **{name: value}))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the workers did not finish within --timeout 1 s" in proc.stderr
    deadline = time.monotonic() + 10
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marked(marker)
    for pid in left:  # do not leave them running if the check fails
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_heads_script_checks_repeat_before_any_part_and_removes_an_earlier_runs_file_it_does_not_write(tmp_path, capsys):
    """A --repeat the model cannot take is refused, naming it, before the effects run (nothing written); a
    model without a language-model head removes an earlier run's lens.json instead of leaving it beside
    its own results; a model without a window counts a distance its input can hold by default."""
    heads = _script("heads.py")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^error: --repeat 100: the scores' input of 200 tokens \(twice --repeat\) is "
                                         r"longer than the 128 the model takes$"):
        heads.main(["--random-gpt2", "tiny", "--parts", "effects,scores", "--repeat", "100", "--out", str(out)])
    assert _tree(tmp_path) == []
    out.mkdir()
    (out / "lens.json").write_text('{"model": "another"}')
    assert heads.main(["--model", "minilm", "--parts", "lens", "--out", str(out)]) == 0
    assert "removed" in capsys.readouterr().out and _tree(out) == []
    assert heads.main(["--random-gpt2", "tiny", "--parts", "window", "--out", str(out)]) == 0
    record = json.loads((out / "window.json").read_text())
    assert (record["length"], record["distance"]) == (128, 64)


@pytest.mark.parametrize("script, argv, says", [
    ("conformance.py", ["--seed", "-1"], "argument --seed: must be an int >= 0, received '-1'"),
    ("conformance.py", ["--implementations"], "argument --implementations: expected at least one argument"),
    ("bench_attention.py", ["--gpt2-T", "-5"], "argument --gpt2-T: must be a positive int, received '-5'"),
    ("bench_attention.py", ["--memory-fraction", "2"], "argument --memory-fraction: must be a number in (0, 1], "
                                                        "received '2'"),
    ("bench_llama.py", ["--T", "-1"], "argument --T: must be a positive int, received '-1'"),
    ("bench_llama.py", ["--baseline", "/nonexistent", "--gradient"],
     "--baseline /nonexistent: expected a checkout with jaxattn/__init__.py in it"),
])
def test_benchmark_and_conformance_scripts_refuse_bad_sizes_by_name(tmp_path, capsys, monkeypatch, script, argv, says):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *argv, "--out", str(tmp_path / "out")])
    module = _script(script)
    err = _usage_error(capsys, lambda: module.main(sys.argv[1:]) if script == "bench_llama.py" else module.main())
    assert says in err and "Traceback" not in err, err
    assert _tree(tmp_path) == []
