"""Head scores, the logit lens, direct logit attribution and residual-stream patching, on tiny random models:
scores against hand-made maps and a loop over real positions, the lens and the attribution against the
model's own final norm and logits, patching tables against a loop of patched forwards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import bert, gpt2, interventions, llama
from jaxattn.models import left_pad
from tests.whole_forwards import loop_table

GPT2 = gpt2.GPT2Config.make(vocab_size=23, n_positions=16, n_embd=16, n_layer=2, n_head=2)
LLAMA = llama.LlamaConfig.make(vocab_size=23, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
IDS = np.array([3, 17, 5, 9, 22, 1, 4, 8], np.int32)
SOURCE = np.array([3, 11, 5, 2, 22, 19, 4, 8], np.int32)
A, B = 3, 4  # the logit difference read: logit[A] - logit[B]


def _spread(params, seed, scale):
    """Matrices scaled up (logits that vary); every vector (biases, norm weights) moved off 0 and 1."""
    rng = np.random.default_rng(seed)

    def spread(path, x):  # a matrix (or matrices stacked over the layers) is a kernel or an embedding
        if jax.tree_util.keystr(path).endswith(("['kernel']", "['embedding']")):
            return x * scale
        return x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(spread, params)


MODELS = {
    "gpt2": (gpt2, GPT2, _spread(gpt2.init_params(0, GPT2), 0, 20.0)),
    "llama": (llama, LLAMA, _spread(llama.init_params(0, LLAMA), 1, 8.0)),
}


CAPTURE = ("attn_out", "mlp_out", "resid_mid", "resid_post", "resid_pre", "z")  # one compiled forward each
PADDED = left_pad([IDS, IDS[:5]])  # [2, 8]: the second sequence left-padded by 3


class Run:
    """One model with its bound input, its clean run, the source's run and a padded batch (built once)."""

    def __init__(self, name):
        self.module, self.config, self.params = MODELS[name]
        self.name = name
        self.bound = interventions.bind(self.module, self.params, self.config, IDS)
        self.run = self.forward(IDS)
        self.source = self.forward(SOURCE).captured
        self.batch = interventions.bind(self.module, self.params, self.config, PADDED[0], attention_mask=PADDED[1])

    def forward(self, ids, **kw):
        return self.module.forward(self.params, self.config, ids, capture=CAPTURE, **kw)


RUNS = {}


def _run(name):
    if name not in RUNS:
        RUNS[name] = Run(name)
    return RUNS[name]


