"""A :class:`jaxattn.interventions.RowMetric` reads the logits at chosen REAL tokens, so its tables do not
depend on the prompt's length: they run at the bucket's length, a new length inside a bucket compiles
nothing new (counted with ``jax.monitoring``'s backend-compile events), and the values equal a plain metric
of the same rows at the prompt's own length.

A tiny random Llama with sizes no other test file uses, so its programs are compiled here first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import bert, llama
from jaxattn import interventions as I
from llama_checkpoints import random_params

COMPILE = "/jax/core/compile/backend_compile_duration"
_EVENTS = []
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **k: _EVENTS.append(e) if e == COMPILE else None)

CONFIG = llama.LlamaConfig.make(vocab_size=307, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40)
ROWS = (-1, 2, -3)  # the last real token, the third, the third from the end


def fn(logits, next_ids):  # [R, V], [R]: a logit difference at the last token, plus the rows' log-probabilities
    scores = jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), jnp.maximum(next_ids, 0)]
    return logits[0, 5] - logits[0, 9] + 0.1 * jnp.sum(jnp.where(next_ids >= 0, scores, 0.0))


METRIC = I.RowMetric(fn, ROWS)


def ids_of(T):
    return ((np.arange(T) * 7 + 3) % 300).astype(np.int32)


def plain(T, mask=None):
    """The same metric written as a plain function of the whole output, for the prompt at its own length."""
    ids, keep = ids_of(T), np.ones(T, bool) if mask is None else np.asarray(mask, bool)
    real = np.flatnonzero(keep)
    k = [len(real) - 1, 2, len(real) - 3]
    rows = jnp.asarray(real[k])
    nxt = jnp.asarray([ids[real[i + 1]] if i + 1 < len(real) else -1 for i in k])
    return lambda out: fn(out.logits[rows], nxt)


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, random_params(3, CONFIG))


def _compiles(fn):
    n = len(_EVENTS)
    out = jax.block_until_ready(fn())
    return out, len(_EVENTS) - n


def _tables(bound, metric, every):
    if not every:
        return (I.ablation_effects(bound, metric), I.metric_value(bound, metric))
    return (I.ablation_effects(bound, metric), I.ablation_effects(bound, metric, resume=False),
            I.gate_gradients(bound, metric), I.metric_value(bound, metric))


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: make test-slow
def test_a_new_length_inside_a_bucket_compiles_nothing_new_for_a_row_metric_table(params, every):
    """``every=False``: the resumed ablation table and the metric's value; ``True`` adds the whole-forward
    ablation table and the gates' gradients, and compares at both lengths."""
    first = I.bind(llama, params, CONFIG, ids_of(11))
    assert first.bucket["ids"].shape == (16,) and first.args["ids"].shape == (11,)
    got11, n = _compiles(lambda: _tables(first, METRIC, every))
    assert n >= 1  # the counter sees compilations
    mask = np.arange(13) >= 2  # left padding: rows count real tokens
    again = I.RowMetric(fn, list(ROWS))  # an equal metric made anew shares the programs
    got13, n = _compiles(lambda: _tables(I.bind(llama, params, CONFIG, ids_of(13), attention_mask=mask), again, every))
    assert n == 0  # 13 tokens run in 11's bucket (16): neither bind nor the tables compile anything
    if every:
        _, n = _compiles(lambda: I.ablation_effects(I.bind(llama, params, CONFIG, ids_of(17)), METRIC))
        assert n >= 1  # 17: the next bucket (24)
    for T, m, got in ((11, None, got11), (13, mask, got13))[not every:]:  # equal to the plain metric at T rows
        bound = I.bind(llama, params, CONFIG, ids_of(T), attention_mask=m)
        want = _tables(bound, plain(T, m), every)
        for g, w in zip(got, want):
            assert np.shape(g) == np.shape(w)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-5)
        assert np.abs(np.asarray(got[0])).max() > 1e-3  # heads do move the metric


