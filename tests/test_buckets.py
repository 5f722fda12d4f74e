"""Concrete prompts run at their bucket's length (:func:`jaxattn.models.bucket_length`): a new prompt length
inside a bucket compiles no new forward, and the results are those of the prompt at its own length.

Compilations are counted with ``jax.monitoring``'s backend-compile events. The models are tiny random ones
built here, with sizes no other test file uses, so no other test has compiled their programs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import gpt2, llama, models
from llama_checkpoints import random_params

COMPILE = "/jax/core/compile/backend_compile_duration"
_EVENTS = []
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **k: _EVENTS.append(e) if e == COMPILE else None)

LLAMA = llama.LlamaConfig.make(vocab_size=301, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40)
GPT2 = gpt2.GPT2Config.make(vocab_size=299, n_positions=40, n_embd=24, n_layer=2, n_head=3)


@pytest.fixture(scope="module")
def models_():
    lp = jax.tree.map(jnp.asarray, random_params(1, LLAMA))
    gp = jax.tree.map(lambda w: jnp.asarray(w * 20 if w.ndim >= 2 else w), gpt2.init_params(1, GPT2))
    return {"llama": (llama, lp, LLAMA), "gpt2": (gpt2, gp, GPT2)}


def _compiles(fn):
    """``(fn(), the number of XLA compilations it ran)``."""
    n = len(_EVENTS)
    out = jax.block_until_ready(fn())
    return out, len(_EVENTS) - n


def test_bucket_lengths():
    assert [models.bucket_length(t) for t in (1, 8, 9, 11, 13, 16, 17, 64, 65, 100, 128, 129, 1000)] == \
        [8, 8, 16, 16, 16, 16, 24, 64, 72, 104, 128, 144, 1024]
    assert models.bucket_length(990, 1000) == 1000 and models.bucket_length(1100, 1024) == 1100
    for T in range(1, 2049):  # never shorter, and less than an eighth of T (or 8 tokens) of padding
        B = models.bucket_length(T)
        assert T <= B < T + max(8, T / 8)
    with pytest.raises(ValueError, match=r"^T must be a positive int, received 0"):
        models.bucket_length(0)


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])  # gpt2: make test-slow
def test_a_new_length_inside_a_bucket_compiles_no_new_forward_or_log_prob(models_, name):
    module, params, config = models_[name]
    ids = lambda T: (np.arange(T) * 7 + 3) % 290  # noqa: E731
    _, first = _compiles(lambda: module.forward(params, config, ids(11)).logits)
    assert first >= 1  # the forward: the counter sees compilations
    _, n = _compiles(lambda: module.forward(params, config, ids(13)).logits)
    assert n == 0  # the forward is the bucket's; the cut to 13 rows is a host copy (CPU)
    _compiles(lambda: module.log_prob(params, config, ids(11), start=3))
    _, n = _compiles(lambda: module.log_prob(params, config, ids(13), start=3))
    assert n == 0  # a scalar: nothing to cut
    _, n = _compiles(lambda: module.log_prob(params, config, ids(15), start=5, attention_mask=np.arange(15) >= 2))
    assert n == 0
    _, n = _compiles(lambda: module.log_prob(params, config, ids(17), start=3))  # 17: the next bucket, 24
    assert n >= 1


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])  # gpt2: make test-slow
def test_bucketed_results_are_those_of_the_prompt_at_its_own_length(models_, name):
    module, params, config = models_[name]
    T = 13
    ids = (np.arange(T) * 5 + 1) % 290
    mask = np.arange(T) >= 3  # left padding too
    kw = dict(attention_mask=mask, return_attention_logits=True, return_hidden_states=True, return_qkv=True,
              capture=("z", "resid_post", "attn_weights"))
    bucketed = module.forward(params, config, ids, **kw)
    exact = jax.jit(lambda p, i: module.forward(p, config, i, **kw))(params, ids)  # traced ids: T rows
    assert bucketed.logits.shape == exact.logits.shape == (T, config.vocab_size)
    for field in ("logits", "last_hidden_state", "attentions", "attention_logits", "hidden_states", "q", "k", "v"):
        a, b = np.asarray(getattr(bucketed, field)), np.asarray(getattr(exact, field))
        assert a.shape == b.shape, field
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=field)
    assert sorted(bucketed.captured) == ["attn_weights", "resid_post", "z"]
    for site in bucketed.captured:
        assert bucketed.captured[site].shape == exact.captured[site].shape, site
        np.testing.assert_allclose(bucketed.captured[site], exact.captured[site], rtol=1e-5, atol=1e-6, err_msg=site)
    for start, end in ((3, None), (5, 11)):
        got = module.log_prob(params, config, ids, attention_mask=mask, start=start, end=end)
        want = jax.jit(lambda p, i: module.log_prob(p, config, i, attention_mask=mask, start=start, end=end))(params, ids)
        assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
        assert np.isfinite(float(got)) and float(got) < 0


@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_patched_forward_runs_bucketed_like_the_unpatched_one(models_, name):
    """A patch is padded with the prompt (no padded row patched): a zero patch of a head's z is exactly
    that head's ablation, and patches of full-length and broadcast values equal the exact-length forward's."""
    module, params, config = models_[name]
    T = 11
    ids, other = (np.arange(T) * 3 + 2) % 290, (np.arange(T) * 11 + 1) % 290
    L, N = module.SPEC.sizes(config).layers, module.SPEC.sizes(config).heads
    source = module.forward(params, config, other, capture=("z", "attn_weights"))
    where = np.zeros((L, 1, N, 1), bool)
    where[1, 0, 1, 0] = True
    rows = np.zeros((L, T, 1, 1), bool)
    rows[0, 4:] = True
    hm = np.ones((L, N), np.float32)
    hm[1, 1] = 0.0
    ablated = module.forward(params, config, ids, head_mask=hm).logits
    zero = module.forward(params, config, ids, patch={"z": (np.zeros(where.shape, np.float32), where)}).logits
    np.testing.assert_array_equal(zero, ablated)
    for patch in ({"z": (source.captured["z"], rows)},
                  {"attn_weights": (source.captured["attn_weights"], np.ones((L, 1, 1, 1), bool))}):
        got = module.forward(params, config, ids, patch=patch, capture=("resid_post",))
        want = jax.jit(lambda p, i: module.forward(p, config, i, patch=patch, capture=("resid_post",)))(params, ids)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.captured["resid_post"], want.captured["resid_post"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"patch\['z'\] value must have shape \(2, 11, "):  # the real length
        module.forward(params, config, ids, patch={"z": (np.zeros((L, 16, N, 8), np.float32), where)})


def test_a_prompt_that_fills_its_bucket_or_the_model_runs_as_it_is(models_):
    module, params, config = models_["llama"]
    for T in (16, 40):  # a bucket's own length; the longest input (its bucket would pass the model's length)
        out = module.forward(params, config, np.arange(T) % 290)
        assert out.logits.shape == (T, config.vocab_size) and out.attentions.shape[-2:] == (T, T)
    with pytest.raises(ValueError, match=r"input_ids must hold 1 to max_position_embeddings=40 tokens, received T=41"):
        module.forward(params, config, np.arange(41) % 290)


@pytest.mark.parametrize("off_host", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: make test-slow
def test_the_cut_on_the_host_equals_the_compiled_cut(models_, monkeypatch, off_host):
    """Small outputs on CPU are cut by NumPy views (nothing compiled); larger ones, or outputs off the host,
    by a small compiled program per length (decoder._cut): the same arrays, on the same device."""
    from jaxattn import decoder

    module, params, config = models_["llama"]
    ids = lambda T: (np.arange(T) * 7 + 3) % 290  # noqa: E731
    kw = dict(return_hidden_states=True, return_qkv=True, return_attention_logits=True, capture=("z",))
    host = module.forward(params, config, ids(11), **kw)
    if off_host:
        monkeypatch.setattr(decoder, "_in_host_memory", lambda a: False)
    else:
        monkeypatch.setattr(decoder, "HOST_CUT_BYTES", 0)  # every output "large"
    compiled = module.forward(params, config, ids(11), **kw)
    T = 12 if off_host else 10  # a length whose cut no other case compiles
    _, n = _compiles(lambda: module.forward(params, config, ids(T), **kw).logits)
    assert n == 1  # the cut to T rows, compiled
    for field in ("logits", "last_hidden_state", "attentions", "attention_logits", "hidden_states", "q", "k", "v"):
        a, b = getattr(host, field), getattr(compiled, field)
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding, field
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)
    assert host.captured.keys() == compiled.captured.keys() == {"z"}
    np.testing.assert_array_equal(host.captured["z"], compiled.captured["z"])


@pytest.mark.slow  # make test-slow (make test's time)
def test_generate_runs_a_prompt_at_its_bucket_and_a_new_length_compiles_nothing(models_):
    module, params, config = models_["llama"]
    ids = lambda T: (np.arange(T) * 5 + 2) % 290  # noqa: E731
    exact = jax.jit(lambda p, i: module.generate(p, config, i, max_new_tokens=4, return_logits=True))  # traced ids
    for T in (11, 3):  # bucket 16; a prompt of at most PROMPT_ROWS = 8 tokens runs at its own length
        got, logits = module.generate(params, config, ids(T), max_new_tokens=4, return_logits=True)
        want, want_logits = exact(params, ids(T))
        assert got.shape == (T + 4,) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    _, n = _compiles(lambda: module.generate(params, config, ids(13), max_new_tokens=4, return_logits=True)[0])
    assert n == 0  # 13 tokens: bucket 16, as 11's
    mask = np.arange(12) >= 2  # left padding and the bucket's right padding together
    got = module.generate(params, config, ids(12), attention_mask=mask, max_new_tokens=4)
    np.testing.assert_array_equal(got[12:], module.generate(params, config, ids(12)[2:], max_new_tokens=4)[10:])
    with pytest.raises(ValueError, match=r"prompt_ids T=38 plus max_new_tokens=4 exceeds max_position_embeddings=40"):
        module.generate(params, config, ids(38), max_new_tokens=4)


def test_an_attention_patch_with_a_key_axis_of_one_weighs_no_padded_key(models_):
    """A patch of attn_weights broadcast over the keys (``[L, N, T, 1]``) gives the bucketed forward the
    weights of the forward at the prompt's own length: the key axis is broadcast to T before the padding."""
    module, params, config = models_["llama"]
    T, L, N = 11, 2, 4
    ids = (np.arange(T) * 3 + 2) % 290
    patch = {"attn_weights": (np.full((L, N, T, 1), 1.0 / T, np.float32), np.ones((L, 1, 1, 1), bool))}
    got = module.forward(params, config, ids, patch=patch).logits  # bucketed: 16 rows
    want = jax.jit(lambda p, i: module.forward(p, config, i, patch=patch).logits)(params, ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # a second length inside the bucket compiles one small program that pads the patch (and no forward);
    # a broadcast and a pad compiled apart for each array of the patch made it five
    T2 = 13
    patch2 = {"attn_weights": (np.full((L, N, T2, 1), 1.0 / T2, np.float32), np.ones((L, 1, 1, 1), bool))}
    _, n = _compiles(lambda: module.forward(params, config, (np.arange(T2) * 3 + 2) % 290, patch=patch2).logits)
    assert 1 <= n <= 2


def test_a_first_call_compiles_the_model_program_alone(models_):
    """The checks and conversions of the inputs (ids, the mask, the head mask, the scale) run on the host:
    the first forward, log_prob and generate of a config compile their model program and nothing else
    (each small eager conversion was a program of its own, about 0.1 s of a first call on CPU)."""
    module, params, config = models_["llama"]
    config = config._replace(rope_theta=12345.0)  # a config no other test uses: its programs are new
    ids = (np.arange(9) * 5 + 1) % 290
    mask = np.arange(9) >= 1
    _, n = _compiles(lambda: module.forward(params, config, ids, attention_mask=mask, scale=0.3).logits)
    assert n == 1
    _, n = _compiles(lambda: module.log_prob(params, config, ids, start=2))
    assert n == 1
    _, n = _compiles(lambda: module.generate(params, config, ids[:5], max_new_tokens=3))
    assert n == 1


def test_a_first_table_compiles_its_programs_alone(models_):
    """The tables build their small arrays on the host and assemble in one jitted program: the first
    resumed ablation table of a config compiles its three programs (the clean prefix, the resumed batches,
    the assembly; eagerly, the assembly alone was a dozen), the gates' gradients and the lens one each."""
    from jaxattn import interventions as I
    module, params, config = models_["llama"]
    config = config._replace(rope_theta=54321.0)  # a config no other test uses: its programs are new
    bound = I.bind(module, params, config, (np.arange(9) * 5 + 1) % 290)
    _, n = _compiles(lambda: I.ablation_effects(bound, lambda out: out.logits[-1, 3] - out.logits[-1, 5]))
    assert 1 <= n <= 3
    metric = I.RowMetric(lambda logits, nxt: logits[0, 3] - logits[0, 5], (-1,))
    _, n = _compiles(lambda: I.gate_gradients(bound, metric))
    assert n == 1
    _, n = _compiles(lambda: I.logit_lens(bound, positions=(-1,)))
    assert n == 1
