"""Saturation per layer and head (``probes.head_saturation``, ``probes.layer_keep_masks``) against a float64
NumPy reference, its errors, the masks against a tiny windowed model's own weights, and
experiments/trained_heads.py end to end on that tiny model."""

import json
import runpy
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxattn import gpt2, interventions, llama, probes
from llama_checkpoints import random_params

ROOT = Path(__file__).resolve().parent.parent
THRESHOLD = 0.99


# ----------------------------------------------------------------------------------------------------
# The float64 NumPy reference.
# ----------------------------------------------------------------------------------------------------


def ref_masks(attention_mask, causal, windows):
    """``[B, L, 1, T, T]`` by loops: real query and key, s <= t, position distance < window."""
    a = np.asarray(attention_mask, bool)
    B, T = a.shape
    L = len(windows)
    out = np.zeros((B, L, 1, T, T), bool)
    for b in range(B):
        pos = {t: int(a[b, :t].sum()) for t in range(T)}  # index among the real tokens
        for l, w in enumerate(windows):
            for t in range(T):
                for s in range(T):
                    out[b, l, 0, t, s] = (a[b, t] and a[b, s] and (not causal or s <= t)
                                          and (w is None or pos[t] - pos[s] < w))
    return out


def ref_saturation(logits, keep, threshold, quantiles):
    """Per (layer, head): every counted row (>= 2 kept keys) in float64, then the reductions."""
    x = np.asarray(logits, np.float64)
    keep = np.broadcast_to(keep, x.shape)
    B, L, N, T, S = x.shape
    out = {k: np.full((L, N), np.nan) for k in ("spread_median", "entropy_mean", "jacobian_median",
                                                  "max_weight_median", "saturated_fraction", "zero_jacobian_fraction")}
    out["rows"], out["single_key_rows"] = np.zeros((L, N)), np.zeros((L, N))
    out["spread_quantiles"] = np.full((len(quantiles), L, N), np.nan)
    tops = []  # every counted row's max weight
    for l in range(L):
        for n in range(N):
            spread, h, jac, top = [], [], [], []
            for b in range(B):
                for t in range(T):
                    k = keep[b, l, n, t]
                    if k.sum() == 1:
                        out["single_key_rows"][l, n] += 1
                    if k.sum() < 2:
                        continue
                    z = x[b, l, n, t][k]
                    p = np.exp(z - z.max())
                    p /= p.sum()
                    srt = np.sort(z)
                    spread.append(srt[-1] - srt[-2])
                    h.append(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)))
                    jac.append(np.linalg.norm(np.diag(p) - np.outer(p, p)))
                    top.append(p.max())
            out["rows"][l, n] = len(spread)
            tops += top
            if not spread:
                continue
            out["spread_median"][l, n] = np.median(spread)
            out["spread_quantiles"][:, l, n] = np.quantile(spread, quantiles)
            out["entropy_mean"][l, n] = np.mean(h)
            out["jacobian_median"][l, n] = np.median(jac)
            out["max_weight_median"][l, n] = np.median(top)
            out["saturated_fraction"][l, n] = np.mean(np.asarray(top) >= threshold)
            out["zero_jacobian_fraction"][l, n] = np.mean(np.asarray(jac) == 0)
    return out, np.asarray(tops)


