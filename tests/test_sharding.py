"""Models on a ``jax.sharding`` mesh of host CPU devices equal the single-device models.

The main pytest process has one CPU device, so the checks run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=6`` (set before jax is imported), as in
``tests/test_ring.py``: running this file as a script with a group name (``fast`` or ``slow``) performs
that group's checks and prints one JSON line per check. The ``fast`` group (tiny random models on a
2 x 2 mesh) runs in ``make test``; the ``slow`` group (SmolLM2-135M on a 2 x 3 mesh, every family under
both axis types, an intervention table) under ``-m slow``. On the main process's one device the
argument checks of ``shard`` run directly.

Each check compares against the same computation on one device: ``max |sharded - single| <= 1e-5 *
max |single|`` for floats (``rel`` below), equality for tokens; and asserts the shardings of the params
and of the outputs, not only their values.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FAST = ["llama_explicit_forward", "core_general_mask_explicit"]
SLOW = [
    "llama_explicit_forward_log_prob_generate",
    "gpt2_explicit_forward_log_prob",
    "bert_explicit_forward",
    "llama_auto_forward_log_prob_generate",
    "gpt2_auto_forward_log_prob_generate",
    "gpt2_explicit_generate",
    "bert_auto_forward",
    "llama_gqa_qk_norm_explicit_forward",
    "split_vocab_explicit_forward",
    "llama_inside_shard_map_over_data",
    "smollm2_2x3_explicit_forward_log_prob_generate",
    "smollm2_2x3_auto_forward_log_prob_generate",
    "smollm2_load_streams_to_mesh",
    "tables_explicit",
    "tables_auto",
    "smollm2_2x3_ablation_table",
]


def _run(group):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=6").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, group], env=env, capture_output=True, text=True, cwd=root)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["check"]] = record
    results["_proc"] = proc
    return results


@pytest.fixture(scope="module")
def fast_results():
    return _run("fast")


@pytest.fixture(scope="module")
def slow_results():
    return _run("slow")


def _assert_check(results, check):
    proc = results["_proc"]
    assert check in results, f"check {check} did not report; subprocess stderr:\n{proc.stderr[-4000:]}"
    record = results[check]
    assert record["devices"] == 6
    assert record["ok"], record


@pytest.mark.parametrize("check", FAST)
def test_fast_mesh_check(fast_results, check):
    _assert_check(fast_results, check)


@pytest.mark.slow  # SmolLM2 on a 2 x 3 mesh and every family under both axis types: `make test-slow`
@pytest.mark.parametrize("check", SLOW)
def test_slow_mesh_check(slow_results, check):
    _assert_check(slow_results, check)


@pytest.mark.slow  # two processes joined by jax.distributed.initialize() (gloo) on this host's CPU: about 20 s
def test_two_processes_under_jax_distributed_equal_one_device():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "experiments" / "multihost.py"), "--model", "tiny",
                           "--processes", "2", "--devices-per-process", "2", "--mesh", "2x2", "--timeout", "300"],
                          capture_output=True, text=True, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-4000:]
    record = json.loads(lines[0])
    assert (record["processes"], record["devices"], record["local_devices"]) == (2, 4, 2)
    assert record["output_specs"] == ["P('data', None, None)", "P('data',)", "P('data', None)"]
    assert record["logits_rel_err"] <= 1e-5 and record["log_prob_rel_err"] <= 1e-5 and record["tokens_equal"], record


# ----------------------------------------------------------------------------------------------------
# shard's argument checks on the main process's one device
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_mesh():
    import jax

    return jax.make_mesh((1, 1), ("data", "model"))


def _tiny_llama(**kw):
    from jaxattn import llama

    config = llama.LlamaConfig.make(vocab_size=32, hidden_size=36, intermediate_size=18, num_hidden_layers=1,
                                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16, **kw)
    return llama.init_params(0, config), config


def test_a_table_refuses_no_data_axis_by_name(one_device_mesh):
    from jaxattn import interventions as iv
    from jaxattn import llama

    params, config = _tiny_llama()
    bound = iv.bind(llama, params, config, np.arange(5, dtype=np.int32))
    with pytest.raises(ValueError, match=r"data_axis must name an axis of the mesh \(its axes: 'data', 'model'\), "
                                         r"received None"):
        iv.ablation_effects(bound, lambda out: out.logits[-1, 0], mesh=one_device_mesh, data_axis=None)


def test_shard_on_one_device_places_every_weight(one_device_mesh):
    from jax.sharding import PartitionSpec as P

    from jaxattn import llama
    from jaxattn.checkpoint import flatten

    params, config = _tiny_llama()
    flat = flatten(llama.shard(params, config, one_device_mesh))
    assert flat["model/layers/self_attn/q_proj/kernel"].sharding.spec == P(None, None, "model")  # [L, D, N·H]
    assert flat["model/layers/self_attn/o_proj/kernel"].sharding.spec == P(None, "model", None)
    assert flat["model/layers/mlp/down_proj/kernel"].sharding.spec == P(None, "model", None)
    assert flat["model/norm/weight"].sharding.spec == P(None)
    for key, value in flatten(params).items():
        np.testing.assert_array_equal(np.asarray(flat[key]), np.asarray(value))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(model_axis="tensor"), ValueError, "the mesh has no axis 'tensor' (its axes: 'data', 'model'); name the axis to use with model_axis="),
    (dict(model_axis=3), TypeError, "model_axis must be a mesh axis name (str) or None, received 3"),
    (dict(split_vocab=1), TypeError, "split_vocab must be a bool, received 1"),
])
def test_shard_refuses_axes_the_mesh_does_not_have(one_device_mesh, kwargs, error, message):
    from jaxattn import llama

    params, config = _tiny_llama()
    with pytest.raises(error) as info:
        llama.shard(params, config, one_device_mesh, **kwargs)
    assert message in str(info.value)


def test_shard_refuses_a_mesh_that_is_not_a_mesh():
    from jaxattn import gpt2

    config = gpt2.GPT2Config.make(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    with pytest.raises(TypeError, match=r"jaxattn.gpt2.shard: mesh must be a jax.sharding.Mesh \(jax.make_mesh\), received tuple"):
        gpt2.shard(gpt2.init_params(0, config), config, (2, 2))


def _abstract_mesh(shape):
    """A concrete mesh needs the devices; the divisibility check only needs the axis sizes."""
    import jax

    devices = np.array([jax.devices()[0]] * int(np.prod(shape))).reshape(shape)
    return jax.sharding.Mesh(devices, ("data", "model"))


@pytest.mark.parametrize("model, message", [
    (2, "jaxattn.llama.shard: num_attention_heads=9 (heads) is not divisible by the size 2 of mesh axis 'model'; "
        "use a 'model' axis whose size divides 9 (1, 3, 9)"),
    (9, "num_key_value_heads=3 (kv_heads) is not divisible by the size 9 of mesh axis 'model'"),
])
def test_shard_names_the_size_the_model_axis_does_not_divide(model, message):
    from jaxattn import llama

    params, config = _tiny_llama()
    with pytest.raises(ValueError) as info:
        llama.shard(params, config, _abstract_mesh((1, model)))
    assert message in str(info.value)


def test_shard_names_the_vocabulary_it_cannot_split():
    from jaxattn import llama

    params, config = _tiny_llama()
    llama.param_shardings(config, _abstract_mesh((1, 3)))  # 9 heads, 3 kv heads: a model axis of 3 fits
    with pytest.raises(ValueError, match=r"vocab_size=32 \(vocab\) is not divisible by the size 3 of mesh axis "
                                         r"'model'; use a 'model' axis whose size divides 32 \(1, 2, 4, 8, 16, 32\), "
                                         "or split_vocab=False"):
        llama.shard(params, config, _abstract_mesh((1, 3)), split_vocab=True)


def test_shard_checks_the_params_first(one_device_mesh):
    from jaxattn import llama

    params, config = _tiny_llama()
    del params["model"]["norm"]
    with pytest.raises(ValueError, match="model/norm/weight"):
        llama.shard(params, config, one_device_mesh)


# ----------------------------------------------------------------------------------------------------
# load(..., mesh=) on one device: every format each loader streams, against the float32 load cast
# ----------------------------------------------------------------------------------------------------


def _expect_loaded(loaded, reference, module, config, mesh):
    import jax.numpy as jnp

    from jaxattn.checkpoint import flatten

    flat, ref = flatten(loaded), flatten(reference)
    assert flat.keys() == ref.keys()
    shardings = module.param_shardings(config, mesh)
    for key, value in flat.items():
        assert value.dtype == jnp.bfloat16 and value.sharding == shardings.get(key, value.sharding), key
        np.testing.assert_array_equal(np.asarray(value), np.asarray(jnp.asarray(ref[key], jnp.bfloat16)), err_msg=key)


@pytest.fixture(scope="module")
def tokenizer():
    from gpt2_checkpoints import train_tokenizer
    from jaxattn.checkpoint import TextTokenizer

    return TextTokenizer(train_tokenizer())


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_llama_load_onto_a_mesh_casts_and_places_each_tensor(fmt, tokenizer, tmp_path, one_device_mesh):
    import jax.numpy as jnp
    from llama_checkpoints import random_params, save_gguf

    from jaxattn import llama

    config = llama.LlamaConfig.make(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=8,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=16)
    params = random_params(0, config)
    if fmt == "gguf":
        path = save_gguf(tmp_path / "m.gguf", params, config, tokenizer.backend)
    else:
        path = llama.save(tmp_path / "m", params, config, tokenizer)
    reference, _, _ = llama.load(path)
    loaded, config2, _ = llama.load(path, dtype=jnp.bfloat16, mesh=one_device_mesh)
    assert config2 == config
    _expect_loaded(loaded, reference, llama, config, one_device_mesh)


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack"])
def test_gpt2_load_onto_a_mesh_casts_and_places_each_tensor(fmt, tokenizer, tmp_path, one_device_mesh):
    import jax.numpy as jnp

    from jaxattn import gpt2

    config = gpt2.GPT2Config.make(vocab_size=tokenizer.vocab_size, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    path = gpt2.save(tmp_path / "m", gpt2.init_params(0, config), config, tokenizer, format=fmt)
    reference, _, _ = gpt2.load(path)
    loaded, _, _ = gpt2.load(path, dtype=jnp.bfloat16, mesh=one_device_mesh)
    _expect_loaded(loaded, reference, gpt2, config, one_device_mesh)


def test_bert_load_onto_a_mesh_casts_and_places_each_tensor(one_device_mesh):
    import jax.numpy as jnp

    from jaxattn import bert

    reference, config, _ = bert.load()
    loaded, _, _ = bert.load(dtype=jnp.bfloat16, mesh=one_device_mesh)
    _expect_loaded(loaded, reference, bert, config, one_device_mesh)


def test_load_refuses_a_mesh_its_model_does_not_fit_before_reading_weights(tokenizer, tmp_path):
    from jaxattn import llama

    config = llama.LlamaConfig.make(vocab_size=tokenizer.vocab_size, hidden_size=18, intermediate_size=8,
                                    num_hidden_layers=1, num_attention_heads=3, max_position_embeddings=16)
    path = llama.save(tmp_path / "m", llama.init_params(0, config), config, tokenizer)
    (path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"jaxattn.llama.load: num_attention_heads=3 \(heads\) is not divisible by "
                                         r"the size 2 of mesh axis 'model'"):
        llama.load(path, mesh=_abstract_mesh((1, 2)))


# ----------------------------------------------------------------------------------------------------
# The checks themselves, run in the 6-device subprocess.
# ----------------------------------------------------------------------------------------------------


def _main(group):  # pragma: no cover - runs in the subprocess
    import time
    import traceback

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn import bert, gpt2, llama
    from jaxattn.checkpoint import flatten

    jax.config.update("jax_numpy_rank_promotion", "raise")
    devices = len(jax.devices())
    rng = np.random.default_rng(0)

    def mesh(shape, kind):
        n = int(np.prod(shape))
        return jax.make_mesh(shape, ("data", "model"), axis_types=(kind,) * 2, devices=jax.devices()[:n])

    def rel(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
        if not err <= 1e-5:
            raise AssertionError(f"{what}: max |sharded - single| / max |single| = {err:.3g} > 1e-5")
        return err

    def spec(x):
        s = x.sharding
        return tuple(s.spec) + (None,) * (x.ndim - len(s.spec))

    def expect_spec(x, want, what):
        got = spec(x)
        if got != tuple(want):
            raise AssertionError(f"{what}: sharding {got}, expected {tuple(want)}")

    def batch(B, T, V, pad=True):
        ids = rng.integers(0, V, (B, T)).astype(np.int32)
        mask = np.ones((B, T), bool)
        if pad:  # left padding of different lengths, so positions differ across the batch
            for b in range(B):
                mask[b, : b % 3] = False
        return ids, mask

    def on_data(m, *xs):
        return [jax.device_put(x, NamedSharding(m, P("data"))) for x in xs]

    def forward_fn(module, config, **kw):
        return jax.jit(jax.vmap(lambda p, i, m: module.forward(p, config, i, attention_mask=m, **kw), in_axes=(None, 0, 0)))

    def compare_forward(module, params, config, m, ids, mask, *, N, capture=("z",), causal=True):
        """The sharded forward of a batch against one device; outputs' shardings under Explicit axes."""
        ref = forward_fn(module, config, capture=capture)(params, ids, mask)
        sharded = module.shard(params, config, m)
        with jax.set_mesh(m):
            s_ids, s_mask = on_data(m, ids, mask)
            out = forward_fn(module, config, capture=capture)(sharded, s_ids, s_mask)
        errs = {}
        for name in ("logits", "last_hidden_state", "attentions") if causal else ("last_hidden_state", "attentions"):
            errs[name] = rel(getattr(out, name), getattr(ref, name), name)
        for name in capture:
            errs[name] = rel(out.captured[name], ref.captured[name], name)
        explicit = m.axis_types[0] == AxisType.Explicit
        if explicit:  # the documented output shardings (docs/scaling.md)
            if causal:
                expect_spec(out.logits, ("data", None, None), "logits")
            expect_spec(out.last_hidden_state, ("data", None, None), "last_hidden_state")
            expect_spec(out.attentions, ("data", None, "model", None, None), "attentions")
            for name in capture:
                heads = ("data", None, None, "model", None) if name in ("q", "k", "v", "z") else (
                    ("data", None, "model", None, None) if name in ("attn_logits", "attn_weights") else ("data",) + (None,) * 3)
                expect_spec(out.captured[name], heads, f"captured {name}")
        else:  # Auto axes: XLA's propagation keeps the batch split over data (and the maps' heads over model)
            for name in ("logits", "last_hidden_state") if causal else ("last_hidden_state",):
                assert getattr(out, name).sharding.spec[0] == "data", (name, getattr(out, name).sharding)
            assert tuple(out.attentions.sharding.spec)[:3] == ("data", None, "model"), out.attentions.sharding
        return sharded, errs

    def compare_log_prob(module, params, sharded, config, m, ids, mask):
        f = jax.jit(jax.vmap(lambda p, i, k, s: module.log_prob(p, config, i, attention_mask=k, start=s),
                             in_axes=(None, 0, 0, 0)))
        starts = np.arange(ids.shape[0], dtype=np.int32) % 3 + 1
        ref = f(params, ids, mask, starts)
        with jax.set_mesh(m):
            out = f(sharded, *on_data(m, ids, mask, starts))
        if m.axis_types[0] == AxisType.Explicit:
            expect_spec(out, ("data",), "log_prob")
        return rel(out, ref, "log_prob")

    def compare_generate(module, params, sharded, config, m, ids, mask, new=4):
        f = jax.jit(jax.vmap(lambda p, i, k: module.generate(p, config, i, attention_mask=k, max_new_tokens=new,
                                                             return_logits=True), in_axes=(None, 0, 0)))
        ref_tokens, ref_logits = f(params, ids, mask)
        with jax.set_mesh(m):
            tokens, logits = f(sharded, *on_data(m, ids, mask))
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
        if m.axis_types[0] == AxisType.Explicit:
            expect_spec(tokens, ("data", None), "generate tokens")
            expect_spec(logits, ("data", None, None), "generate logits")
        return rel(logits, ref_logits, "generate logits")

    def expect_param_specs(params, want):
        flat = flatten(params)
        for key, s in want.items():
            expect_spec(flat[key], s, key)

    # ---- tiny random models ----

    def tiny_llama(**kw):
        cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=32)
        config = llama.LlamaConfig.make(**{**cfg, **kw})
        return llama.init_params(1, config), config

    def tiny_gpt2():
        config = gpt2.GPT2Config.make(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
        return gpt2.init_params(1, config), config

    def tiny_bert():
        config = bert.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=24, max_position_embeddings=32, type_vocab_size=2,
                                 layer_norm_eps=1e-12)
        return bert.init_params(1, config), config

    def llama_checks(kind, params, config):
        m = mesh((2, 2), kind)
        ids, mask = batch(4, 10, config.vocab_size)
        sharded, errs = compare_forward(llama, params, config, m, ids, mask, N=config.num_attention_heads)
        expect_param_specs(sharded, {
            "model/layers/self_attn/q_proj/kernel": (None, None, "model"),
            "model/layers/self_attn/k_proj/kernel": (None, None, "model"),
            "model/layers/self_attn/o_proj/kernel": (None, "model", None),
            "model/layers/mlp/up_proj/kernel": (None, None, "model"),
            "model/layers/mlp/down_proj/kernel": (None, "model", None),
            "model/embed_tokens/embedding": (None, None),
            "model/norm/weight": (None,),
        })
        errs["log_prob"] = compare_log_prob(llama, params, sharded, config, m, ids, mask)
        errs["generate"] = compare_generate(llama, params, sharded, config, m, ids, mask)
        return errs

    def llama_explicit_forward_log_prob_generate():
        return llama_checks(AxisType.Explicit, *tiny_llama())

    def llama_explicit_forward():  # make test's one check: one layer, a padded batch of 2 on a 2 x 2 mesh
        params, config = tiny_llama(num_hidden_layers=1)
        m = mesh((2, 2), AxisType.Explicit)
        ids, mask = batch(2, 6, config.vocab_size)
        sharded, errs = compare_forward(llama, params, config, m, ids, mask, N=config.num_attention_heads)
        expect_param_specs(sharded, {"model/layers/self_attn/k_proj/kernel": (None, None, "model"),
                                     "model/layers/mlp/down_proj/kernel": (None, "model", None),
                                     "model/embed_tokens/embedding": (None, None)})
        return errs

    def core_general_mask_explicit():
        """The attention core under a caller's vmap over a batch split on an Explicit axis, with a general
        [T, S] keep-mask and a NaN in a value (JAX cannot vmap a loop of traced length there; the core's
        bookkeeping of kept non-finite values takes one product instead): equal to one device, the NaN in
        exactly the rows that keep its key."""
        import jaxattn

        m = mesh((4, 1), AxisType.Explicit)
        q, k, v = (rng.standard_normal((4, 6, 2, 8)).astype(np.float32) for _ in range(3))
        keep = rng.random((4, 1, 6, 6)) > 0.3
        keep[..., 0] = True
        v[1, 3, 0, 2] = np.nan
        calls = {"multi_head_attention": lambda q, k, v, m: jaxattn.multi_head_attention(q, k, v, mask=m)[0],
                 "multi_head_blockwise_attention": lambda q, k, v, m: jaxattn.multi_head_blockwise_attention(
                     q, k, v, mask=m, block_q=2, block_k=2)[0],
                 "attention": lambda q, k, v, m: jaxattn.attention(q[:, 0], k[:, 0], v[:, 0], mask=m[0])[0][:, None]}
        errs = {}
        for name, call in calls.items():
            f = jax.jit(jax.vmap(call))
            ref = np.asarray(f(q, k, v, keep))
            with jax.set_mesh(m):
                out = f(*(jax.device_put(x, NamedSharding(m, P("data"))) for x in (q, k, v, keep)))
            expect_spec(out, ("data", None, None, None), name)
            out = np.asarray(out)
            if not np.array_equal(np.isnan(out), np.isnan(ref)):
                raise AssertionError(f"{name}: NaN in other entries than on one device")
            errs[name] = rel(np.nan_to_num(out), np.nan_to_num(ref), name)
        if not np.isnan(ref[1, keep[1, 0, :, 3], 0, 2]).all() or np.isnan(ref[1, ~keep[1, 0, :, 3]]).any():
            raise AssertionError("the NaN value reaches exactly the rows that keep its key")
        return errs

    def llama_auto_forward_log_prob_generate():
        return llama_checks(AxisType.Auto, *tiny_llama())

    def llama_gqa_qk_norm_explicit_forward():  # Qwen3's per-head norms, biases (Qwen2), windows, Gemma 2 and 3
        errs = {}
        for kw in (dict(model_type="qwen3"), dict(model_type="qwen2", qkv_bias=True),
                   dict(model_type="mistral", sliding_window=4),
                   dict(model_type="gemma3_text", sliding_window=4, tie_word_embeddings=True, rope_local_base_freq=100.0,
                        layer_types=["sliding_attention", "full_attention"]),
                   dict(model_type="gemma2", sliding_window=4, tie_word_embeddings=True, attn_logit_softcapping=5.0,
                        final_logit_softcapping=3.0)):
            params, config = tiny_llama(**kw)
            m = mesh((2, 2), AxisType.Explicit)
            ids, mask = batch(2, 9, config.vocab_size)
            _, e = compare_forward(llama, params, config, m, ids, mask, N=4,
                                   capture=("q", "k", "v", "attn_logits", "attn_weights", "resid_mid", "mlp_out"))
            errs[kw["model_type"]] = e
        return errs

    def gpt2_explicit_forward_log_prob():
        params, config = tiny_gpt2()
        m = mesh((2, 2), AxisType.Explicit)
        ids, mask = batch(4, 10, config.vocab_size)
        sharded, errs = compare_forward(gpt2, params, config, m, ids, mask, N=4)
        errs["log_prob"] = compare_log_prob(gpt2, params, sharded, config, m, ids, mask)
        expect_param_specs(sharded, {
            "transformer/h/attn/c_attn/kernel": (None, "model", None), "transformer/h/attn/c_proj/kernel": (None, None, "model"),
            "transformer/h/mlp/c_fc/bias": (None, "model",), "transformer/wte/embedding": (None, None),
        })
        return errs

    def gpt2_explicit_generate():
        params, config = tiny_gpt2()
        m = mesh((2, 2), AxisType.Explicit)
        ids, mask = batch(4, 6, config.vocab_size)
        return compare_generate(gpt2, params, gpt2.shard(params, config, m), config, m, ids, mask)

    def gpt2_auto_forward_log_prob_generate():
        params, config = tiny_gpt2()
        m = mesh((2, 2), AxisType.Auto)
        ids, mask = batch(4, 6, config.vocab_size)
        sharded, errs = compare_forward(gpt2, params, config, m, ids, mask, N=4)
        errs["log_prob"] = compare_log_prob(gpt2, params, sharded, config, m, ids, mask)
        errs["generate"] = compare_generate(gpt2, params, sharded, config, m, ids, mask)
        return errs

    def bert_checks(kind):
        params, config = tiny_bert()
        m = mesh((2, 2), kind)
        ids, mask = batch(4, 10, config.vocab_size)
        sharded, errs = compare_forward(bert, params, config, m, ids, mask, N=4, causal=False)
        expect_param_specs(sharded, {
            "encoder/layer/0/attention/self/value/kernel": (None, "model"),
            "encoder/layer/0/attention/output/dense/kernel": ("model", None),
            "encoder/layer/0/intermediate/dense/kernel": (None, "model"),
            "encoder/layer/0/output/dense/kernel": ("model", None),
            "embeddings/word_embeddings/embedding": (None, None),
        })
        return errs

    def bert_explicit_forward():
        return bert_checks(AxisType.Explicit)

    def bert_auto_forward():
        return bert_checks(AxisType.Auto)

    def split_vocab_explicit_forward():
        params, config = tiny_llama()
        m = mesh((2, 2), AxisType.Explicit)
        ids, mask = batch(4, 8, config.vocab_size)
        ref = forward_fn(llama, config)(params, ids, mask)
        sharded = llama.shard(params, config, m, split_vocab=True)
        expect_param_specs(sharded, {"model/embed_tokens/embedding": ("model", None),
                                     "lm_head/kernel": (None, "model")})
        with jax.set_mesh(m):
            out = forward_fn(llama, config)(sharded, *on_data(m, ids, mask))
        expect_spec(out.logits, ("data", None, None), "logits")
        return rel(out.logits, ref.logits, "logits")

    def llama_inside_shard_map_over_data():  # the data axis Manual (the user's shard_map), the model axis Explicit
        params, config = tiny_llama()
        m = mesh((2, 2), AxisType.Explicit)
        ids, mask = batch(4, 8, config.vocab_size)
        ref = forward_fn(llama, config)(params, ids, mask)

        def local(p, i, k):  # this device group's rows
            return jax.vmap(lambda a, b: llama.forward(p, config, a, attention_mask=b).logits)(i, k)

        sharded = llama.shard(params, config, m)
        with jax.set_mesh(m):
            f = jax.jit(jax.shard_map(local, in_specs=(P(), P("data"), P("data")), out_specs=P("data"),
                                      axis_names={"data"}))
            out = f(sharded, *on_data(m, ids, mask))
        expect_spec(out, ("data", None, None), "logits")
        return rel(out, ref.logits, "logits")

    # ---- SmolLM2-135M on 2 x 3 (9 heads, 3 key/value heads) ----

    smol = {}

    def smollm2():
        if not smol:
            params, config, tok = llama.load()
            smol.update(params=params, config=config, tok=tok)
        return smol["params"], smol["config"], smol["tok"]

    def smollm2_batch(tok):
        from jaxattn.models import left_pad

        texts = ["The capital of France is", "One, two, three,", "def add(a, b):", "The trophy didn't fit in"]
        return [np.asarray(a) for a in left_pad([tok.encode(t) for t in texts])]

    def smollm2_checks(kind, generate_logits=True):
        params, config, tok = smollm2()
        m = mesh((2, 3), kind)
        ids, mask = smollm2_batch(tok)
        sharded, errs = compare_forward(llama, params, config, m, ids, mask, N=9, capture=())
        expect_param_specs(sharded, {
            "model/layers/self_attn/q_proj/kernel": (None, None, "model"),
            "model/layers/self_attn/v_proj/kernel": (None, None, "model"),
            "model/layers/mlp/down_proj/kernel": (None, "model", None),
        })
        shard_bytes = {d.id: 0 for d in m.devices.flat}
        for leaf in jax.tree.leaves(sharded):
            for s in leaf.addressable_shards:
                shard_bytes[s.device.id] += s.data.nbytes
        errs["bytes_per_device"] = sorted(set(shard_bytes.values()))
        errs["log_prob"] = compare_log_prob(llama, params, sharded, config, m, ids, mask)
        errs["generate"] = compare_generate(llama, params, sharded, config, m, ids, mask, new=6)
        return errs

    def smollm2_2x3_explicit_forward_log_prob_generate():
        return smollm2_checks(AxisType.Explicit)

    def smollm2_2x3_auto_forward_log_prob_generate():
        return smollm2_checks(AxisType.Auto)

    def smollm2_load_streams_to_mesh():
        params, config, _ = smollm2()
        m = mesh((2, 3), AxisType.Explicit)
        loaded, config2, _ = llama.load(dtype=jnp.bfloat16, mesh=m)
        assert config2 == config
        flat, ref = flatten(loaded), flatten(params)
        shardings = llama.param_shardings(config, m)
        for key, value in flat.items():
            if value.dtype != jnp.bfloat16 or value.sharding != shardings[key]:
                raise AssertionError(f"{key}: {value.dtype} {value.sharding}, expected bfloat16 {shardings[key]}")
            want = np.asarray(jnp.asarray(ref[key], jnp.bfloat16))
            np.testing.assert_array_equal(np.asarray(value), want, err_msg=key)
        return len(flat)

    # ---- intervention tables with mesh= ----

    def rel_table(a, b, clean, what):
        """A table's entries are differences of two metric values: float32 rounds them at about 1e-7 of the
        metric itself, so the scale is the larger of the table's largest entry and the clean metric."""
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(float(np.max(np.abs(b))), abs(float(clean)))
        err = float(np.max(np.abs(a - b))) / scale
        if not err <= 1e-5:
            raise AssertionError(f"{what}: max |mesh - one| / {scale:.3g} = {err:.3g} > 1e-5")
        return err

    def tables_checks(kind):
        from jaxattn import interventions as iv

        params, config = tiny_llama()
        m = mesh((2, 2), kind)
        ids, ids2 = (rng.integers(0, config.vocab_size, 7).astype(np.int32) for _ in range(2))

        def metric(out):
            return jax.nn.log_softmax(out.logits[-2])[ids[-1]]

        def _row_log_prob(logits, next_ids):  # the same metric from the second-to-last real token's row
            return jax.nn.log_softmax(logits[0])[next_ids[0]]

        one = iv.bind(llama, params, config, ids)
        source = iv.bind(llama, params, config, ids2)(capture=("z", "resid_pre"))
        sharded = llama.shard(params, config, m)
        on_mesh = iv.bind(llama, sharded, config, ids)
        clean = iv.metric_value(one, metric)
        errs = {}
        tables = {
            "ablation_effects": lambda b, **kw: iv.ablation_effects(b, metric, chunk=3, **kw),
            "patching_effects z": lambda b, **kw: iv.patching_effects(b, metric, source.captured["z"], **kw),
            "patching_effects resid_pre": lambda b, **kw: iv.patching_effects(
                b, metric, source.captured["resid_pre"], name="resid_pre", **kw),
            "gate_gradients": lambda b, **kw: iv.gate_gradients(b, metric, **kw),
            "attribution_patching": lambda b, **kw: iv.attribution_patching(b, metric, source.captured["z"], **kw),
            "layer_gradients": lambda b, **kw: iv.layer_gradients(b, metric, "z", **kw)[1],  # the gradient
            "attention_gradient": lambda b, **kw: iv.attention_gradient(b, metric, **kw),
        }
        for name, table in tables.items():
            ref, out = table(one), table(on_mesh, mesh=m)
            if out.shape != ref.shape or out.sharding.mesh != m or not out.sharding.is_fully_replicated:
                raise AssertionError(f"{name}: {out.shape} {out.sharding}, expected {ref.shape} replicated on the mesh")
            errs[name] = rel_table(out, ref, clean, name)
        lens, lens_m = iv.logit_lens(one, positions=[-2, -1]), iv.logit_lens(on_mesh, positions=[-2, -1], mesh=m)
        assert lens_m.sharding.mesh == m and lens_m.sharding.is_fully_replicated, lens_m.sharding
        errs["logit_lens"] = rel(lens_m, lens, "logit_lens")
        dla, dla_m = iv.logit_attribution(one, (3, 5)), iv.logit_attribution(on_mesh, (3, 5), mesh=m)
        assert dla.keys() == dla_m.keys(), (dla.keys(), dla_m.keys())
        errs["logit_attribution"] = max(rel_table(dla_m[k], dla[k], dla["total"], k) for k in dla)
        # a RowMetric's tables run on the prompt's bucket (7 tokens -> 8), on the mesh and with the params
        # placed on another device than the default one
        row = iv.RowMetric(_row_log_prob, (-2,))
        row_ref = iv.ablation_effects(one, row)
        errs["RowMetric ablation"] = rel_table(iv.ablation_effects(on_mesh, row, mesh=m), row_ref, clean, "RowMetric")
        errs["RowMetric equals the plain metric"] = rel_table(row_ref, iv.ablation_effects(one, metric), clean, "row")
        on_one = iv.bind(llama, jax.device_put(params, jax.devices()[1]), config, ids)
        errs["RowMetric, params on device 1"] = rel_table(iv.ablation_effects(on_one, row), row_ref, clean, "device 1")
        errs["logit_lens, params on device 1"] = rel(iv.logit_lens(on_one, positions=[-2, -1]), lens, "lens device 1")
        # head_scores of a sharded forward's maps (the ids follow the maps' batch split)
        batch_ids = rng.integers(0, 8, (4, 9)).astype(np.int32)  # a small vocabulary: repeated tokens
        maps = forward_fn(llama, config)(params, batch_ids, np.ones((4, 9), bool)).attentions
        with jax.set_mesh(m):
            maps_m = forward_fn(llama, config)(sharded, *on_data(m, batch_ids, np.ones((4, 9), bool))).attentions
        for kind in iv.HEAD_KINDS:
            scores, scores_m = iv.head_scores(maps, batch_ids, kind), iv.head_scores(maps_m, batch_ids, kind)
            if m.axis_types[0] == AxisType.Explicit:
                expect_spec(scores_m, ("data", None, "model"), f"head_scores {kind}")
            errs[f"head_scores {kind}"] = rel(scores_m, scores, kind)
        # params on one device are replicated onto the mesh; a batch of inputs under one mask
        errs["replicated params"] = rel_table(iv.ablation_effects(one, metric, mesh=m),
                                              iv.ablation_effects(one, metric), clean, "replicated params")
        both = np.stack([ids, ids2])

        def batch_metric(out):
            return jnp.sum(jax.vmap(lambda lg, t: jax.nn.log_softmax(lg[-2])[t])(out.logits, both[:, -1]))

        b_one, b_mesh = iv.bind(llama, params, config, both), iv.bind(llama, sharded, config, both)
        errs["batched ablation"] = rel_table(iv.ablation_effects(b_mesh, batch_metric, mesh=m),
                                             iv.ablation_effects(b_one, batch_metric),
                                             iv.metric_value(b_one, batch_metric), "batched ablation")
        # ids already split over "data" (docs/scaling.md's placement), no mask given: the mask follows them
        # (a metric with no vmap over a second, unsplit array: under Explicit axes both would need the split)
        def data_metric(out):
            return jnp.sum(jax.nn.log_softmax(out.logits[:, -2])[:, 3])

        b_data = iv.bind(llama, sharded, config, jax.device_put(both, NamedSharding(m, P("data"))))
        errs["batched ablation, ids on data, no mask"] = rel_table(
            iv.ablation_effects(b_data, data_metric, mesh=m), iv.ablation_effects(b_one, data_metric),
            iv.metric_value(b_one, data_metric), "ids on data")
        return errs

    def tables_explicit():
        return tables_checks(AxisType.Explicit)

    def tables_auto():
        return tables_checks(AxisType.Auto)

    def smollm2_2x3_ablation_table():  # 270 heads: 30 layers x 9, split over data=2, the model over model=3
        """Float32 rounds this table's entries at about 3e-5 of the metric (one device against float64), so
        equality within 1e-5 cannot hold for any other summation order; the check is that the mesh's table
        is as close to the float64 table as one device's (within 1.5 times), and the mesh-one difference is
        reported."""
        from jaxattn import interventions as iv

        params, config, tok = smollm2()
        m = mesh((2, 3), AxisType.Explicit)
        ids = np.asarray(tok.encode("The trophy didn't fit in the suitcase because it was too big."), np.int32)
        target = int(ids[-1])

        def metric(out):
            return jax.nn.log_softmax(out.logits[-2])[target]

        one = iv.bind(llama, params, config, ids)
        t0 = time.perf_counter()
        ref = np.asarray(iv.ablation_effects(one, metric, chunk=32), np.float64)
        t1 = time.perf_counter()
        out = iv.ablation_effects(iv.bind(llama, llama.shard(params, config, m), config, ids), metric, chunk=32, mesh=m)
        t2 = time.perf_counter()
        assert out.shape == (30, 9) and out.sharding.mesh == m and out.sharding.is_fully_replicated, out.sharding
        with jax.enable_x64(True):
            exact = np.asarray(iv.ablation_effects(iv.bind(llama, jax.tree.map(lambda x: jnp.asarray(x, jnp.float64),
                                                                               params), config, ids), metric, chunk=32))
        out = np.asarray(out, np.float64)
        scale = abs(float(iv.metric_value(one, metric)))
        one_err, mesh_err = np.max(np.abs(ref - exact)) / scale, np.max(np.abs(out - exact)) / scale
        if not mesh_err <= 1.5 * one_err:
            raise AssertionError(f"mesh table {mesh_err:.3g} from float64, one device's {one_err:.3g}")
        return dict(mesh_vs_one=float(np.max(np.abs(out - ref)) / scale), one_vs_float64=float(one_err),
                    mesh_vs_float64=float(mesh_err), seconds_one_device_with_compile=round(t1 - t0, 1),
                    seconds_mesh_with_compile=round(t2 - t1, 1))

    checks = {"fast": FAST, "slow": SLOW}.get(group) or group.split(",")
    for name in checks:
        t0 = time.perf_counter()
        try:
            detail = locals()[name]()
            ok = True
        except Exception:  # reported as a failed check with its traceback
            ok, detail = False, traceback.format_exc()[-3000:]
        print(json.dumps({"check": name, "ok": ok, "devices": devices, "detail": detail,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])

