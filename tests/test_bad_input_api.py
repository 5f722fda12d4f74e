"""Bad input at the edges of interventions, Winograd data, viz and jaxattn.nnx: refused by name, or drawn as given.

Each case asserts the exception type and a message that names the argument (or the pair and field);
the models are tiny random ones, so every case is fast.
"""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn import gpt2, interventions, viz
from jaxattn.nnx import MultiHeadAttention

# ----------------------------------------------------------------------------------------------------
# Fixtures: a tiny GPT-2 on 5 tokens (one input, two and three inputs), and one Winograd pair.
# ----------------------------------------------------------------------------------------------------

T = 5


@pytest.fixture(scope="module")
def tiny():
    config = gpt2.GPT2Config.make(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    params = gpt2.init_params(0, config)
    bind = lambda ids: interventions.bind(gpt2, params, config, np.asarray(ids))
    return dict(one=bind(np.arange(T)), two=bind(np.arange(2 * T).reshape(2, T)),
                three=bind(np.arange(3 * T).reshape(3, T)))


PAIR = {"texts": ["The trophy didn't fit in the suitcase because [it] was too big.",
                  "The trophy didn't fit in the suitcase because [it] was too small."],
        "candidates": ["trophy", "suitcase"], "substitutes": ["the trophy", "the suitcase"], "answers": [0, 1]}


def logit(output):
    return output.logits[-1, 0]


# ----------------------------------------------------------------------------------------------------
# Interventions: scores, metrics and effect-table arguments.
# ----------------------------------------------------------------------------------------------------


def test_evaluate_refuses_nan_scores_by_sentence_and_candidate():
    pairs = interventions.parse_pairs({"pairs": [PAIR]})
    with pytest.raises(ValueError, match=r"score must return a number, received NaN for sentence 0 \(pair 0\), "
                                         r"candidate 0"):
        interventions.evaluate(pairs, score=lambda context, continuation: float("nan"))

    def nan_for_small_suitcase(context, continuation):
        return float("nan") if "suitcase was too small" in context + continuation else -1.0

    with pytest.raises(ValueError, match=r"NaN for sentence 1 \(pair 0\), candidate 1, full substitution"):
        interventions.evaluate(pairs, score=nan_for_small_suitcase)
    with pytest.raises(TypeError, match=r"score must return one real number .* for sentence 0 \(pair 0\), candidate 0"):
        interventions.evaluate(pairs, score=lambda context, continuation: "-1.0")
    scores = interventions.substitution_scores(interventions.flatten_pairs(pairs), lambda c, x: -float(len(x)))
    assert np.all(np.isfinite(scores["full"]))  # real numbers pass


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((100, (0, 1), (1, 2)), ValueError, r"token must be a position < T = 5 \(the output's tokens\), received 100"),
        ((-50, (0, 1), (1, 2)), ValueError, r"token must be >= 0 .*received -50"),
        ((2, (0, 1), (3, 9)), ValueError, r"span_b must end at or before T = 5"),
        ((2.0, (0, 1), (1, 2)), TypeError, r"token must be an int"),
        ((2, (1, 1), (1, 2)), ValueError, r"span_a must be \(start, stop\) with 0 <= start < stop"),
    ],
    ids=["token_past_T", "token_negative", "span_past_T", "token_float", "span_empty"],
)
def test_similarity_metric_refuses_positions_outside_the_output(tiny, args, error, message):
    with pytest.raises(error, match=message):
        metric = interventions.similarity_metric(*args)
        interventions.metric_value(tiny["one"], metric)  # traced under jit: the shapes are static


def test_similarity_metric_refuses_a_batched_output(tiny):
    metric = interventions.similarity_metric(2, (0, 1), (1, 2))
    assert np.isfinite(float(interventions.metric_value(tiny["one"], metric)))
    with pytest.raises(ValueError, match=r"last_hidden_state must be \[T, D\] .*received shape \(2, 5, 16\)"):
        metric(tiny["two"]())


@pytest.mark.parametrize(
    "metric, error, message",
    [
        (lambda o: o.logits[-1, 0] + 1j, TypeError, r"metric must return a real scalar .*received dtype complex64"),
        (lambda o: "x", TypeError, r"metric must return a real scalar .*received str"),
        (lambda o: None, TypeError, r"metric must return a real scalar .*received NoneType"),
        (lambda o: o.logits[-1, 0] > 0, TypeError, r"metric must return a real scalar .*received dtype bool"),
        (lambda o: o.logits[-1], ValueError, r"metric must return a scalar, received shape \(50,\)"),
    ],
    ids=["complex", "string", "none", "bool", "vector"],
)
@pytest.mark.parametrize("table", ["ablation_effects", "gate_gradients", "metric_value"])
def test_metric_results_that_are_not_real_scalars_are_refused(tiny, metric, error, message, table):
    with pytest.raises(error, match=message):
        getattr(interventions, table)(tiny["one"], metric)


