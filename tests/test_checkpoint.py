"""Checkpoint loading: a table of broken checkpoints, each matched against its message; hub resolution
offline (never the network)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import serialization
from safetensors.numpy import load_file, save_file

from gpt2_checkpoints import edit_config, hf_model, save_checkpoint, train_tokenizer
from jaxattn import gpt2
from jaxattn.checkpoint import (
    CheckpointError,
    ConfigSchema,
    HubUnavailableError,
    check_shapes,
    read_config,
    resolve,
)

CONFIG = dict(n_layer=2, n_head=2, n_embd=16, n_positions=32)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Two good checkpoints of one tiny model (msgpack and safetensors) with a trained tokenizer."""
    tok = train_tokenizer()
    model = hf_model(seed=5, vocab_size=tok.get_vocab_size(), **CONFIG)
    root = tmp_path_factory.mktemp("good")
    return {
        "msgpack": save_checkpoint(root / "msgpack", model, weights="msgpack", tokenizer=tok),
        "safetensors": save_checkpoint(root / "safetensors", model, weights="safetensors", tokenizer=tok),
    }


def _edit_msgpack(d: Path, fn) -> None:
    path = d / "flax_model.msgpack"
    tree = serialization.msgpack_restore(path.read_bytes())
    fn(tree["transformer"])
    path.write_bytes(serialization.msgpack_serialize(tree))


def _edit_safetensors(d: Path, fn) -> None:
    path = d / "model.safetensors"
    tensors = dict(load_file(str(path)))
    fn(tensors)
    save_file(tensors, str(path))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _untie(t):
    t["lm_head.weight"] = t["transformer.wte.weight"] + 1.0


def _nan(t):
    bias = np.array(t["h"]["1"]["ln_2"]["bias"])
    bias[3] = np.nan
    t["h"]["1"]["ln_2"]["bias"] = bias


def _transpose_msgpack(t):
    t["h"]["1"]["mlp"]["c_fc"]["kernel"] = np.ascontiguousarray(t["h"]["1"]["mlp"]["c_fc"]["kernel"].T)


def _transpose_safetensors(t):
    t["transformer.h.0.attn.c_attn.weight"] = np.ascontiguousarray(t["transformer.h.0.attn.c_attn.weight"].T)


def _wider_wpe(t):
    t["wpe"]["embedding"] = np.zeros((33, 16), np.float32)


BROKEN = [
    # (id, format, how to break it, message)
    ("missing config", "msgpack", lambda d: (d / "config.json").unlink(),
     r"msgpack/config.json: file not found"),
    ("missing weights", "msgpack", lambda d: (d / "flax_model.msgpack").unlink(),
     r"msgpack: none of model.safetensors or flax_model.msgpack found"),
    ("missing tokenizer", "safetensors", lambda d: (d / "tokenizer.json").unlink(),
     r"none of tokenizer.json or vocab.json \+ merges.txt found"),
    ("wrong shape", "msgpack", lambda d: _edit_msgpack(d, _wider_wpe),
     r"flax_model.msgpack: weight 'transformer/wpe/embedding' has shape \(33, 16\), expected \(32, 16\)$"),
    ("transposed kernel (msgpack)", "msgpack", lambda d: _edit_msgpack(d, _transpose_msgpack),
     r"flax_model.msgpack: weight 'transformer/h/1/mlp/c_fc/kernel' has shape \(16, 64\), expected \(64, 16\) "
     r"\(it looks transposed; this file stores kernels as \(out, in\) \(Hugging Face Flax\)\)"),
    ("transposed kernel (safetensors)", "safetensors", lambda d: _edit_safetensors(d, _transpose_safetensors),
     r"model.safetensors: weight 'h.0.attn.c_attn.weight' has shape \(48, 16\), expected \(16, 48\) "
     r"\(it looks transposed; this file stores kernels as \(in, out\) \(PyTorch Conv1D\)\)"),
    ("missing key", "safetensors", lambda d: _edit_safetensors(d, lambda t: t.pop("transformer.ln_f.bias")),
     r"model.safetensors: missing weight 'ln_f.bias'"),
    ("unexpected key", "safetensors",
     lambda d: _edit_safetensors(d, lambda t: t.update({"transformer.h.0.attn.q_attn.weight": np.zeros(2, np.float32)})),
     r"model.safetensors: unexpected weight 'h.0.attn.q_attn.weight'"),
    ("untied head", "safetensors", lambda d: _edit_safetensors(d, _untie),
     r"model.safetensors: weight 'lm_head.weight' differs from 'wte.weight'; untied GPT-2 heads are not supported"),
    ("NaN weight", "msgpack", lambda d: _edit_msgpack(d, _nan),
     r"flax_model.msgpack: weight 'transformer/h/1/ln_2/bias' holds NaN or Inf"),
    ("unknown config field", "msgpack", lambda d: edit_config(d, rotary_dim=8),
     r"config.json: unsupported config field 'rotary_dim'"),
    ("unsupported config value", "msgpack", lambda d: edit_config(d, scale_attn_by_inverse_layer_idx=True),
     r"config.json: field 'scale_attn_by_inverse_layer_idx' = True is not supported \(supported: False\)"),
    ("unsupported activation", "msgpack", lambda d: edit_config(d, activation_function="mish"),
     r"config.json: field 'activation_function' = 'mish' is not supported"),
    ("config wrong type", "msgpack", lambda d: edit_config(d, n_head="2"),
     r"config.json: field 'n_head' must be int, found '2'"),
    ("config heads do not divide width", "msgpack", lambda d: edit_config(d, n_head=3),
     r"config.json: n_head=3 must divide n_embd=16"),
    ("config missing field", "msgpack",
     lambda d: (d / "config.json").write_text(json.dumps({k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "n_layer"})),
     r"config.json: required field 'n_layer' is missing"),
    ("config not JSON", "msgpack", lambda d: (d / "config.json").write_text("{n_layer: 2"),
     r"config.json: not valid JSON"),
    ("truncated msgpack", "msgpack", lambda d: _truncate(d / "flax_model.msgpack"),
     r"flax_model.msgpack: cannot read Flax msgpack file, truncated or corrupt\?"),
    ("truncated safetensors", "safetensors", lambda d: _truncate(d / "model.safetensors"),
     r"model.safetensors: cannot read safetensors file, truncated or corrupt\?"),
    ("corrupt tokenizer", "msgpack", lambda d: (d / "tokenizer.json").write_text("{}"),
     r"tokenizer.json: cannot read tokenizer file"),
]