# Right padding, left padding and none; causal; a full layer and windows of 1 and 3 (a window of 1 leaves
# every row one key: excluded); the heads' logits scaled from nearly uniform to saturated.
MASK = np.array([[1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
WINDOWS = (None, 1, 3)
SCALES = np.array([0.3, 3.0, 30.0])  # per head


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    B, T = MASK.shape
    logits = (rng.standard_normal((B, len(WINDOWS), len(SCALES), T, T)) * SCALES[:, None, None]).astype(np.float32)
    keep = np.asarray(probes.layer_keep_masks(MASK, causal=True, windows=WINDOWS))
    return logits, keep


def test_layer_keep_masks_match_the_loops(case):
    _, keep = case
    assert keep.shape == (3, 3, 1, 7, 7) and keep.dtype == np.bool_
    np.testing.assert_array_equal(keep, ref_masks(MASK, True, WINDOWS))
    # no windows: one mask for every layer; an encoder: no causality
    np.testing.assert_array_equal(np.asarray(probes.layer_keep_masks(MASK, causal=True)), ref_masks(MASK, True, [None]))
    np.testing.assert_array_equal(np.asarray(probes.layer_keep_masks(MASK[0], causal=False, windows=[2])),
                                  ref_masks(MASK[:1], False, [2])[0])


def test_head_saturation_matches_the_float64_reference(case):
    logits, keep = case
    levels = (0.1, 0.5, 0.9)
    got = {k: np.asarray(v) for k, v in probes.head_saturation(logits, keep, threshold=THRESHOLD, quantiles=levels).items()}
    want, _ = ref_saturation(logits, keep, THRESHOLD, levels)
    assert set(got) == set(want)
    # rows: the real rows with >= 2 kept keys; padded rows (3 of 21) never count, single-key rows are excluded
    np.testing.assert_array_equal(got["rows"][0], [15, 15, 15])  # full causal layer: 18 real rows, 3 first tokens
    np.testing.assert_array_equal(got["single_key_rows"][0], [3, 3, 3])
    np.testing.assert_array_equal(got["rows"][1], [0, 0, 0])  # window 1: every row keeps one key
    np.testing.assert_array_equal(got["single_key_rows"][1], [18, 18, 18])
    assert np.isnan(got["saturated_fraction"][1]).all() and np.isnan(got["spread_median"][1]).all()
    np.testing.assert_array_equal(got["rows"], want["rows"])
    np.testing.assert_array_equal(got["single_key_rows"], want["single_key_rows"])
    for name in ("spread_median", "spread_quantiles", "entropy_mean", "max_weight_median"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, equal_nan=True, err_msg=name)
    np.testing.assert_allclose(got["jacobian_median"], want["jacobian_median"], rtol=1e-4, atol=1e-12, equal_nan=True)
    for name in ("saturated_fraction", "zero_jacobian_fraction"):  # one row is 1/15: within 1e-6 is the same count
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, equal_nan=True, err_msg=name)
    # the heads span the range: nearly uniform rows unsaturated, the scale-30 head mostly saturated
    assert got["saturated_fraction"][0, 0] == 0 and got["saturated_fraction"][0, 2] > 0.5


def test_no_row_of_the_reference_sits_at_the_threshold(case):
    """The saturated fractions are compared exactly: no max weight may be within float32 error of 0.99."""
    logits, keep = case
    _, top = ref_saturation(logits, keep, THRESHOLD, (0.5,))
    assert top.size == 2 * 3 * 15 and np.min(np.abs(top - THRESHOLD)) > 1e-4


def test_one_sentence_without_a_batch_axis_equals_a_batch_of_one(case):
    logits, keep = case
    one = probes.head_saturation(logits[2], keep[2])
    batch = probes.head_saturation(logits[2:], keep[2:])
    for name in one:
        np.testing.assert_array_equal(np.asarray(one[name]), np.asarray(batch[name]), err_msg=name)


def test_one_hot_rows_have_zero_entropy_and_an_exactly_zero_jacobian_not_nan():
    x = np.zeros((1, 1, 2, 3), np.float32)
    x[..., 0] = 200.0  # two rows, each one key far ahead: weights exactly one-hot in float32
    got = probes.head_saturation(x, np.ones((2, 3), bool))
    assert float(got["saturated_fraction"][0, 0]) == 1.0 and float(got["spread_median"][0, 0]) == 200.0
    assert float(got["entropy_mean"][0, 0]) == 0.0 and float(got["zero_jacobian_fraction"][0, 0]) == 1.0


@pytest.mark.parametrize("call, error, says", [
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.int32), np.ones((2, 2), bool)), TypeError, "logits"),
    (lambda: probes.head_saturation(np.zeros((1, 2, 2), np.float32), np.ones((2, 2), bool)), ValueError,
     r"logits must be \[L, N, T, S\] or \[B, L, N, T, S\], received shape \(1, 2, 2\)"),
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.float32), None), TypeError, "mask must be a boolean"),
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.float32), np.ones((2, 2))), TypeError, "mask"),
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.float32), np.ones((3, 2), bool)), ValueError,
     r"mask must be broadcastable to logits \(1, 1, 2, 2\), received shape \(3, 2\)"),
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.float32), np.ones((2, 2), bool), threshold=0), ValueError,
     "threshold must be a number in"),
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.float32), np.ones((2, 2), bool), threshold=1.5),
     ValueError, "threshold"),
    (lambda: probes.head_saturation(np.zeros((1, 1, 2, 2), np.float32), np.ones((2, 2), bool), quantiles=[1.5]),
     ValueError, "quantiles"),
    (lambda: probes.layer_keep_masks(np.ones(3, np.float32), causal=True), TypeError, "attention_mask"),
    (lambda: probes.layer_keep_masks(np.array([1, 2]), causal=True), ValueError, "attention_mask must hold only 0 and 1"),
    (lambda: probes.layer_keep_masks(np.ones((1, 1, 3), int), causal=True), ValueError, "attention_mask must be"),
    (lambda: probes.layer_keep_masks(np.ones(3, int), causal="yes"), TypeError, "causal must be a bool"),
    (lambda: probes.layer_keep_masks(np.ones(3, int), causal=True, windows=[0]), ValueError, "windows must hold"),
    (lambda: probes.layer_keep_masks(np.ones(3, int), causal=True, windows=4), TypeError, "windows must be"),
])
def test_bad_input_names_the_argument(call, error, says):
    with pytest.raises(error, match=says):
        call()