@pytest.mark.slow  # make test-slow
def test_a_row_metric_under_vmap_over_prompts_and_on_a_batched_bound_equals_the_loop(params):
    ids = np.stack([ids_of(12), ids_of(12)[::-1], (ids_of(12) + 5) % 300])
    mask = np.ones_like(ids, bool)
    mask[1, :3] = False  # left padding
    mask[2, -2:] = False  # right padding
    loop = [I.ablation_effects(I.bind(llama, params, CONFIG, i, attention_mask=m), METRIC) for i, m in zip(ids, mask)]
    over = jax.vmap(lambda i, m: I.ablation_effects(I.bind(llama, params, CONFIG, i, attention_mask=m), METRIC))
    np.testing.assert_allclose(np.asarray(over(ids, mask)), np.stack(loop), rtol=1e-5, atol=2e-5)
    # a batched bound: fn sees [B, R, V] and [B, R], each sequence's own real rows
    batched = I.RowMetric(lambda lg, nxt: jnp.sum(jax.vmap(fn)(lg, nxt)), ROWS)
    got = I.metric_value(I.bind(llama, params, CONFIG, ids, attention_mask=mask), batched)
    want = sum(float(I.metric_value(I.bind(llama, params, CONFIG, i, attention_mask=m), METRIC)) for i, m in zip(ids, mask))
    assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want))


@pytest.mark.slow  # make test-slow
def test_a_row_the_sequence_does_not_have_gives_nan(params):
    seen = {}

    def record(logits, next_ids):
        seen["shape"] = (logits.shape, next_ids.shape)
        return jnp.sum(logits[:, 0])

    bound = I.bind(llama, params, CONFIG, ids_of(6), attention_mask=np.arange(6) >= 1)  # 5 real tokens
    assert np.isfinite(float(I.metric_value(bound, I.RowMetric(record, (0, 4, -5)))))
    assert seen["shape"] == ((3, CONFIG.vocab_size), (3,))
    assert np.isnan(float(I.metric_value(bound, I.RowMetric(record, (5,)))))  # a sixth real token: none
    assert np.isnan(float(I.metric_value(bound, I.RowMetric(record, (-6,)))))


def test_row_metric_arguments_equality_and_an_encoder():
    assert I.RowMetric(fn, (-1, 2)) == I.RowMetric(fn, [-1, 2]) and hash(I.RowMetric(fn, (-1,))) == hash(I.RowMetric(fn, [-1]))
    assert I.RowMetric(fn, (-1,)) != I.RowMetric(lambda lg, n: fn(lg, n), (-1,)) and I.RowMetric(fn, (1,)) != I.RowMetric(fn, (2,))
    with pytest.raises(TypeError, match=r"^fn must be a function \(logits \[R, V\], next_ids \[R\]\) -> scalar, received int"):
        I.RowMetric(3, (-1,))
    for rows in ((), "ab", (1.0,), (True,), 3, np.array(3), np.zeros((1, 2), int)):
        with pytest.raises(ValueError, match=r"^rows must be a non-empty sequence of ints in"):
            I.RowMetric(fn, rows)
    config = bert.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=20, max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12)
    bound = I.bind(bert, bert.init_params(0, config), config, np.arange(6) % 50)
    assert bound.bucket is None  # an encoder's bound is never padded
    with pytest.raises(ValueError, match=r"^metric is a RowMetric, which reads a causal language model's logits"):
        I.metric_value(bound, I.RowMetric(fn, (-1,)))


