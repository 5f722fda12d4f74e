"""The small Transformer, its task, its training step and what it logs (tiny sizes)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import probes, train

TASK = train.RecallTask(num_pairs=3, num_queries=2, n_keys=4, n_values=4)
CONFIG = train.ModelConfig.for_task(TASK, d_model=16, num_heads=2, head_dim=8, num_layers=2)
OPT = train.OptConfig(total_steps=6, warmup_steps=1, batch_size=8)
STEP_OPT = train.OptConfig(total_steps=20, warmup_steps=1, batch_size=8, weight_decay=0.0)
L, N, T = CONFIG.num_layers, CONFIG.num_heads, TASK.length
B = 8  # every batch in this file, so that each compiled function is compiled once


@functools.partial(jax.jit, static_argnames=("config",))
def forward(params, tokens, scale=None, *, config=CONFIG):
    return train.forward(params, tokens, config=config, scale=scale)


@functools.partial(jax.jit, static_argnames=("config",))
def loss_fn(params, batch, scale=None, *, config=CONFIG):
    return train.loss_fn(params, batch, config=config, scale=scale)


@jax.jit
def step(state, batch, lr, scale):
    return train.train_step(state, batch, learning_rate=lr, scale=scale, config=CONFIG, opt=STEP_OPT)


@pytest.fixture(scope="module")
def history():
    """Two paired runs (same seed, scaled and unscaled) for OPT.total_steps steps."""
    return train.train(CONFIG, TASK, OPT, seeds=[3, 3], learning_rates=[1e-2, 1e-2], scales=[None, 1.0], chunk=3)


# ---------------------------------------------------------------------------------------------------
# The task.
# ---------------------------------------------------------------------------------------------------


def test_recall_batch_answers_are_the_values_of_the_queried_keys():
    batch = jax.device_get(train.recall_batch(0, TASK, B))
    P, Q, nk, nv = TASK.num_pairs, TASK.num_queries, TASK.n_keys, TASK.n_values
    assert batch["tokens"].shape == batch["targets"].shape == batch["loss_mask"].shape == (B, T)
    assert batch["tokens"].dtype == np.int32 and batch["loss_mask"].dtype == np.bool_
    np.testing.assert_array_equal(batch["loss_mask"].sum(axis=1), Q)
    for tokens, targets, mask in zip(batch["tokens"], batch["targets"], batch["loss_mask"]):
        np.testing.assert_array_equal(tokens[1:], targets[:-1])  # targets are the next tokens
        pairs = tokens[:P]
        keys, values = pairs // nv, pairs % nv
        assert np.all(pairs < nk * nv) and len(set(keys.tolist())) == P  # P pair tokens, distinct keys
        asked = tokens[mask] - nk * nv  # [Q] queried keys
        assert len(set(asked.tolist())) == Q
        for key, answer in zip(asked, targets[mask]):
            assert answer == nk * nv + nk + values[keys == key][0]


def test_recall_batch_is_a_function_of_its_key():
    a, b, c = (jax.device_get(train.recall_batch(s, TASK, B)) for s in (5, 5, 6))
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], c["tokens"])


# ---------------------------------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------------------------------


def test_forward_shapes_and_maps_are_causal_distributions():
    params = train.init_params(0, CONFIG)
    tokens = train.recall_batch(1, TASK, B)["tokens"][0]
    logits, captured = forward(params, tokens)
    assert logits.shape == (T, CONFIG.n_vocab)
    w = np.asarray(captured["weights"])
    assert w.shape == captured["attn_logits"].shape == (L, N, T, T)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert np.all(w[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)  # nothing from the future
    # scale=None is 1/sqrt(d_k): the same numbers as passing it explicitly.
    again, _ = forward(params, tokens, 1 / math.sqrt(CONFIG.head_dim))
    np.testing.assert_allclose(logits, again, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a training compile: make test-slow
def test_unscaled_initial_entropy_is_lower_than_scaled():
    """Probe consistency: the same params, the unscaled logits are √d_k larger, so the maps are sharper."""
    params = train.init_params(7, CONFIG)
    batch = train.recall_batch(8, TASK, B)
    causal = jnp.tril(jnp.ones((T, T), bool))
    ent = {}
    for name, scale in (("scaled", None), ("unscaled", 1.0)):
        _, aux = loss_fn(params, batch, scale)
        ent[name] = np.asarray(jnp.mean(probes.head_entropy(aux["weights"], causal), axis=0))  # [L, N]
    assert np.all(ent["unscaled"] < ent["scaled"]), ent
    # The scaled maps are close to uniform over the causal prefix: mean of log(t + 1) over rows.
    uniform = np.mean(np.log(np.arange(1, T + 1)))
    assert np.all(ent["scaled"] > 0.7 * uniform)


def test_qk_layernorm_adds_parameters_and_runs():
    config = train.ModelConfig.for_task(TASK, d_model=16, num_heads=2, head_dim=8, qk_layernorm=True)
    params = train.init_params(0, config)
    assert params["blocks"][0]["ln_q"]["scale"].shape == (8,)
    logits, captured = forward(params, train.recall_batch(0, TASK, B)["tokens"][0], 1.0, config=config)
    assert np.all(np.isfinite(logits)) and np.all(np.isfinite(captured["weights"]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tokens": np.zeros((2, 3), np.int32)}, ValueError, r"tokens must have shape \[T\]"),
        ({"tokens": np.zeros((T + 1,), np.int32)}, ValueError, r"T <= n_ctx"),
        ({"tokens": np.zeros((3,), np.float32)}, TypeError, "integer"),
        ({"logit_bias": np.zeros((1, N, 3, 3))}, ValueError, r"logit_bias must have shape \[L, N, T, T\]"),
    ],
)
def test_forward_rejects_bad_input(kwargs, error, match):
    args = {"tokens": np.zeros((3,), np.int32), **kwargs}
    params = train.init_params(0, CONFIG)
    with pytest.raises(error, match=match):
        train.forward(params, args.pop("tokens"), config=CONFIG, **args)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: train.RecallTask(num_pairs=5, n_keys=4), "num_pairs"),
        (lambda: train.RecallTask(num_pairs=3, num_queries=4), "num_queries"),
        (lambda: train.ModelConfig(head_dim=0), "head_dim"),
        (lambda: train.OptConfig(total_steps=10, warmup_steps=10), "warmup_steps"),
        (lambda: train.resolve_scale(-1.0, 16), "scale"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[0], learning_rates=[1e-3, 1e-3], scales=[None]), "same"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[0], learning_rates=[1e-3, 1e-3], remedies=["none"]),
         r"seeds, learning_rates and remedies must have"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[0, -1], learning_rates=[1e-3] * 2, scales=[None] * 2),
         r"seeds\[1\] must be an int in \[0, 2\*\*32\), received -1"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[2 ** 32], learning_rates=[1e-3], scales=[None]), r"seeds\[0\]"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[0.7], learning_rates=[1e-3], scales=[None]), r"seeds\[0\]"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[True], learning_rates=[1e-3], scales=[None]), r"seeds\[0\]"),
        (lambda: train.train(CONFIG, TASK, OPT, seeds=[0, 1], learning_rates=[1e-3, -1.0], scales=[None] * 2),
         r"learning_rates\[1\] must be a finite float >= 0"),
    ],
)
def test_configuration_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_resolve_scale():
    assert train.resolve_scale(None, 64) == 0.125
    assert train.resolve_scale(1.0, 64) == 1.0
    with pytest.raises(TypeError, match="scale"):
        train.resolve_scale("sqrt", 64)  # one vocabulary: None or a number, as in the core
    assert train.resolve_scale(0.5, 64) == 0.5


# ---------------------------------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a training compile: make test-slow
def test_train_step_decreases_the_loss_on_a_fixed_batch():
    batch = train.recall_batch(11, TASK, B)
    state = train.init_state(0, CONFIG, STEP_OPT)
    losses = []
    for _ in range(12):
        state, metrics = step(state, batch, 1e-2, 1 / math.sqrt(CONFIG.head_dim))
        losses.append(float(metrics["loss"]))
    assert losses[0] > 0.5  # the untrained model is far from the answers
    assert losses[1] == losses[0]  # step 0 is the warm-up's zero learning rate
    assert losses[-1] < losses[1] - 1.0, losses  # then it falls by more than a nat in 11 steps
    assert int(state["step"]) == 12


@pytest.mark.slow  # a training compile: make test-slow
def test_logged_series_are_finite_with_documented_shapes(history):
    C, steps = 2, OPT.total_steps
    expected = {
        "loss": (C, steps),
        "accuracy": (C, steps),
        "entropy": (C, steps, L, N),
        "max_weight": (C, steps, L, N),
        "max_logit": (C, steps, L, N),
        "logit_grad": (C, steps, L, N),
        "jacobian_frobenius": (C, steps, L, N),
        "grad_norm_wq": (C, steps, L),
        "grad_norm_wk": (C, steps, L),
        "grad_norm": (C, steps),
        "learning_rate": (C, steps),
    }
    assert set(expected) == set(train.METRICS)
    for name, shape in expected.items():
        assert history[name].shape == shape, name
        assert history[name].dtype == np.float32, name
        assert np.all(np.isfinite(history[name])), name
    np.testing.assert_allclose(history["scale"], [1 / math.sqrt(CONFIG.head_dim), 1.0])
    # Entropy is within [0, log T], accuracy within [0, 1], norms positive once gradients flow.
    assert np.all(history["entropy"] >= 0) and np.all(history["entropy"] <= math.log(T) + 1e-5)
    assert np.all((history["accuracy"] >= 0) & (history["accuracy"] <= 1))
    # The mean largest weight of a causal row lies between the uniform row's (mean of 1/(t+1)) and 1.
    assert np.all(history["max_weight"] >= np.mean(1 / np.arange(1, T + 1)) - 1e-6) and np.all(history["max_weight"] <= 1)
    assert np.all(history["grad_norm_wq"] > 0) and np.all(history["logit_grad"] > 0)
    # The schedule: zero at step 0 (warm-up), the peak at the end of warm-up.
    np.testing.assert_allclose(history["learning_rate"][:, 0], 0.0)
    np.testing.assert_allclose(history["learning_rate"][:, 1], 1e-2, rtol=1e-6)
    # Paired runs: the same seed, the same initial params and batch, so the first loss differs only by scale.
    assert history["loss"][0, 0] != history["loss"][1, 0]


@pytest.mark.slow  # a training compile: make test-slow
def test_same_seed_is_bit_for_bit_reproducible(history):
    again = train.train(CONFIG, TASK, OPT, seeds=[3, 3], learning_rates=[1e-2, 1e-2], scales=[None, 1.0], chunk=3)
    for name in train.METRICS:
        np.testing.assert_array_equal(history[name], again[name], err_msg=name)
    other = train.train(CONFIG, TASK, OPT, seeds=[4, 4], learning_rates=[1e-2, 1e-2], scales=[None, 1.0], chunk=3)
    assert not np.array_equal(history["loss"], other["loss"])


@pytest.mark.slow  # make test-slow: a second training program
def test_logit_grad_matches_the_gradient_at_a_zero_logit_bias():
    """The logged logit_grad is the probes' ∂loss/∂logits: check it against jax.grad of loss_fn directly."""
    state = train.init_state(2, CONFIG, STEP_OPT)
    batch = train.recall_batch(2, TASK, B)
    _, metrics = step(state, batch, 1e-3, 1.0)
    zeros = jnp.zeros((B, L, N, T, T))
    loss = lambda b: train.loss_fn(state["params"], batch, config=CONFIG, scale=1.0, logit_bias=b)[0]
    dz = jax.jit(jax.grad(loss))(zeros)
    np.testing.assert_allclose(metrics["logit_grad"], np.linalg.norm(dz, axis=-1).mean(axis=(0, 3)), rtol=1e-5)
    assert np.all(np.asarray(dz)[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)


def test_summarize():
    steps = 50
    loss = np.stack([np.linspace(3.0, 0.1, steps), np.full(steps, 2.0), np.linspace(3.0, 4.0, steps)]).astype(np.float32)
    loss[1, 10] = np.nan
    h = {
        "loss": loss,
        "accuracy": np.zeros((3, steps), np.float32),
        "entropy": np.ones((3, steps, 1, 1), np.float32),
        "max_logit": np.ones((3, steps, 1, 1), np.float32),
        "seed": np.array([0, 1, 2]),
        "learning_rate_peak": np.full(3, 1e-3),
        "scale": np.ones(3),
    }
    h["entropy"][0, 7] = 0.25
    rows = train.summarize(h, threshold=1.0, window=5)
    trailing = np.convolve(loss[0], np.ones(5) / 5, mode="valid")
    assert rows[0]["steps_to_threshold"] == int(np.flatnonzero(trailing <= 1.0)[0]) + 5
    assert rows[0]["diverged"] is False and rows[0]["min_entropy"] == 0.25
    assert rows[1]["diverged"] is True and rows[1]["steps_to_threshold"] is None  # a NaN
    assert rows[2]["diverged"] is True and rows[2]["steps_to_threshold"] is None  # ended above its start
    np.testing.assert_allclose(rows[0]["final_loss"], loss[0, -5:].mean(), rtol=1e-6)
