"""The remedies in training (jaxattn.train with remedies=), the Tiny Shakespeare task and its converter, and
experiments/train_scale.py's --remedies and --task (tiny sizes; training compiles are marked slow)."""

import gzip
import hashlib
import importlib.util
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxattn import train
from jaxattn.probes import Remedy

ROOT = Path(__file__).resolve().parents[1]
TASK = train.RecallTask(num_pairs=3, num_queries=2, n_keys=4, n_values=4)
CONFIG = train.ModelConfig.for_task(TASK, d_model=16, num_heads=2, head_dim=8, num_layers=1)
OPT = train.OptConfig(total_steps=4, warmup_steps=1, batch_size=4)
T, N, H = TASK.length, CONFIG.num_heads, CONFIG.head_dim


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------
# Each remedy's logits against a float64 NumPy reference (layer 0, one sequence, at initialisation).
# ----------------------------------------------------------------------------------------------------


def _reference_logits(params, tokens, remedy: Remedy) -> np.ndarray:
    """``[N, T, T]`` layer-0 attention logits of the decoder under ``remedy``, in float64 NumPy."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f(params["wte"])[tokens] + f(params["wpe"])[: len(tokens)]  # [T, D]
    b = params["blocks"][0]
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * f(b["ln_1"]["scale"]) + f(b["ln_1"]["bias"])  # [T, D]
    w_q, w_k = f(b["attn"]["W_Q"]), f(b["attn"]["W_K"])
    if remedy.sigma_reparam:  # γ = 1 at initialisation; σ exact (LAPACK's SVD)
        w_q, w_k = w_q / np.linalg.norm(w_q, 2), w_k / np.linalg.norm(w_k, 2)
    q = (h @ w_q + f(b["attn"]["b_Q"])).reshape(len(tokens), N, H)  # [T, N, H]
    k = (h @ w_k + f(b["attn"]["b_K"])).reshape(len(tokens), N, H)
    if remedy.qk_norm:
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + 1e-6)
    scale = (1 / math.sqrt(H) if remedy.sqrt_dk else 1.0) / remedy.temperature
    z = scale * np.einsum("tnh,snh->nts", q, k)  # [N, T, T]
    if remedy.logit_cap is not None:
        z = remedy.logit_cap * np.tanh(z / remedy.logit_cap)
    return z


@pytest.mark.parametrize(
    "spec", ["none", "sqrt_dk", "qk_norm", "qk_norm_sqrt_dk", ("cap", 2.0), ("temperature", 4.0), "sigma_reparam",
             "sigma_reparam_sqrt_dk"],
)
def test_remedy_logits_match_a_float64_reference(spec):
    remedy = Remedy.parse(spec)
    s = train.remedy_settings(spec, H)
    config = train.ModelConfig.for_task(TASK, d_model=16, num_heads=N, head_dim=H, num_layers=1,
                                        qk_norm=s["qk_norm"], sigma_reparam=s["sigma_reparam"])
    params = train.init_params(3, config)
    if remedy.sigma_reparam:
        assert float(params["blocks"][0]["sigma_reparam"]["gamma_Q"]) == 1.0
    tokens = np.asarray([5, 1, 17, 3, 9, 22, 0], np.int32)[:T]
    _, captured = train.forward(params, tokens, config=config, scale=s["scale"], logit_cap=s["logit_cap"])
    got = np.asarray(captured["attn_logits"][0], np.float64)
    want = _reference_logits(params, tokens, remedy)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    if remedy.logit_cap is not None:
        assert np.abs(got).max() < remedy.logit_cap


@pytest.mark.parametrize("shape", [(64, 128), (96, 8)])
def test_spectral_norm_matches_lapack(shape):
    w = np.random.default_rng(sum(shape)).normal(0, 1 / math.sqrt(shape[0]), shape).astype(np.float32)
    sigma = float(train.spectral_norm(w))
    exact = np.linalg.norm(w.astype(np.float64), 2)
    assert sigma <= exact * (1 + 1e-5)  # the norm on a subspace: never above σ, up to rounding
    np.testing.assert_allclose(sigma, exact, rtol=1e-5)
    # Its gradient is u vᵀ (the top singular vectors), the exact gradient of σ.
    u, _, vt = np.linalg.svd(w.astype(np.float64))
    g = np.asarray(jax.grad(train.spectral_norm)(w), np.float64)
    np.testing.assert_allclose(np.abs(g), np.abs(np.outer(u[:, 0], vt[0])), atol=2e-3)


def test_remedy_settings_use_the_probes_names_and_meanings():
    assert train.remedy_settings("none", 64)["scale"] == 1.0
    assert train.remedy_settings("sqrt_dk", 64)["scale"] == 0.125
    assert train.remedy_settings(("temperature", 8.0), 64) == {
        "name": "temperature_8", "scale": 0.125, "logit_cap": None, "qk_norm": False, "sigma_reparam": False}
    assert train.remedy_settings(("cap", 5), 64)["logit_cap"] == 5.0
    assert train.remedy_settings(("cap", 5), 64)["scale"] == 1.0  # the cap acts on the unscaled q·k
    s = train.remedy_settings(Remedy("mine", sqrt_dk=True, qk_norm=True), 16)
    assert (s["name"], s["scale"], s["qk_norm"]) == ("mine", 0.25, True)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"remedies": ["none", "sqrt"]}, ValueError, r"remedies\[1\].*'sqrt'"),
        ({"remedies": ["none", ("cap", -1.0)]}, ValueError, r"remedies\[1\]"),
        ({"remedies": "none"}, TypeError, "remedies must be a list"),
        ({"remedies": ["none", "none"], "scales": [None, None]}, ValueError, "exactly one of scales= and remedies="),
        ({}, ValueError, "exactly one of scales= and remedies="),
        ({"remedies": ["none"]}, ValueError, "same non-zero length"),
    ],
)
def test_train_refuses_bad_remedies_before_compiling(kwargs, error, match):
    with pytest.raises(error, match=match):
        train.train(CONFIG, TASK, OPT, seeds=[0, 1], learning_rates=[1e-3, 1e-3], **kwargs)


def test_qk_norm_and_qk_layernorm_are_exclusive():
    with pytest.raises(ValueError, match="qk_layernorm and qk_norm"):
        train.ModelConfig(qk_layernorm=True, qk_norm=True)
    config = train.ModelConfig.for_task(TASK, d_model=16, head_dim=8, qk_layernorm=True)
    with pytest.raises(ValueError, match="qk_norm_sqrt_dk.*qk_layernorm"):
        train.train(config, TASK, OPT, seeds=[0], learning_rates=[1e-3], remedies=["qk_norm_sqrt_dk"])


# ----------------------------------------------------------------------------------------------------
# The text task and its shipped file.
# ----------------------------------------------------------------------------------------------------


def test_shipped_text_is_the_converters_output_and_splits_ninety_ten():
    tool = _load(ROOT / "tools" / "convert_tinyshakespeare.py", "convert_tinyshakespeare_under_test")
    data = train.TEXT_FILE.read_bytes()
    assert len(data) == tool.SHIPPED_BYTES == train.TEXT_BYTES
    assert hashlib.sha256(data).hexdigest() == tool.SHIPPED_SHA256 == train.TEXT_SHA256
    text = gzip.decompress(data).decode("utf-8")
    assert text.startswith("First Citizen:\nBefore we proceed any further") and text.endswith("\n")
    loaded = train.load_text()
    assert loaded["vocab"] == "".join(sorted(set(text))) and len(loaded["vocab"]) == 64
    assert len(loaded["train"]) == int(len(text) * tool.TRAIN_FRACTION) == int(len(text) * train.TEXT_TRAIN_FRACTION)
    assert len(loaded["train"]) + len(loaded["validation"]) == len(text)
    decoded = "".join(loaded["vocab"][i] for i in loaded["validation"][:200])
    assert decoded == text[len(loaded["train"]):][:200]


def test_a_damaged_or_other_text_file_is_refused_by_name(tmp_path, monkeypatch):
    data = train.TEXT_FILE.read_bytes()
    other = gzip.compress(b"To be, or not to be.\n" * 1000)
    for name, content in (("truncated", data[:100_000]), ("another text", other)):
        (tmp_path / name).write_bytes(content)
        monkeypatch.setattr(train, "TEXT_FILE", tmp_path / name)
        train.load_text.cache_clear()
        with pytest.raises(ValueError, match=r"expected the shipped Tiny Shakespeare slice \(233318 bytes, sha256 "
                                             r"ed33f9ad.*reinstall jaxattn"):
            train.load_text()
    train.load_text.cache_clear()  # the shipped file again for later tests


def test_converter_keeps_whole_lines_and_writes_the_same_bytes(tmp_path):
    tool = _load(ROOT / "tools" / "convert_tinyshakespeare.py", "convert_tinyshakespeare_under_test")
    source = "".join(f"LINE {i}: to be, or not to be.\n" for i in range(100))
    (tmp_path / "input.txt").write_text(source, encoding="utf-8")
    outs = []
    for name in ("a.gz", "b.gz"):
        rc = tool.main([str(tmp_path / "input.txt"), str(tmp_path / name), "--keep-chars", "100"])
        assert rc == 0
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]  # deterministic: no time stamp, no file name
    kept = gzip.decompress(outs[0]).decode("utf-8")
    assert kept == source[: source.rfind("\n", 0, 100) + 1] and kept.endswith("\n") and len(kept) <= 100
    assert tool.convert_text(source, 10 ** 6) == source  # shorter than the limit: all of it
    assert tool.main([str(tmp_path / "missing.txt"), str(tmp_path / "c.gz")]) == 2
    assert not (tmp_path / "c.gz").exists()


def test_text_batches_come_from_the_shipped_text_and_are_deterministic_per_key():
    task = train.TextTask(context=16, val_sequences=4)
    data = train.load_text()
    vocab, source = data["vocab"], "".join(data["vocab"][i] for i in data["train"])
    a, b, c = (jax.device_get(train.text_batch(k, task, 4)) for k in (5, 5, 6))
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], c["tokens"])
    assert a["tokens"].shape == a["targets"].shape == a["loss_mask"].shape == (4, 16) and a["loss_mask"].all()
    for tokens, targets in zip(a["tokens"], a["targets"]):
        np.testing.assert_array_equal(tokens[1:], targets[:-1])
        assert "".join(vocab[i] for i in [*tokens, targets[-1]]) in source  # a window of the training slice
    val = jax.device_get(train.text_validation_batch(task))
    np.testing.assert_array_equal(val["tokens"][1], data["validation"][17:33])
    assert task.n_vocab == 64 and task.chance_loss == pytest.approx(math.log(64))
    with pytest.raises(ValueError, match="val_sequences"):
        train.TextTask(context=64, val_sequences=10 ** 6)


# ----------------------------------------------------------------------------------------------------
# experiments/train_scale.py
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def script():
    return _load(ROOT / "experiments" / "train_scale.py", "experiment_train_scale_under_test")


@pytest.mark.parametrize("word", ["sqrt", "cap_x", "temperature_-1", "cap"])
def test_script_refuses_bad_remedies_before_training(script, tmp_path, capsys, word):
    with pytest.raises(SystemExit) as e:
        script.main(["--quick", "--remedies", "none", word, "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --remedies" in err and repr(word) in err
    assert not (tmp_path / "out").exists()  # refused before the output folder or any training


def test_script_parses_remedy_words(script):
    args = script.parse_args(["--remedies", "none", "cap_5", "temperature_2", "--task", "text"])
    assert args.remedies == ["none", ("cap", 5.0), ("temperature", 2.0)]
    assert args.head_dims == [64] and args.threshold == 2.5 and args.seeds == [0, 1, 2]
    assert len(script.parse_args(["--remedies", "all"]).remedies) == 11
    default = script.parse_args([])
    assert default.remedies == ["sqrt_dk", "none"] and default.head_dims == [16, 64, 256]


# ----------------------------------------------------------------------------------------------------
# Training compiles (make test-slow).
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_remedies_in_one_call_equal_separate_runs():
    """One call with none, cap_2 and temperature_2 (none and the temperature one vmapped program, the cap
    another): each run equals the same remedy trained alone, and the results come back in the caller's order."""
    remedies, seeds = ["none", ("cap", 2.0), ("temperature", 2.0)], [0, 0, 1]
    together = train.train(CONFIG, TASK, OPT, seeds=seeds, learning_rates=[1e-2] * 3, remedies=remedies, chunk=2)
    assert list(together["remedy"]) == ["none", "cap_2", "temperature_2"]
    np.testing.assert_allclose(together["scale"], [1.0, 1.0, 0.5])
    np.testing.assert_array_equal(np.isnan(together["logit_cap"]), [True, False, True])
    for c, (spec, seed) in enumerate(zip(remedies, seeds)):
        alone = train.train(CONFIG, TASK, OPT, seeds=[seed], learning_rates=[1e-2], remedies=[spec], chunk=2)
        for name in ("loss", "entropy", "max_logit", "logit_grad", "max_weight"):
            # A vmap of 2 runs and one of 1 round differently in the last bits; Adam then moves them apart a
            # little (3.6e-4 relative in max_logit by step 3 at lr 1e-2), far less than the remedies differ.
            np.testing.assert_allclose(together[name][c], alone[name][0], rtol=5e-3, atol=1e-5, err_msg=f"{spec} {name}")
    assert not np.allclose(together["max_logit"][0], together["max_logit"][1])  # the remedies did differ
    assert np.all(together["max_logit"][1] < 2.0)  # the cap bounds what the softmax sees


@pytest.mark.slow
@pytest.mark.parametrize("task", ["recall", "text"])
def test_quick_script_writes_its_files(script, tmp_path, task):
    out = tmp_path / "out"
    assert script.main(["--quick", "--task", task, "--no-cache", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(script.outputs(task))
    summary = (out / "summary.md").read_text()
    assert "| 8 | sqrt_dk | 0.003 |" in summary and "| 8 | none | 0.003 |" in summary