# ----------------------------------------------------------------------------------------------------
# A tiny Gemma-3-like model (sliding, full, sliding; window 3) with random weights.
# ----------------------------------------------------------------------------------------------------

WINDOW = 3
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny():
    _, _, tok = gpt2.random_model("tiny", seed=0)
    config = llama.LlamaConfig.make(
        vocab_size=343, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=WINDOW,
        model_type="gemma3_text", layer_types=LAYER_TYPES, query_pre_attn_scalar=8, rope_local_base_freq=100.0,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
    return random_params(0, config), config, tok


def test_the_rebuilt_masks_give_a_windowed_models_own_weights(tiny):
    """The script's path through the public API on a tiny model: bind, capture, layer_keep_masks,
    head_saturation. Softmax of the captured logits under the rebuilt masks (window 3 on the sliding layers,
    left and right padding) equals the captured weights on every real row; a window-free mask would not."""
    params, config, _ = tiny
    ids = np.arange(2 * 9, dtype=np.int32).reshape(2, 9) + 5
    mask = np.array([[1] * 8 + [0], [0] * 2 + [1] * 7])
    out = interventions.bind(llama, params, config, ids, attention_mask=mask)(capture=("attn_logits", "attn_weights"))
    logits, weights = np.asarray(out.captured["attn_logits"]), np.asarray(out.captured["attn_weights"])
    windows = llama.sizes(config).layer_windows
    assert windows == (WINDOW, None, WINDOW)

    def softmax(keep):
        z = np.where(keep, logits.astype(np.float64), -np.inf)
        real = keep.any(-1, keepdims=True)
        p = np.exp(z - np.where(real, z.max(-1, keepdims=True), 0.0))
        return np.where(real, p / np.where(real, p.sum(-1, keepdims=True), 1.0), 0.0), np.broadcast_to(real, logits.shape)

    p, real = softmax(np.asarray(probes.layer_keep_masks(mask, causal=True, windows=windows)))
    np.testing.assert_allclose(np.where(real, p, 0.0), np.where(real, weights, 0.0), atol=2e-6)
    loose, _ = softmax(np.asarray(probes.layer_keep_masks(mask, causal=True)))
    assert np.max(np.abs(np.where(real, loose - weights, 0.0))) > 1e-2
    stats = probes.head_saturation(logits, probes.layer_keep_masks(mask, causal=True, windows=windows))
    # 8 + 7 real rows, each sentence's first token alone: 13 rows per head, on local and global layers alike
    np.testing.assert_array_equal(np.asarray(stats["rows"]), np.full((3, 4), 13.0))
    np.testing.assert_array_equal(np.asarray(stats["single_key_rows"]), np.full((3, 4), 2.0))
    assert np.all(np.isfinite(np.asarray(stats["entropy_mean"]))) and np.all(np.asarray(stats["entropy_mean"]) > 0)


def _main():
    return runpy.run_path(str(ROOT / "experiments" / "trained_heads.py"))["main"]


@pytest.mark.slow
def test_the_script_quick_on_a_tiny_windowed_model(tiny, tmp_path, monkeypatch, capsys):
    """--model gemma3 --quick, with the loader replaced by the tiny model: every head's record, its saturation
    as head_saturation gives it on the same sentences, one head's ablation effect recomputed by hand."""
    params, config, tok = tiny
    monkeypatch.setattr(llama, "load", lambda *a, **k: (params, config, tok))
    out = tmp_path / "out"
    assert _main()(["--model", "gemma3", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Spearman's rho" in printed
    report = json.loads((out / "heads.json").read_text())
    assert (out / "heads.png").read_bytes()[:4] == b"\x89PNG" and "| layer | kind |" in (out / "heads.md").read_text()
    assert report["sentences"] == 4 and report["windows"] == [WINDOW, None, WINDOW]
    assert report["layer_kinds"] == ["local (window 3)", "global", "local (window 3)"]
    assert report["mask_mismatch"] <= 1e-4
    assert set(report["correlations"]) == {"all", "local", "global"}
    assert report["correlations"]["all"]["heads"] == 12 and report["correlations"]["global"]["heads"] == 4
    heads = report["heads"]
    assert [(h["layer"], h["head"]) for h in heads] == [(l, n) for l in range(3) for n in range(4)]
    assert sorted(h["effect_rank"] for h in heads) == list(range(1, 13))

    from jaxattn import winograd  # the same sentences, the same batch, the library directly
    texts = [s.text for s in winograd.to_schemas(winograd.load_wsc273())][:4]
    ids = [np.asarray(interventions.encode_with_offsets(tok, t)[0]) for t in texts]
    T = max(map(len, ids))
    batch = np.stack([np.pad(i, (0, T - len(i))) for i in ids]).astype(np.int32)
    mask = np.arange(T)[None, :] < np.array([len(i) for i in ids])[:, None]
    bound = interventions.bind(llama, params, config, batch, attention_mask=mask)
    logits = bound(capture=("attn_logits",)).captured["attn_logits"]
    stats = probes.head_saturation(logits, probes.layer_keep_masks(mask, causal=True, windows=[WINDOW, None, WINDOW]))
    for h in heads:
        for name in ("saturated_fraction", "rows"):
            assert h[name] == pytest.approx(float(stats[name][h["layer"], h["head"]]), abs=1e-6)
        assert h["entropy_mean"] == pytest.approx(float(stats["entropy_mean"][h["layer"], h["head"]]), rel=1e-4)

    def mean_log_prob(head_mask):
        out = bound(head_mask=head_mask)
        lp = jax.vmap(lambda lg, i, m: interventions.span_log_prob(lg, i, 0, T, attention_mask=m))(out.logits, batch, mask)
        return float(np.sum(lp)) / (mask.sum() - len(ids))

    gate = np.ones((3, 4), np.float32)
    gate[1, 2] = 0.0
    effect = mean_log_prob(gate) - mean_log_prob(np.ones((3, 4), np.float32))
    assert heads[1 * 4 + 2]["ablation_effect"] == pytest.approx(effect, abs=1e-4)
    assert report["clean_metric"] == pytest.approx(mean_log_prob(np.ones((3, 4), np.float32)), abs=1e-4)


def test_the_script_refuses_a_bad_threshold_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(llama, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _main()(["--model", "smollm2", "--threshold", "1.5", "--out", str(tmp_path / "out")]) == 2
    assert "--threshold must be in (0, 1], received 1.5" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_script_quick_on_the_bundled_minilm(tmp_path):
    """The encoder's path on the real all-MiniLM-L6-v2: no causal mask, the embedding metric (effects <= 0)."""
    out = tmp_path / "out"
    assert _main()(["--model", "minilm", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "heads.json").read_text())
    assert len(report["heads"]) == 6 * 12 and report["single_key_rows"] == 0
    assert report["mask_mismatch"] <= 1e-4 and report["clean_metric"] == pytest.approx(1.0, abs=1e-5)
    assert all(h["ablation_effect"] <= 1e-6 for h in report["heads"])