# make test runs the toolkit on the Llama family, make test-slow on GPT-2 as well (the attribution's
# parts, where GPT-2 adds bias terms, run on both in make test).
@pytest.fixture(scope="module", params=[pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def model(request):
    return _run(request.param)


def metric(out):
    return out.logits[-1, A] - out.logits[-1, B]


# ----------------------------------------------------------------------------------------------------
# head_scores
# ----------------------------------------------------------------------------------------------------


def scores_by_hand(maps, ids, mask, kind):
    """The scores by a loop over the real positions (``real[i]`` is the column of position ``i``)."""
    maps = np.asarray(maps, np.float64)
    real = [t for t in range(len(ids)) if mask[t]]
    total, rows = np.zeros(maps.shape[:2]), 0
    for i, t in enumerate(real):
        earlier = [j for j in range(i) if ids[real[j]] == ids[t]]
        targets = {"previous_token": [real[i - 1]] if i >= 1 else [],
                   "duplicate_token": [real[j] for j in earlier],
                   "induction": [real[j + 1] for j in earlier],
                   "sink": [real[0]] if i >= 1 else []}[kind]
        if targets:
            rows += 1
            total += maps[:, :, t, targets].sum(-1)
    return total / rows if rows else np.full(maps.shape[:2], np.nan)


def random_maps(rng, L, N, mask):
    """Causal softmax maps ``[L, N, T, T]`` over the real keys; padded rows are NaN (they must not count)."""
    T = len(mask)
    logits = 3 * rng.standard_normal((L, N, T, T))
    keep = np.tril(np.ones((T, T), bool)) & (mask[None, :].astype(bool) | np.eye(T, dtype=bool))  # a pad row: itself
    logits = np.where(keep, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    return np.where(mask[:, None].astype(bool), w, np.nan).astype(np.float32)


def one_hot_rows(T, target):
    """``[T, T]`` with row t all on ``target(t)``."""
    m = np.zeros((T, T), np.float32)
    for t in range(T):
        m[t, target(t)] = 1.0
    return m


def test_head_scores_on_hand_made_heads():
    ids = np.array([4, 1, 2, 4, 1, 2], np.int32)  # a repeated sequence: rows 3, 4, 5 repeat rows 0, 1, 2
    T = 6
    heads = np.stack([
        one_hot_rows(T, lambda t: max(t - 1, 0)),  # previous token
        one_hot_rows(T, lambda t: t - 3 if t >= 3 else t),  # the earlier occurrence (duplicate), else itself
        one_hot_rows(T, lambda t: t - 2 if t >= 3 else t),  # the token after it (induction), else itself
        np.tril(np.ones((T, T), np.float32)) / np.arange(1, T + 1, dtype=np.float32)[:, None],  # uniform
    ])[None]  # [1, 4, T, T]
    uniform_prev = np.mean([1 / (t + 1) for t in range(1, T)])
    expected = {
        "previous_token": [1.0, 0.0, 0.0, uniform_prev],
        "duplicate_token": [0.0, 1.0, 0.0, np.mean([1 / 4, 1 / 5, 1 / 6])],
        "induction": [0.0, 0.0, 1.0, np.mean([1 / 4, 1 / 5, 1 / 6])],
        "sink": [0.2, 0.2, 0.0, uniform_prev],  # of rows 1..5, head 0's row 1 and head 1's row 3 are on 0
    }
    for kind, want in expected.items():
        got = interventions.head_scores(heads, ids, kind)
        assert got.shape == (1, 4) and got.dtype == jnp.float32
        np.testing.assert_allclose(got[0], want, atol=1e-6, err_msg=kind)


@pytest.mark.parametrize("kind", interventions.HEAD_KINDS)
def test_head_scores_match_a_loop_with_padding_and_a_batch(kind):
    rng = np.random.default_rng(0)
    seqs = [np.array([5, 7, 5, 9, 7, 5, 2], np.int32), np.array([1, 2, 1, 2, 2], np.int32)]
    ids, mask = (np.asarray(a) for a in left_pad(seqs))  # [2, 7]: the second has 2 pads on the left
    maps = np.stack([random_maps(rng, 2, 3, m) for m in mask])  # [2, L, N, T, T]
    batch = interventions.head_scores(maps, ids, kind, attention_mask=mask)
    assert batch.shape == (2, 2, 3)
    for b in range(2):
        by_hand = scores_by_hand(maps[b], ids[b], mask[b], kind)
        np.testing.assert_allclose(batch[b], by_hand, atol=1e-6)
        one = interventions.head_scores(maps[b], ids[b], kind, attention_mask=mask[b])
        np.testing.assert_allclose(one, batch[b], atol=1e-7)
    # the padded sequence scores as the sequence alone
    alone = interventions.head_scores(maps[1][:, :, 2:, 2:], seqs[1], kind)
    np.testing.assert_allclose(alone, batch[1], atol=1e-6)
    # under jit too (the checks read shapes only)
    jitted = jax.jit(lambda m, i, k: interventions.head_scores(m, i, kind, attention_mask=k))(maps, ids, mask)
    np.testing.assert_allclose(jitted, batch, atol=1e-7)


def test_head_scores_of_a_kind_without_rows_are_nan():
    maps = random_maps(np.random.default_rng(1), 1, 2, np.ones(4, bool))
    distinct = np.array([1, 2, 3, 4], np.int32)
    assert bool(jnp.all(jnp.isnan(interventions.head_scores(maps, distinct, "duplicate_token"))))
    assert bool(jnp.all(jnp.isnan(interventions.head_scores(maps, distinct, "induction"))))
    one_real = np.array([0, 0, 0, 1])
    assert bool(jnp.all(jnp.isnan(interventions.head_scores(maps, distinct, "sink", attention_mask=one_real))))
    assert bool(jnp.all(jnp.isfinite(interventions.head_scores(maps, distinct, "previous_token"))))


def test_head_scores_relate_to_transformer_lens_mul_scores():
    # TransformerLens' "mul" score: Σ A ⊙ pattern over all rows / Σ A, i.e. (rows with a target) / T times ours
    rng = np.random.default_rng(2)
    ids = np.array([6, 3, 8, 6, 3, 8, 6], np.int32)
    T = len(ids)
    maps = random_maps(rng, 1, 2, np.ones(T, bool))
    eq = (ids[:, None] == ids[None, :]).astype(np.float32)
    np.fill_diagonal(eq, 0)
    duplicate = np.tril(eq)
    induction = np.tril(np.concatenate([np.zeros((T, 1), np.float32), duplicate[:, :-1]], axis=1))
    previous = np.tril(np.eye(T, k=-1, dtype=np.float32))
    for kind, pattern in (("previous_token", previous), ("duplicate_token", duplicate), ("induction", induction)):
        tl = (maps * pattern).sum((-2, -1)) / maps.sum((-2, -1))
        rows = int(np.any(pattern > 0, axis=1).sum())
        np.testing.assert_allclose(interventions.head_scores(maps, ids, kind) * rows / T, tl, atol=1e-6)


def test_head_scores_bad_input_names_the_argument():
    maps = np.zeros((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"kind must be one of previous_token, .* received 'induction_head'"):
        interventions.head_scores(maps, np.arange(4), "induction_head")
    with pytest.raises(ValueError, match=r"ids must be \[T\] = \(4,\) .* received ids of shape \(5,\)"):
        interventions.head_scores(maps, np.arange(5), "sink")
    with pytest.raises(ValueError, match=r"maps must have shape \[L, N, T, S\]"):
        interventions.head_scores(maps[0], np.arange(4), "sink")
    with pytest.raises(TypeError, match=r"ids must be integer token ids, received dtype float32"):
        interventions.head_scores(maps, np.zeros(4, np.float32), "sink")
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of ids \(4,\), received \(3,\)"):
        interventions.head_scores(maps, np.arange(4), "sink", attention_mask=np.ones(3))


# ----------------------------------------------------------------------------------------------------
# logit_lens
# ----------------------------------------------------------------------------------------------------


def test_logit_lens_rows_are_the_stream_read_through_the_final_norm(model):
    m = model
    pos = np.array([0, 3, 7])
    lens = interventions.logit_lens(m.bound, positions=[0, 3, -1])
    assert lens.shape == (3, 3, 23)
    np.testing.assert_allclose(lens[2], m.run.logits[pos], atol=1e-5)
    for layer in range(2):
        stream = m.run.captured["resid_pre"][layer][pos]
        by_hand = m.module.unembed(m.params, m.config, m.module.final_norm(m.params, m.config, stream))
        np.testing.assert_allclose(lens[layer], by_hand, atol=1e-4)
    assert float(jnp.abs(lens[0] - lens[2]).max()) > 1e-2  # the layers change the reading
    # a left-padded batch: each row reads its own sequence's columns
    batch = interventions.logit_lens(m.batch, positions=[0, 3, -1])
    assert batch.shape == (2, 3, 3, 23)
    np.testing.assert_allclose(batch[0], lens, atol=1e-4)
    padded = m.forward(PADDED[0][1], attention_mask=PADDED[1][1])
    np.testing.assert_allclose(batch[1, 2], padded.logits[pos], atol=1e-5)
    stream = padded.captured["resid_pre"][1][pos]
    by_hand = m.module.unembed(m.params, m.config, m.module.final_norm(m.params, m.config, stream))
    np.testing.assert_allclose(batch[1, 1], by_hand, atol=1e-4)


def test_lens_and_attribution_refuse_an_encoder_by_name():
    config = bert.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=16, max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12)
    bound = interventions.bind(bert, {}, config, np.arange(4))
    with pytest.raises(ValueError, match=r"logit_lens needs logits: the model jaxattn\.bert has no unembedding"):
        interventions.logit_lens(bound, positions=[0])
    with pytest.raises(ValueError, match=r"logit_attribution needs .*jaxattn\.bert"):
        interventions.logit_attribution(bound, (1, 2))


def test_lens_and_attribution_bad_input_names_the_argument():
    bound = _run("gpt2").bound
    with pytest.raises(ValueError, match=r"positions must lie in \[-T, T\) = \[-8, 8\) .* received \[0, 8\]"):
        interventions.logit_lens(bound, positions=[0, 8])
    with pytest.raises(ValueError, match=r"positions must be a non-empty sequence of int"):
        interventions.logit_lens(bound, positions=[0.5])
    with pytest.raises(ValueError, match=r"pair must be \(a, b\), two token ids in \[0, 23\), received \(1, 23\)"):
        interventions.logit_attribution(bound, (1, 23))
    with pytest.raises(TypeError, match=r"pair must be an int \(a token id in \[0, 23\)\), received float"):
        interventions.logit_attribution(bound, (1, 2.0))
    with pytest.raises(ValueError, match=r"position must lie in \[-T, T\) = \[-8, 8\) .* received -9"):
        interventions.logit_attribution(bound, (1, 2), position=-9)
    with pytest.raises(TypeError, match=r"bound must be a jaxattn.interventions.Bound"):
        interventions.logit_lens(lambda **kw: None, positions=[0])


# ----------------------------------------------------------------------------------------------------
# logit_attribution
# ----------------------------------------------------------------------------------------------------


def _sum_parts(parts):
    return sum(float(jnp.sum(v)) for k, v in parts.items() if k != "total")


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("position", [-1, 2])
def test_logit_attribution_parts_add_up_to_the_clean_logit_difference(name, position):
    model = _run(name)
    parts = interventions.logit_attribution(model.bound, (A, B), position=position)
    logits = model.run.logits
    clean = float(logits[position, A] - logits[position, B])
    assert abs(clean) > 0.1  # a difference worth attributing
    assert float(parts["total"]) == pytest.approx(clean, abs=1e-5)
    assert _sum_parts(parts) == pytest.approx(clean, abs=1e-4)
    biases = {"gpt2": {"attn_bias", "final_norm_bias"}, "llama": set()}[model.name]  # llama: RMSNorm, no o_proj bias
    assert set(parts) == {"embed", "heads", "mlps", "total"} | biases
    assert parts["heads"].shape == (2, model.module.sizes(model.config).heads) and parts["mlps"].shape == (2,)
    assert float(jnp.abs(parts["heads"]).min()) > 0


def test_logit_attribution_by_hand():
    m = _run("gpt2")
    parts = interventions.logit_attribution(m.bound, (A, B))
    c = {name: np.asarray(x, np.float64) for name, x in m.run.captured.items()}
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), m.params)["transformer"]
    x = c["resid_post"][-1, -1]  # [D], what ln_f reads
    s = np.sqrt(x.var() + m.config.layer_norm_epsilon)  # the clean statistic, frozen
    direction = p["wte"]["embedding"][A] - p["wte"]["embedding"][B]  # the tied unembedding's row difference

    def share(v):  # a part v [D] through the frozen ln_f, then the unembedding
        return float(((v - v.mean()) / s * p["ln_f"]["scale"]) @ direction)

    H = m.config.head_dim
    for layer in range(2):
        proj = jax.tree.map(lambda a: a[layer], p["h"]["attn"]["c_proj"])  # kernel (out, in): head n's inputs are columns n·H..(n+1)·H
        for head in range(2):
            v = proj["kernel"][:, head * H:(head + 1) * H] @ c["z"][layer, -1, head]
            assert float(parts["heads"][layer, head]) == pytest.approx(share(v), abs=1e-4)
        assert float(parts["attn_bias"][layer]) == pytest.approx(share(proj["bias"]), abs=1e-4)
        assert float(parts["mlps"][layer]) == pytest.approx(share(c["mlp_out"][layer, -1]), abs=1e-4)
    assert float(parts["embed"]) == pytest.approx(share(c["resid_pre"][0, -1]), abs=1e-4)
    assert float(parts["final_norm_bias"]) == pytest.approx(float(p["ln_f"]["bias"] @ direction), abs=1e-4)


def test_logit_attribution_of_a_padded_batch_reads_each_sequence(model):
    batch = interventions.logit_attribution(model.batch, (A, B))
    assert set(batch) == set(interventions.logit_attribution(model.bound, (A, B)))
    for b in range(2):  # each row as the same padded row bound alone (the one compiled unbatched program)
        alone = interventions.logit_attribution(interventions.bind(model.module, model.params, model.config,
                                                                   PADDED[0][b], attention_mask=PADDED[1][b]), (A, B))
        for key, value in alone.items():
            np.testing.assert_allclose(batch[key][b], value, atol=1e-4, err_msg=key)
    assert _sum_parts({k: v[1] for k, v in batch.items()}) == pytest.approx(float(batch["total"][1]), abs=1e-4)


# ----------------------------------------------------------------------------------------------------
# patching_effects on residual-stream and block-output sites
# ----------------------------------------------------------------------------------------------------

SITES = {"gpt2": ("resid_pre", "attn_out", "resid_post"), "llama": ("resid_mid", "mlp_out")}  # each site once


def _by_hand(m, name, value, layer, t):
    """``metric`` of one patched forward minus the clean one: every site in the patch (one compiled forward
    for all of them), ``where`` true at ``(layer, t)`` of ``name`` only."""
    L, T = 2, len(IDS)
    patch = {}
    for site in interventions.POSITION_SITES:
        where = np.zeros((L, T, 1), bool)
        if site == name:
            where[layer, t] = True
        patch[site] = (value if site == name else m.source[site], where)
    return float(metric(m.module.forward(m.params, m.config, IDS, patch=patch))) - float(metric(m.run))


def test_patching_the_stream_by_layer_and_position_matches_a_loop_of_patched_forwards(model):
    m = model
    L, T = 2, len(IDS)
    for name in SITES[m.name]:
        table = interventions.patching_effects(m.bound, metric, m.source[name], name=name, chunk=6)
        assert table.shape == (L, T)
        for layer in range(L):
            for t in range(T):
                by_hand = _by_hand(m, name, m.source[name], layer, t)
                assert float(table[layer, t]) == pytest.approx(by_hand, abs=2e-5), (name, layer, t)
        np.testing.assert_allclose(table[:, 0], 0.0, atol=1e-6)  # the first token is the same in both inputs
        assert float(jnp.abs(table).max()) > 1e-3
    # the clean value changes nothing (the same compiled program)
    name = SITES[m.name][0]
    own = interventions.patching_effects(m.bound, metric, m.run.captured[name], name=name, chunk=6)
    np.testing.assert_allclose(own, 0.0, atol=1e-6)


@pytest.mark.slow  # make test-slow: make test patches the stream of an unbatched bound
def test_patching_the_stream_at_some_positions_of_a_batch_with_a_broadcast_value():
    m = _run("gpt2")
    pick = np.zeros(len(IDS), bool)
    pick[[1, 3, 7]] = True
    full = interventions.patching_effects(m.bound, metric, m.source["resid_pre"], name="resid_pre", chunk=6)
    some = interventions.patching_effects(m.bound, metric, m.source["resid_pre"], name="resid_pre", positions=pick,
                                          chunk=6)
    assert some.shape == (2, 3)
    np.testing.assert_allclose(some, full[:, pick], atol=1e-6)
    # a batch: every sequence patched at (layer, t) at once; the summed metric adds the sequences' effects
    ids = np.stack([IDS, SOURCE])
    batch = interventions.bind(m.module, m.params, m.config, ids)
    value = jnp.stack([m.source["attn_out"], m.run.captured["attn_out"]])  # [B, L, T, D]: each takes the other's

    def summed(out):
        return jnp.sum(out.logits[:, -1, A] - out.logits[:, -1, B])

    table = interventions.patching_effects(batch, summed, value, name="attn_out", chunk=6)
    back = interventions.bind(m.module, m.params, m.config, SOURCE)
    each = (interventions.patching_effects(m.bound, metric, m.source["attn_out"], name="attn_out", chunk=6)
            + interventions.patching_effects(back, metric, m.run.captured["attn_out"], name="attn_out", chunk=6))
    np.testing.assert_allclose(table, each, atol=2e-5)
    # a value of size 1 along T (a mean over positions) broadcasts
    mean = jnp.mean(m.source["resid_pre"], axis=1, keepdims=True)  # [L, 1, D]
    broadcast = interventions.patching_effects(m.bound, metric, mean, name="resid_pre", positions=pick, chunk=6)
    for i, t in enumerate(np.flatnonzero(pick)):
        by_hand = _by_hand(m, "resid_pre", jnp.broadcast_to(mean, m.source["resid_pre"].shape), 1, t)
        assert float(broadcast[1, i]) == pytest.approx(by_hand, abs=2e-5)


def test_patching_a_bad_site_or_positions_names_the_argument():
    bound = _run("gpt2").bound
    with pytest.raises(ValueError, match=r"name must be .* or a residual-stream or block-output site, one of "
                                         r"\('resid_pre', .*received 'attn_logits'"):
        interventions.patching_effects(bound, metric, jnp.zeros((2, 2, 8, 8)), name="attn_logits")
    with pytest.raises(ValueError, match=r"positions must be boolean \[T\] = \(8,\)"):
        interventions.patching_effects(bound, metric, jnp.zeros((2, 8, 16)), name="resid_pre", positions=np.ones(7, bool))
    with pytest.raises(ValueError, match=r"positions must select at least one"):
        interventions.patching_effects(bound, metric, jnp.zeros((2, 8, 16)), name="resid_pre", positions=np.zeros(8, bool))


# ----------------------------------------------------------------------------------------------------
# Fast tables: each intervention resumed at its layer (the protocol's resume), a shared prefix packed
# ----------------------------------------------------------------------------------------------------

# Two sequences with a shared prefix of 5 tokens, the first right-padded by one: the tables pack them.
SHARED = np.stack([np.concatenate([IDS[:5], [2, 6, 0]]), np.concatenate([IDS[:5], [11, 19, 7]])]).astype(np.int32)
SHARED_MASK = np.array([[1] * 7 + [0], [1] * 8], bool)
SHARED_SOURCE = SHARED.copy()
SHARED_SOURCE[:, 1] = 13  # the source differs inside the prefix, the same in both sequences


def batch_metric(out):
    """Both sequences' last real rows, and a map of layer 0 (the clean run's, when resumed at layer 1)."""
    return out.logits[0, 6, A] - out.logits[1, 7, B] + 3.0 * out.attentions[1, 0, 1, 7, 2]


def rows_metric(out):
    return out.logits[0, 6, A] - out.logits[1, 7, B]


rows_metric = interventions.LogitMetric(rows_metric, (6, 7))


def test_resume_from_any_layer_gives_the_forward_and_packs_a_shared_prefix(model):
    m = model
    for layer in range(2):  # the stream entering block `layer`, and the maps of the blocks before it
        out = m.module.resume(m.params, m.config, m.run.captured["resid_pre"][layer], layer, attentions=m.run.attentions)
        np.testing.assert_allclose(out.logits, m.run.logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out.attentions, m.run.attentions, atol=1e-6)
    # with an intervention at layer 1, as the forward with the same intervention
    heads = np.ones((2, m.module.sizes(m.config).heads), np.float32)
    heads[1, 0] = 0.0
    ablated = m.forward(IDS, head_mask=heads)
    out = m.module.resume(m.params, m.config, m.run.captured["resid_pre"][1], 1, head_mask=heads)
    np.testing.assert_allclose(out.logits, ablated.logits, atol=1e-5, rtol=1e-5)
    # two sequences packed into one: the shared prefix once, each tail seeing the prefix and itself
    batch = jax.vmap(lambda i, k: m.forward(i, attention_mask=k))(SHARED, SHARED_MASK)
    P, T = 5, 8
    seq = np.array([0] * T + [1] * (T - P))
    col = np.concatenate([np.arange(T), np.arange(P, T)])
    keep = ((seq[:, None] == seq[None, :]) | ((seq[None, :] == 0) & (col[None, :] < P))) & SHARED_MASK[seq, col][None]
    pos = (np.cumsum(SHARED_MASK, 1) - 1)[seq, col]
    stream = np.asarray(batch.captured["resid_pre"])[seq, 0, col]  # [T', D]: the batch's stream entering block 0
    packed = m.module.resume(m.params, m.config, stream, 0, attention_mask=keep, positions=pos)
    np.testing.assert_allclose(packed.logits[:7], batch.logits[0][:7], atol=1e-5, rtol=1e-5)  # sequence 0's real rows
    np.testing.assert_allclose(packed.logits[:P], batch.logits[1][:P], atol=1e-5, rtol=1e-5)  # the prefix, once
    np.testing.assert_allclose(packed.logits[T:], batch.logits[1][P:], atol=1e-5, rtol=1e-5)  # sequence 1's tail
    with pytest.raises(ValueError, match=r"positions must be given with a \[T, T\] attention_mask"):
        m.module.resume(m.params, m.config, stream, 0, attention_mask=keep)
    with pytest.raises(ValueError, match=r"layer must lie in \[0, L\) = \[0, 2\), received 2"):
        m.module.resume(m.params, m.config, m.run.captured["resid_pre"][0], 2)
    with pytest.raises(ValueError, match=r"resid_pre must have shape \[T, D\] with D = 16"):
        m.module.resume(m.params, m.config, np.zeros((8, 15), np.float32), 0)


def _close(fast, full):
    """Within 1e-5 of the table's largest entry (relative), and not all zero."""
    scale = float(np.abs(full).max())
    assert scale > 1e-3
    np.testing.assert_allclose(fast, full, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])  # gpt2 in make test-slow