def test_effect_table_arguments_are_refused_by_name(tiny):
    with pytest.raises(TypeError, match=r"value must be a real number .*received str"):
        interventions.ablation_effects(tiny["one"], logit, value="x")
    with pytest.raises(ValueError, match=r"value must be finite"):
        interventions.ablation_effects(tiny["one"], logit, value=float("inf"))
    z3 = tiny["three"](capture=("z",)).captured["z"]  # [3, L, T, N, H]
    batch_metric = lambda o: o.logits[0, -1, 0]
    for table in (interventions.patching_effects, interventions.attribution_patching):
        with pytest.raises(ValueError, match=r"value must have the bound's batch of B = 2 inputs .*received shape "
                                             r"\(3, 2, 5, 2, 8\)"):
            table(tiny["two"], batch_metric, z3)
    assert interventions.patching_effects(tiny["two"], batch_metric, z3[:2]).shape == (2, 2)  # B = 2: accepted


def test_a_patch_value_of_another_length_is_refused_before_anything_compiles(tiny):
    """patching_effects, joint_patching_effect and attribution_patching check the value against the
    captured tensor's shape (from the model's sizes) before compiling or running the model."""
    import jax

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: compiles.append(e) if e == "/jax/core/compile/backend_compile_duration" else None)
    z = tiny["one"](capture=("z",)).captured["z"]  # [L, T, N, H] = (2, 5, 2, 8)
    short = np.zeros((2, T - 1, 2, 8), np.float32)
    tables = (lambda: interventions.patching_effects(tiny["one"], logit, short),
              lambda: interventions.patching_effects(tiny["one"], logit, short, resume=False),
              lambda: interventions.joint_patching_effect(tiny["one"], logit, short, "all"),
              lambda: interventions.attribution_patching(tiny["one"], logit, short))
    for table in tables:
        before = len(compiles)
        with pytest.raises(ValueError, match=r"^value must have the shape of the captured z, \(2, 5, 2, 8\) \(or 1 "
                                             r"along an axis; a batched bound's may lead with B\), received \(2, 4, 2, 8\)"):
            table()
        assert len(compiles) == before
    assert interventions.patching_effects(tiny["one"], logit, z[:, :1]).shape == (2, 2)  # size 1: broadcast


def test_evaluate_refuses_empty_and_malformed_pairs():
    pairs = interventions.parse_pairs({"pairs": [PAIR]})
    score = lambda context, continuation: -1.0
    with pytest.raises(ValueError, match=r"pairs must hold at least one pair"):
        interventions.evaluate([], score=score)
    with pytest.raises(TypeError, match=r"pairs\[0\] must be two Schema"):
        interventions.evaluate([pairs[0][:1]], score=score)
    with pytest.raises(ValueError, match=r"pairs must hold at least 2 pairs when maps is given"):
        interventions.evaluate(pairs, maps=lambda text: None)
    with pytest.raises(ValueError, match=r"pair_ids must name at least 2 pairs"):
        interventions.best_head(np.zeros((2, 1, 1, 2)), [0, 1], [0, 0])


def test_evaluate_refuses_nan_attention_maps_by_sentence_head_and_candidate():
    pairs = interventions.parse_pairs({"pairs": [PAIR, PAIR]})

    def maps(text, nan=False):  # one layer, two heads; head 1's pronoun row NaN in the second sentence
        n = len(text.split())
        att = np.full((1, 2, n, n), 1.0 / n)
        if nan and text.endswith("small."):
            att[0, 1, :, :] = np.nan
        offsets, at = [], 0
        for word in text.split():
            at = text.index(word, at)
            offsets.append((at, at + len(word)))
            at += len(word)
        return att, np.array(offsets)

    assert set(interventions.evaluate(pairs, maps=maps)) >= {"max_attention", "best_head"}  # finite maps score
    with pytest.raises(ValueError, match=r"maps must return finite attention weights, received nan for sentence 1 "
                                         r"\(pair 0\), layer 0, head 1, candidate 0"):
        interventions.evaluate(pairs, maps=lambda text: maps(text, nan=True))


@pytest.mark.parametrize("content, says", [("[" * 100_000 + "]" * 100_000, "its JSON nests too deeply to read"),
                                           ('{"pairs": [', "not UTF-8 JSON"), (b"\xff\xfe", "not UTF-8 JSON")],
                         ids=["nested", "truncated", "not_utf8"])
def test_winograd_data_files_that_cannot_be_read_name_the_file(tmp_path, content, says):
    path = tmp_path / "pairs.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    for load in (interventions.load_pairs, interventions.load_wsc273):
        with pytest.raises(ValueError, match=rf"pairs\.json: not a Winograd data file: {says}"):
            load(path)