@pytest.mark.slow  # make test-slow
def test_patching_tables_of_a_row_metric_run_in_the_bucket_and_equal_the_plain_metric(params):
    """Head patching (all positions, some positions, attention weights) and position patching of the stream:
    the patch value is padded to the bucket with the prompt, its padded rows never patched."""
    def source(T):
        return I.bind(llama, params, CONFIG, (ids_of(T) + 11) % 300)(capture=("z", "attn_weights", "resid_pre")).captured

    def tables(bound, metric, src, T):
        pos = np.arange(T) >= T - 4
        uniform = jnp.full((2, 4, T, 1), 1.0 / T, jnp.float32)  # a key axis of 1: uniform attention over T keys
        return (I.patching_effects(bound, metric, src["z"]), I.patching_effects(bound, metric, src["z"], positions=pos),
                I.patching_effects(bound, metric, src["attn_weights"], name="attn_weights"),
                I.patching_effects(bound, metric, uniform, name="attn_weights"),
                I.patching_effects(bound, metric, src["resid_pre"], name="resid_pre", positions=pos),
                I.patching_effects(bound, metric, src["resid_pre"], name="resid_pre"),  # every position
                I.joint_patching_effect(bound, metric, src["z"], [(0, 1), (1, 3)]),
                I.attribution_patching(bound, metric, uniform, name="attn_weights"))

    got = {}
    for T in (11, 13):
        src = source(T)  # the capture patched in: another input's forward at its own length
        jax.block_until_ready(jnp.full((2, 4, T, 1), 1.0 / T, jnp.float32))  # (an eager program per T, not the tables')
        got[T], n = _compiles(lambda: tables(I.bind(llama, params, CONFIG, ids_of(T)), METRIC, src, T))
        assert (n >= 1) if T == 11 else (n == 0)  # 13 runs in 11's bucket
    for T in (11, 13):
        want = tables(I.bind(llama, params, CONFIG, ids_of(T)), plain(T), source(T), T)
        for g, w in zip(got[T], want):
            assert np.shape(g) == np.shape(w) and np.abs(np.asarray(w)).max() > 1e-4
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-5)


@pytest.mark.slow  # make test-slow
def test_gradient_tables_of_a_row_metric_run_in_the_bucket_and_equal_the_plain_metric(params):
    """layer_gradients and attention_gradient are computed at the bucket's length and cut to the prompt's
    on the host; attribution_patching pads its value with the prompt."""
    def tables(bound, metric, z):
        x, g = I.layer_gradients(bound, metric, "resid_mid")
        return x, g, I.attention_gradient(bound, metric), I.attribution_patching(bound, metric, z)

    got = {}
    for T in (11, 13):
        z = I.bind(llama, params, CONFIG, (ids_of(T) + 11) % 300)(capture=("z",)).captured["z"]
        got[T], n = _compiles(lambda: tables(I.bind(llama, params, CONFIG, ids_of(T)), METRIC, z))
        assert (n >= 1) if T == 11 else (n == 0)  # 13 runs in 11's bucket
        want = tables(I.bind(llama, params, CONFIG, ids_of(T)), plain(T), z)
        for g, w in zip(got[T], want):
            assert np.shape(g) == np.shape(w) and np.abs(np.asarray(w)).max() > 1e-4
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-5)
    # params traced (vmap over two copies), ids concrete: the bucket's arrays are cut inside the program
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)
    over = jax.vmap(lambda p: tables(I.bind(llama, p, CONFIG, ids_of(13)), METRIC, z)[1:3])(stacked)
    for g, w in zip(over, got[13][1:3]):
        np.testing.assert_allclose(np.asarray(g), np.stack([w, w]), rtol=1e-5, atol=2e-5)


def test_the_lens_and_logit_attribution_run_in_the_bucket(params):
    """They read chosen positions (resolved on the host at the prompt's length), so they run on the bucket's
    inputs: a new length inside the bucket compiles nothing, and the values are those at the prompt's length."""
    got = {}
    for T in (11, 13):
        got[T], n = _compiles(lambda: (I.logit_lens(I.bind(llama, params, CONFIG, ids_of(T)), positions=[-1, 3]),
                                       I.logit_attribution(I.bind(llama, params, CONFIG, ids_of(T)), (5, 9))))
        assert (n >= 1) if T == 11 else (n == 0)
    lens = jax.jit(lambda p, i: I.logit_lens(I.bind(llama, p, CONFIG, i), positions=[-1, 3]))  # traced: T rows
    dla = jax.jit(lambda p, i: I.logit_attribution(I.bind(llama, p, CONFIG, i), (5, 9)))
    for T in (11, 13):
        np.testing.assert_allclose(got[T][0], lens(params, ids_of(T)), rtol=1e-5, atol=2e-5)
        want = dla(params, ids_of(T))
        for key, value in got[T][1].items():
            np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=2e-5, err_msg=key)