def test_fast_tables_equal_a_loop_of_whole_forwards_on_a_padded_batch_with_a_shared_prefix(name):
    m = _run(name)
    bound = interventions.bind(m.module, m.params, m.config, SHARED, attention_mask=SHARED_MASK)
    source = interventions.bind(m.module, m.params, m.config, SHARED_SOURCE, attention_mask=SHARED_MASK)
    captured = source(capture=("resid_mid",)).captured
    # a metric that reads two logits rows (the fast tables unembed those alone), and one that reads a map
    runs = [(interventions.ablation_effects(bound, rows_metric, chunk=3), loop_table(bound, rows_metric)),
            (interventions.patching_effects(bound, batch_metric, captured["resid_mid"], name="resid_mid", chunk=5),
             loop_table(bound, batch_metric, name="resid_mid", value=captured["resid_mid"]))]
    for table, looped in runs:  # against the loop of whole forwards (the lax.map of them, and every table kind: slow)
        _close(np.asarray(table), looped)


@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, True])
def test_every_fast_table_equals_the_whole_forward_table_and_the_loop(model, batched):
    m = model
    if batched:
        bound = interventions.bind(m.module, m.params, m.config, SHARED, attention_mask=SHARED_MASK)
        source = interventions.bind(m.module, m.params, m.config, SHARED_SOURCE, attention_mask=SHARED_MASK)
        metric_ = batch_metric
    else:
        bound, source, metric_ = m.bound, interventions.bind(m.module, m.params, m.config, SOURCE), metric
    captured = source(capture=("z", "k", "attn_weights", "resid_pre", "mlp_out")).captured
    mean = jnp.mean(captured["z"], axis=-3 if batched else 1, keepdims=True)  # a broadcast value: mean-ablation
    mean = mean[0] if batched else mean
    tables = {
        "ablation": lambda **r: interventions.ablation_effects(bound, metric_, chunk=4, **r),
        "half gate": lambda **r: interventions.ablation_effects(bound, metric_, value=0.5, chunk=None, **r),
        "z": lambda **r: interventions.patching_effects(bound, metric_, captured["z"], **r),
        "mean z": lambda **r: interventions.patching_effects(bound, metric_, mean, chunk=2, **r),
        "k": lambda **r: interventions.patching_effects(bound, metric_, captured["k"], name="k", **r),
        "attn_weights": lambda **r: interventions.patching_effects(bound, metric_, captured["attn_weights"],
                                                                   name="attn_weights", **r),
        "z at positions": lambda **r: interventions.patching_effects(bound, metric_, captured["z"],
                                                                     positions=np.arange(8) >= 5, **r),
        "resid_pre": lambda **r: interventions.patching_effects(bound, metric_, captured["resid_pre"],
                                                                name="resid_pre", **r),
        "mlp_out at positions": lambda **r: interventions.patching_effects(
            bound, metric_, captured["mlp_out"], name="mlp_out", positions=np.arange(8) % 3 == 1, chunk=2, **r),
    }
    for name, run in tables.items():
        fast, full = np.asarray(run()), np.asarray(run(resume=False))
        assert fast.shape == full.shape, name
        _close(fast, full)
    _close(loop_table(bound, metric_), np.asarray(tables["ablation"]()))
    _close(loop_table(bound, metric_, name="resid_pre", value=captured["resid_pre"]), np.asarray(tables["resid_pre"]()))


