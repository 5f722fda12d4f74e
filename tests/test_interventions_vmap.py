"""The tables are JAX functions of the prompt: ``jax.vmap`` and ``jax.jit`` over token ids (and attention
masks) of ``table(bind(module, params, config, ids), ...)`` equal a Python loop over the prompts.

A tiny random Llama (2 layers, 4 heads) built here; one padded prompt among three.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import interventions as I
from jaxattn import llama
from llama_checkpoints import random_params

CONFIG = llama.LlamaConfig.make(vocab_size=304, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
IDS = np.array([[3, 17, 5, 9, 22, 1, 4, 8], [5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
MASK = np.ones_like(IDS)
MASK[2, :2] = 0  # left padding


def metric(out):
    return out.logits[-1, 5] - out.logits[-1, 7]


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, random_params(0, CONFIG))


@pytest.fixture(scope="module")
def clean_z(params):
    return I.bind(llama, params, CONFIG, IDS[0])(capture=("z",)).captured["z"]


TABLES = {
    "ablation_effects": lambda b, z: I.ablation_effects(b, metric),
    "logit_lens": lambda b, z: I.logit_lens(b, positions=[-1]),
    "gate_gradients": lambda b, z: I.gate_gradients(b, metric),
    "ablation_effects_whole_forwards": lambda b, z: I.ablation_effects(b, metric, resume=False),
    "patching_effects": lambda b, z: I.patching_effects(b, metric, z),
    "attribution_patching": lambda b, z: I.attribution_patching(b, metric, z),
    "attention_gradient": lambda b, z: I.attention_gradient(b, metric),
    "logit_attribution": lambda b, z: I.logit_attribution(b, (5, 7))["heads"],
    "metric_value": lambda b, z: I.metric_value(b, metric),
    # a metric that declares its rows (the tables unembed the last row alone)
    "ablation_effects_logit_metric": lambda b, z: I.ablation_effects(b, I.LogitMetric(metric, (7,))),
}
FAST = ("ablation_effects", "logit_lens", "gate_gradients", "ablation_effects_logit_metric")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in TABLES])
def test_a_table_under_vmap_and_jit_over_prompts_equals_the_loop(params, clean_z, name):
    table = TABLES[name]
    loop = np.stack([np.asarray(table(I.bind(llama, params, CONFIG, ids, attention_mask=m), clean_z))
                     for ids, m in zip(IDS, MASK)])
    over = lambda p, ids, m: table(I.bind(llama, p, CONFIG, ids, attention_mask=m), clean_z)
    vmapped = jax.vmap(over, in_axes=(None, 0, 0))(params, IDS, MASK)
    jitted = jax.jit(jax.vmap(over, in_axes=(None, 0, 0)))(params, IDS, MASK)
    assert np.asarray(vmapped).shape == loop.shape
    np.testing.assert_allclose(np.asarray(vmapped), loop, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jitted), loop, rtol=1e-5, atol=1e-5)


def test_a_batched_bound_of_traced_ids_gives_its_concrete_tables(params):
    """A batched bound whose sequences share a prefix packs them when its ids are concrete; traced by a
    caller's jit (or vmapped over pairs of prompts), it runs the batch unpacked, to the same tables."""
    pairs = np.stack([IDS[:2], np.stack([IDS[1], IDS[1]])])  # [2 pairs, 2 sequences, T]; the second shares a prefix
    pairs[1, 1, 5:] = IDS[0, 5:]
    masks = np.ones_like(pairs)
    pair_metric = lambda out: out.logits[0, -1, 5] - out.logits[1, -1, 7]  # noqa: E731
    tables = {"ablation": lambda b: I.ablation_effects(b, pair_metric),
              "patch": lambda b: I.patching_effects(b, pair_metric, b(capture=("z",)).captured["z"][::-1])}
    for name, table in tables.items():
        over = lambda p, ids, m: table(I.bind(llama, p, CONFIG, ids, attention_mask=m))  # noqa: E731
        loop = np.stack([np.asarray(over(params, ids, m)) for ids, m in zip(pairs, masks)])
        assert np.abs(loop).max() > 1e-4, name  # the heads move the metric
        np.testing.assert_allclose(np.asarray(jax.jit(over)(params, pairs[1], masks[1])), loop[1],
                                   rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(jax.vmap(over, in_axes=(None, 0, 0))(params, pairs, masks)), loop,
                                   rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_table_warns_once_when_a_jit_closes_over_the_params(params, monkeypatch):
    """The tables' own jit hands the forward traced params, so ``bind`` itself warns when the caller's jit
    closes over concrete ones (each weight a constant of the compiled program); not with params as an
    argument, not under vmap alone."""
    import warnings

    from jaxattn import decoder

    monkeypatch.setattr(decoder, "_WARNED_CLOSED_OVER", [])
    table = lambda p, ids: I.ablation_effects(I.bind(llama, p, CONFIG, ids), metric)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(table).lower(params, IDS[0])  # params as an argument
        jax.vmap(lambda ids: table(params, ids))(IDS[:2])  # vmap compiles no closure
    with pytest.warns(UserWarning, match=r"jaxattn\.interventions\.bind is being traced by jax\.jit with the ids "
                                         r"traced but the params as concrete arrays.*jax\.jit\(lambda p, ids: "
                                         r"jaxattn\.interventions\.bind\(module, p, config, ids\)\)\(params, ids\)"):
        jax.jit(lambda ids: table(params, ids)).lower(IDS[0])


def test_bind_checks_traced_ids_by_dtype_and_shape(params):
    with pytest.raises(TypeError, match=r"input_ids must be integer token ids"):
        jax.vmap(lambda x: I.bind(llama, params, CONFIG, x).args["ids"])(IDS.astype(np.float32))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(8,\), received \(7,\)"):
        jax.vmap(lambda x, m: I.bind(llama, params, CONFIG, x, attention_mask=m).args["ids"])(IDS, MASK[:, :7])


@pytest.mark.slow  # make test-slow
def test_per_sequence_gives_each_sequence_of_a_batched_bound_its_own_table_equal_to_the_loop(params):
    """A batched bound's own table is one table of a batch metric; ``per_sequence`` gives one per sequence."""
    bound = I.bind(llama, params, CONFIG, IDS, attention_mask=MASK)
    z = jnp.roll(bound(capture=("z",)).captured["z"], 1, axis=0)  # [B, L, T, N, H]: each from another run
    tables = I.per_sequence(bound, lambda b, value: {"ablation": I.ablation_effects(b, metric),
                                                     "patch": I.patching_effects(b, metric, value)}, z)
    for name, table in tables.items():
        assert table.shape == (3, 2, 4), name
    for b, (ids, m) in enumerate(zip(IDS, MASK)):
        one = I.bind(llama, params, CONFIG, ids, attention_mask=m)
        for name, expected in (("ablation", I.ablation_effects(one, metric)),
                               ("patch", I.patching_effects(one, metric, z[b]))):
            assert np.abs(np.asarray(expected)).max() > 1e-4, name  # the heads move the metric
            np.testing.assert_allclose(np.asarray(tables[name][b]), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(tables["ablation"][0]), np.asarray(tables["ablation"][1]))  # its own


def test_per_sequence_refuses_what_it_cannot_split_by_name(params):
    bound = I.bind(llama, params, CONFIG, IDS, attention_mask=MASK)
    with pytest.raises(ValueError, match=r"^bound must be batched"):
        I.per_sequence(I.bind(llama, params, CONFIG, IDS[0]), lambda b: I.metric_value(b, metric))
    with pytest.raises(TypeError, match=r"^bound must be a Bound made by interventions.bind, received dict"):
        I.per_sequence({}, lambda b: I.metric_value(b, metric))
    with pytest.raises(TypeError, match=r"^table must be a function"):
        I.per_sequence(bound, "ablation_effects")
    with pytest.raises(ValueError, match=r"^per_sequence_args\[0\] must have a leading axis of the bound's B = 3 "
                                         r"sequences, received shape \(2, 8\)"):
        I.per_sequence(bound, lambda b, x: I.metric_value(b, metric), np.zeros((2, 8)))