@pytest.mark.slow  # make test-slow
def test_concrete_ids_inside_a_callers_jit_and_a_patch_of_another_length(params):
    ids = ids_of(11)
    for metric in (METRIC, plain(11)):  # the ids concrete, the params traced by the caller's jit
        got = jax.jit(lambda p: I.metric_value(I.bind(llama, p, CONFIG, ids), metric))(params)
        assert abs(float(got) - float(I.metric_value(I.bind(llama, params, CONFIG, ids), metric))) <= 1e-5
    bound = I.bind(llama, params, CONFIG, jnp.asarray(ids), attention_mask=jnp.ones(11, jnp.int32))  # JAX arrays
    assert bound.bucket["ids"].shape == (16,) and isinstance(bound.args["ids"], jax.Array)
    z16 = jnp.zeros((2, 16, 4, 8), jnp.float32)  # the bucket's length, not the prompt's: refused as for a plain metric
    for metric in (METRIC, plain(11)):  # before anything runs, naming the value
        with pytest.raises(ValueError, match=r"^value must have the shape of the captured z, \(2, 11, 4, 8\) "
                                             r"\(or 1 along an axis; a batched bound's may lead with B\), received "
                                             r"\(2, 16, 4, 8\)"):
            I.patching_effects(bound, metric, z16)


class _Scorer:
    def metric(self, logits, next_ids):
        return logits[0, 0]


def test_row_metrics_of_one_bound_method_are_equal():
    s = _Scorer()
    assert I.RowMetric(s.metric, (-1,)) == I.RowMetric(s.metric, (-1,))
    assert hash(I.RowMetric(s.metric, (-1,))) == hash(I.RowMetric(s.metric, (-1,)))
    assert I.RowMetric(s.metric, (-1,)) != I.RowMetric(_Scorer().metric, (-1,))
    with pytest.raises(ValueError, match=r"^rows must be a non-empty sequence of ints in \[-2\*\*31, 2\*\*31\)"):
        I.RowMetric(fn, (2**31,))


def test_a_patch_value_with_a_layer_axis_of_one_is_the_same_value_at_every_layer(params):
    """A value ``[1, T, ...]`` patches each layer's head with that one value (as ``patch=`` reads a layer
    axis of 1): the tables equal those of the value broadcast to ``[L, T, ...]``, for a RowMetric in the
    bucket and for a plain metric; a value of the wrong shape is refused with the prompt's own shape."""
    T = 11
    bound = I.bind(llama, params, CONFIG, ids_of(T))
    z = I.bind(llama, params, CONFIG, (ids_of(T) + 11) % 300)(capture=("z",)).captured["z"]  # [L, T, N, H]
    one, every = np.asarray(z[1:2]), np.broadcast_to(np.asarray(z[1:2]), z.shape)
    for metric, kw in ((METRIC, {}), (plain(T), dict(resume=False))):
        got, want = I.patching_effects(bound, metric, one, **kw), I.patching_effects(bound, metric, every, **kw)
        assert got.shape == want.shape == (2, 4)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.all(np.abs(np.asarray(want)[0]) > 0)  # layer 0's heads are patched too
    np.testing.assert_allclose(I.joint_patching_effect(bound, METRIC, one, "all"),
                               I.joint_patching_effect(bound, METRIC, every, "all"), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"captured z, \(2, 11, 4, 8\)"):  # not the bucket's (2, 16, 4, 8)
        I.patching_effects(bound, METRIC, np.zeros((2, T, 4, 4), np.float32))