def test_fast_tables_refuse_a_metric_that_reads_rows_it_does_not_declare():
    m = _run("gpt2")

    def wrong(out):
        return out.logits[-1, A] - out.logits[-1, B]

    with pytest.raises(ValueError, match=r"metric.rows = \(2, 3\) leaves out logits rows the metric reads"):
        interventions.ablation_effects(m.bound, interventions.LogitMetric(wrong, (2, 3)))
    with pytest.raises(ValueError, match=r"metric.rows must be a non-empty sorted tuple of distinct positions"):
        interventions.ablation_effects(m.bound, interventions.LogitMetric(wrong, (3, 2)))


# ----------------------------------------------------------------------------------------------------
# SmolLM2-135M (the bundled weights): induction heads and the logit lens of a fact
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return llama.load()


@pytest.mark.slow
def test_smollm2_has_induction_heads_on_a_repeated_random_sequence(smollm2):
    params, config, _ = smollm2
    half = np.random.default_rng(0).integers(1000, 40000, 24).astype(np.int32)
    ids = np.concatenate([half, half])  # 24 random tokens, then the same 24 again
    maps = llama.forward(params, config, ids).attentions
    scores = np.asarray(interventions.head_scores(maps, ids, "induction"))  # [30, 9]
    top = np.argsort(-scores, axis=None)[:5]
    print("top induction heads (layer, head, score):",
          [(int(i) // 9, int(i) % 9, round(float(scores.flat[i]), 3)) for i in top], "mean", round(float(scores.mean()), 4))
    assert scores.max() > 0.5  # a head puts most of every repeated row's weight on the token after its earlier copy
    assert scores.max() > 10 * scores.mean()  # far above the typical head
    assert (scores > 0.5).sum() >= 3  # several such heads, not one outlier


@pytest.mark.slow
def test_smollm2_logit_lens_ranks_paris_first_at_the_last_layer(smollm2):
    params, config, tok = smollm2
    ids = np.asarray(tok.encode("The capital of France is"), np.int32)
    (paris,) = tok.encode(" Paris")
    lens = np.asarray(interventions.logit_lens(interventions.bind(llama, params, config, ids), positions=[-1]))[:, 0]
    ranks = [int((row > row[paris]).sum()) for row in lens]  # [L + 1]: 0 is the top token
    print("rank of ' Paris' after 'The capital of France is', stream entering each layer, then the output:", ranks)
    assert ranks[-1] == 0  # the model's own logits put " Paris" first
    assert min(ranks[:10]) > 100  # the early stream does not (the lens reads something the later layers build)


def test_joint_patching_of_one_head_is_its_table_entry_and_of_all_heads_is_one_patch():
    m = _run("llama")
    value = m.source["z"]
    table = interventions.patching_effects(m.bound, metric, value, chunk=None)
    one = interventions.joint_patching_effect(m.bound, metric, value, [(1, 2)])
    assert float(one) == pytest.approx(float(table[1, 2]), abs=2e-5)
    everything = interventions.joint_patching_effect(m.bound, metric, value, "all")
    by_hand = metric(m.forward(IDS, patch={"z": (value, np.ones((2, 1, 4, 1), bool))})) - metric(m.run)
    assert float(everything) == pytest.approx(float(by_hand), abs=2e-5)
    with pytest.raises(ValueError, match=r"heads must be \(layer, head\) pairs with layer < 2 and head < 4"):
        interventions.joint_patching_effect(m.bound, metric, value, [(0, 4)])
    with pytest.raises(ValueError, match=r"heads must be 'all' or a non-empty list"):
        interventions.joint_patching_effect(m.bound, metric, value, "some")
    with pytest.raises(ValueError, match=r"heads must be 'all' or a non-empty list"):  # NumPy would make it (1, 1)
        interventions.joint_patching_effect(m.bound, metric, value, [(True, 1)])


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=np.r_[IDS, 10**6]), r"input_ids must lie in \[0, vocab_size=\d+\), received values in \[\d+, 1000000\]"),
    (dict(input_ids=IDS.astype(np.int64) + (np.arange(IDS.size) == 3) * 2**32), r"received values in \[\d+, 4294967\d+\]"),
    (dict(input_ids=IDS, attention_mask=np.full(IDS.size, 2)), r"attention_mask must hold only 0 and 1, received values \[2\]"),
    (dict(input_ids=np.stack([IDS, IDS]), attention_mask=np.stack([np.ones(IDS.size, int), np.zeros(IDS.size, int)])),
     r"attention_mask marks no real token \(sequence\(s\) \[1\]\)"),
])
def test_bind_checks_the_values_the_tables_cannot(kwargs, match):
    """The tables run the forward traced, where ids and masks cannot be checked: bind checks concrete ones
    (an out-of-vocab id gave tables of NaN, an id past int32 silently became another token)."""
    m = _run("llama")
    with pytest.raises(ValueError, match=match):
        interventions.bind(llama, m.params, m.config, kwargs.pop("input_ids"), **kwargs)