@pytest.mark.parametrize("name, fmt, breaker, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_checkpoint_is_refused_with_its_message(good, tmp_path, name, fmt, breaker, message):
    directory = Path(shutil.copytree(good[fmt], tmp_path / fmt))
    gpt2.load(directory)  # the copy loads before it is broken
    breaker(directory)
    with pytest.raises(CheckpointError, match=message):
        gpt2.load(directory)
    assert issubclass(CheckpointError, ValueError)


def test_offline_hub_id_with_nothing_cached_gives_one_clear_error(offline_hub):
    with pytest.raises(CheckpointError) as info:
        gpt2.load("gpt2-medium")
    message = str(info.value)
    assert "cannot fetch 'gpt2-medium' from the Hugging Face hub and it is not in the local cache" in message
    assert "point at a local directory instead" in message
    assert "config.json; model.safetensors or flax_model.msgpack; tokenizer.json or vocab.json + merges.txt" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one error, not a chain
    assert isinstance(info.value, HubUnavailableError)  # the one case the lab may replace by its bundled encoder


def test_hub_id_served_from_the_cache_offline(good, offline_hub):
    """The hub path is the cached path: a snapshot laid out as huggingface_hub does loads offline."""
    commit = "0" * 40
    repo = offline_hub / "models--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(good["safetensors"], repo / "snapshots" / commit)
    params, config, tokenizer = gpt2.load("tiny-gpt2")
    ref, _, _ = gpt2.load(good["safetensors"])
    np.testing.assert_array_equal(params["transformer"]["wte"]["embedding"], ref["transformer"]["wte"]["embedding"])
    assert config.n_layer == 2 and tokenizer.vocab_size <= config.vocab_size


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_any_complete_cache_snapshot_loads_offline(good, offline_hub, fmt):
    """A snapshot with only one of the weight files (what FlaxGPT2LMHeadModel.from_pretrained leaves:
    config.json, flax_model.msgpack, tokenizer.json) loads: a file missing from the cache is skipped for
    the next option, not turned into the offline error."""
    commit = "1" * 40
    repo = offline_hub / "models--only-one"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(good[fmt], repo / "snapshots" / commit)
    weights = {"flax_model.msgpack", "model.safetensors"} & {p.name for p in (repo / "snapshots" / commit).iterdir()}
    assert weights == {"flax_model.msgpack" if fmt == "msgpack" else "model.safetensors"}
    params, _, _ = gpt2.load("only-one")
    ref, _, _ = gpt2.load(good[fmt])
    np.testing.assert_array_equal(params["transformer"]["wte"]["embedding"], ref["transformer"]["wte"]["embedding"])
    (repo / "snapshots" / commit / "tokenizer.json").unlink()  # incomplete: the offline error names what is needed
    with pytest.raises(HubUnavailableError, match="tokenizer.json or vocab.json"):
        gpt2.load("only-one")


@pytest.mark.parametrize(
    "name, message",
    [
        ("./no/such/dir", r"^\./no/such/dir: no such directory; pass a checkpoint directory or a hub id$"),
        ("/no/such/dir", r"^/no/such/dir: no such directory"),
        ("bad name!", r"^bad name!: no such directory"),
    ],
)
def test_paths_that_are_not_directories(offline_hub, name, message):
    with pytest.raises(CheckpointError, match=message):
        resolve(name, required=["config.json"])


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(CheckpointError, match=r"config.json: not a directory"):
        resolve(f, required=["config.json"])


SCHEMA = ConfigSchema(
    required={"width": int},
    optional={"eps": (float, 1e-5), "inner": ((int, type(None)), None)},
    fixed={"causal": (True,)},
    ignored=frozenset({"dropout"}),
)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"width": 4}, {"width": 4, "eps": 1e-5, "inner": None}),
        ({"width": 4, "eps": 1, "inner": 8, "causal": True, "dropout": 0.1},
         {"width": 4, "eps": 1, "inner": 8, "causal": True}),
    ],
)
def test_read_config_fills_defaults_and_drops_ignored(tmp_path, raw, expected):
    (tmp_path / "c.json").write_text(json.dumps(raw))
    assert read_config(tmp_path / "c.json", SCHEMA) == expected


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"width": True}, r"c.json: field 'width' must be int, found True"),  # JSON true is not an int
        ({"width": 4, "eps": "small"}, r"c.json: field 'eps' must be float, found 'small'"),
        ({"width": 4, "inner": 1.5}, r"c.json: field 'inner' must be int or null, found 1.5"),
        ({"width": 4, "causal": False}, r"c.json: field 'causal' = False is not supported \(supported: True\)"),
        ({"width": 4, "alibi": 1, "rope": 2}, r"c.json: unsupported config field 'alibi' \(and 'rope'\)"),
        ([1, 2], r"c.json: expected a JSON object, found list"),
    ],
)
def test_read_config_refuses(tmp_path, raw, message):
    (tmp_path / "c.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        read_config(tmp_path / "c.json", SCHEMA)


def test_read_config_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"c.json: config file not found"):
        read_config(tmp_path / "c.json", SCHEMA)