# ----------------------------------------------------------------------------------------------------
# Winograd data: each malformed field named with its pair.
# ----------------------------------------------------------------------------------------------------


def _with(**changes):
    p = copy.deepcopy(PAIR)
    p.update(changes)
    return p


@pytest.mark.parametrize(
    "bad, message",
    [
        (list(PAIR.values()), r"pair 1 must be a dict with 'texts', 'candidates', 'substitutes' and 'answers', "
                              r"received list"),
        (_with(texts=[PAIR["texts"][0], 7]), r"pair 1: 'texts'\[1\] must be a string, received int"),
        (_with(candidates=[None, "suitcase"]), r"pair 1: 'candidates'\[0\] must be a phrase or \[phrase, occurrence\], "
                                                r"received None"),
        (_with(candidates=["trophy", "box"]), r"pair 1: 'candidates'\[1\] 'box' \(occurrence 0\) must occur as a "
                                              r"whole word before the pronoun of 'texts'\[0\]"),
        (_with(candidates=[["trophy", "0"], "suitcase"]), r"pair 1: 'candidates'\[0\]\[1\] \(the occurrence\) must "
                                                          r"be an int >= 0, received '0'"),
        (_with(candidates=["", "suitcase"]), r"pair 1: 'candidates'\[0\] must be a non-empty phrase"),
        (_with(substitutes=["the trophy", ""]), r"pair 1: 'substitutes'\[1\] must be a non-empty phrase"),
        (_with(substitutes=["the trophy", 3]), r"pair 1: 'substitutes'\[1\] must be a string, received int"),
        (_with(texts=[PAIR["texts"][0].replace("[it]", "[]"), PAIR["texts"][1]]),
         r"pair 1: the text must have a pronoun inside its \[brackets\], received 'texts'\[0\] = "),
    ],
    ids=["pair_is_list", "text_not_string", "candidate_none", "candidate_not_in_text", "occurrence_not_int",
         "candidate_empty", "substitute_empty", "substitute_not_string", "pronoun_empty"],
)
def test_winograd_pairs_are_refused_by_pair_and_field(bad, message):
    assert len(interventions.parse_pairs({"pairs": [PAIR]})) == 1  # the good pair parses
    with pytest.raises(ValueError, match=message):
        interventions.parse_pairs({"pairs": [PAIR, bad]})


def test_winograd_answers_must_be_the_ints_0_and_1():
    for answers in (["a", 0], [False, True]):
        with pytest.raises(ValueError, match=r"pair 0: 'answers' must be ints \(0 or 1\)"):
            interventions.parse_pairs({"pairs": [_with(answers=answers)]})
    with pytest.raises(ValueError, match=r"pair 0: the two sentences must have different answers"):
        interventions.parse_pairs({"pairs": [_with(answers=[1, 1])]})


# ----------------------------------------------------------------------------------------------------
# viz: tokens are text.
# ----------------------------------------------------------------------------------------------------

MATH_TOKENS = ["$\\foo$", " $5 and $6", "x_1^2"]


def _maps(L=1, N=2, n=3):
    w = np.random.default_rng(0).random((L, N, n, n))
    return w / w.sum(-1, keepdims=True)


def test_png_draws_dollar_signs_in_tokens_literally():
    m = _maps()
    fig = viz.grid_figure(m, MATH_TOKENS, title="cost: $\\alpha$")
    ax = fig.axes[0]
    labels = ax.get_xticklabels() + ax.get_yticklabels()
    assert "0 $\\foo$" in [t.get_text() for t in labels]
    assert all(not t.get_parse_math() and not t.get_usetex() for t in labels + [ax.title])
    for png in (viz.grid_png(m, MATH_TOKENS, title="$\\alpha$"),
                viz.pair_png(m[0, 0], m[0, 1], MATH_TOKENS, ["a", "$b$", "c"], names=("$x$", "B"), title="$\\x$"),
                interventions.heatmaps_png({"$\\foo$": np.ones((2, 2))}, title="$\\bar$")):
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match=r"title: expected a str, received int"):
        viz.grid_png(m, MATH_TOKENS, title=3)


def test_png_cuts_a_long_token_label_as_the_page_does():
    """A 2,000-character token is drawn as its first 19 characters and "…": the figure keeps its size."""
    long = ["a", "x" * 2000, "c"]
    fig = viz.grid_figure(_maps(), long)
    texts = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert "1 " + "x" * 19 + "\u2026" in texts and max(map(len, texts)) <= 22
    assert len(viz.grid_png(_maps(), long)) < 10 * len(viz.grid_png(_maps(), ["a", "b", "c"]))