def test_check_shapes_names_dtype():
    with pytest.raises(CheckpointError, match=r"f.bin: weight 'a' has dtype int32, expected a floating dtype"):
        check_shapes({"a": np.zeros(3, np.int32)}, {"a": (3,)}, "f.bin")


def test_stack_layers_refuses_a_block_index_spelled_twice_and_unstack_layers_blocks_of_unequal_counts():
    """``0`` and ``00`` would both be block 0 (one silently overwriting the other); weights of 2 and 3 blocks
    would unstack to a block 2 holding some weights only."""
    from jaxattn.checkpoint import stack_layers, unstack_layers

    with pytest.raises(ValueError, match=r"^the blocks under 'm/layers' must be numbered 0\.\.L-1 without leading "
                                         r"zeros, found 'm/layers/00/w'$"):
        stack_layers({"m/layers/0/w": np.ones(2), "m/layers/00/w": np.zeros(2), "m/layers/1/w": np.ones(2)}, "m/layers")
    with pytest.raises(ValueError, match=r"^weight 'm/layers/v' must be stacked \[L, \.\.\.\] with L = 2 \(the blocks "
                                         r"of 'm/layers/w': every weight the same\), received shape \(3, 3\)$"):
        unstack_layers({"m/layers/w": np.ones((2, 3)), "m/layers/v": np.ones((3, 3))}, "m/layers")
    flat = {"m/layers/w": np.arange(6.0).reshape(2, 3), "m/layers/v": np.ones((2, 1)), "m/head": np.zeros(3)}
    back = stack_layers(unstack_layers(flat, "m/layers"), "m/layers")
    assert sorted(back) == sorted(flat)
    for key, value in flat.items():
        np.testing.assert_array_equal(back[key], value)