def test_html_replaces_lone_surrogates_so_the_page_encodes():
    tokens = ["\udc80", "a\ud800b", "ok"]
    page = viz.html(_maps(), tokens, title="t\udcff", names=("A\udc80", "B"))
    page.encode("utf-8")  # the page always encodes
    run = viz.page_data(page)["runs"][0]
    assert run["keys"] == ["\ufffd", "a\ufffdb", "ok"] and run["name"] == "A\ufffd"
    assert viz.grid_png(_maps(), tokens)[:4] == b"\x89PNG"  # the PNG figures draw them as U+FFFD too


# ----------------------------------------------------------------------------------------------------
# jaxattn.nnx.MultiHeadAttention: Flax's API, its inputs checked.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: MultiHeadAttention(2, 8, rngs=nnx.Rngs(0), decode=False)(jnp.ones((2, 3, 8)), jnp.ones((2, 3, 5))),
         ValueError, r"inputs_k must have shape \[batch..., S, in_kv_features\] = \[2, S, 8\] .*received \(2, 3, 5\)"),
        (lambda: MultiHeadAttention(2, 8, rngs=nnx.Rngs(0), decode=False)(
            jnp.ones((2, 3, 8)), jnp.ones((2, 3, 8)), jnp.ones((2, 4, 8))),
         ValueError, r"inputs_v must have shape \(2, 3, 8\)"),
        (lambda: MultiHeadAttention(2, 8, in_kv_features=4, rngs=nnx.Rngs(0), decode=False)(jnp.ones((2, 3, 8))),
         ValueError, r"inputs_k is required"),
        (lambda: MultiHeadAttention(0, 8, rngs=nnx.Rngs(0)), ValueError, r"num_heads must be an int >= 1, received 0"),
        (lambda: MultiHeadAttention(2, 8, num_kv_heads=0, rngs=nnx.Rngs(0)), ValueError,
         r"num_kv_heads must be an int >= 1 or None, received 0"),
        (lambda: MultiHeadAttention(2, 8, precision="bogus", rngs=nnx.Rngs(0)), ValueError,
         r"precision must be None, a jax.lax.Precision, its name .*received 'bogus'"),
    ],
    ids=["inputs_k_features", "inputs_v_length", "self_attention_kv_features", "num_heads_zero", "num_kv_heads_zero",
         "precision_name"],
)
def test_nnx_multi_head_attention_refuses_bad_arguments_by_name(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_nnx_decode_past_the_cache_is_refused_eagerly_and_nan_under_jit():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 8)), jnp.float32)
    m = MultiHeadAttention(2, 8, rngs=nnx.Rngs(0), decode=True)
    m.init_cache((2, 3, 8))
    for _ in range(3):
        assert m(x).shape == (2, 1, 8)
    with pytest.raises(ValueError, match=r"decode: step index 3 is past the cache's length 3"):
        m(x)
    assert int(m.cache_index[...]) == 3  # the refused step changed nothing

    traced = MultiHeadAttention(2, 8, rngs=nnx.Rngs(0), decode=True)
    traced.init_cache((2, 3, 8))
    step = nnx.jit(lambda module, x: module(x))
    outs = [np.asarray(step(traced, x)) for _ in range(4)]
    assert all(np.all(np.isfinite(o)) for o in outs[:3]) and np.all(np.isnan(outs[3]))


def test_ids_masks_and_seeds_the_models_would_misread_are_refused_by_name():
    """train.forward: an id outside [0, n_vocab) refused when concrete, a NaN row (not another token's)
    when traced; bert.forward: a concrete mask with no real token refused, as the decoders do; a seed
    NumPy would refuse in its own words is named."""
    import jax

    from jaxattn import bert, train

    cfg = train.ModelConfig(n_vocab=80, n_ctx=15, d_model=16, num_heads=2, head_dim=8, num_layers=1)
    p = train.init_params(0, cfg)
    with pytest.raises(ValueError, match=r"^tokens must lie in \[0, n_vocab=80\), received values in \[1, 99\]$"):
        train.forward(p, np.array([1, 2, 99]), config=cfg)
    traced = jax.jit(lambda t: train.forward(p, t, config=cfg)[0])(jnp.array([1, 2, 99]))
    assert np.all(np.isnan(np.asarray(traced)[2])) and np.all(np.isfinite(np.asarray(traced)[:2]))
    config = bert.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=8, type_vocab_size=2, layer_norm_eps=1e-12)
    params = bert.init_params(0, config)
    with pytest.raises(ValueError, match=r"^attention_mask marks no real token \(all 3 entries are 0\)"):
        bert.forward(params, config, np.array([1, 2, 3]), attention_mask=np.zeros(3, np.int32))
    for seed, kind in ((-1, "-1"), (1.5, "1.5")):
        with pytest.raises(ValueError, match=rf"^seed must be an int >= 0, received {kind}$"):
            gpt2.init_params(seed, gpt2.GPT2Config.make(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
