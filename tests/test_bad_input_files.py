"""Files and arguments that claim more than they hold: checkpoint sizes checked against the file before
anything is allocated, shard names kept inside the checkpoint, GGUF head counts named, causal offsets of
any size, an unusable compilation cache, and output folders checked before a script does any work."""

import json
import os
import re
import runpy
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxattn
from gpt2_checkpoints import train_tokenizer
from jaxattn import _gguf, llama
from jaxattn import io as jio
from jaxattn.checkpoint import CheckpointError, check_layer_count, resolve, safetensors_names, weight_names
from llama_checkpoints import edit_config, gguf_tensors, llama_metadata, random_params, save_hf, tokenizer_metadata, write_gguf

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def config(tok):
    # 2 layers, 4 query heads over 2 key/value heads, D = 32 (H = 8)
    return llama.LlamaConfig.make(vocab_size=tok.get_vocab_size() + 4, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=16, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def gguf_parts(tok, config):
    return {**llama_metadata(config), **tokenizer_metadata(tok)}, gguf_tensors(random_params(0, config), config)


@pytest.fixture(scope="module")
def gguf_bytes(gguf_parts, tmp_path_factory):
    meta, tensors = gguf_parts
    return write_gguf(tmp_path_factory.mktemp("gguf") / "whole.gguf", meta, tensors).read_bytes()


@pytest.fixture(scope="module")
def hf_dir(tok, config, tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hf"), random_params(0, config), config, tok)


def _tree(root):
    """Every path under ``root`` (files and folders, hidden ones included), relative."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


# ----------------------------------------------------------------------------------------------------
# Claimed sizes checked against the file before anything is allocated
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [10**9, 3, 1])
def test_gguf_block_count_other_than_the_files_blocks_is_refused_by_name(gguf_parts, tmp_path, blocks):
    meta, tensors = gguf_parts
    path = write_gguf(tmp_path / "blocks.gguf", {**meta, "llama.block_count": blocks}, tensors)
    with pytest.raises(CheckpointError, match=rf"blocks\.gguf: metadata key 'llama\.block_count' = {blocks}, but the file "
                                              r"holds the tensors of 2 blocks \(blk\.0 to blk\.1\)"):
        llama.load(path)


def test_gguf_tensors_read_for_a_config_of_other_depth_are_refused_before_the_table_is_built(gguf_bytes, tmp_path, config):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes)
    reader = _gguf.open_gguf(path)
    with pytest.raises(CheckpointError, match=r"m\.gguf: the config's num_hidden_layers = 1000000000, but the file holds "
                                              r"the tensors of 2 blocks"):
        _gguf.read_llama_tensors(reader, path, config._replace(num_hidden_layers=10**9))


def _array_length_at(data: bytes, key: bytes) -> int:
    """Offset of the uint64 length of the array value of metadata ``key``: key, value type, item type, length."""
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 9  # an array
    return at + 8


@pytest.mark.parametrize("key, least", [("tokenizer.ggml.token_type", 4), ("tokenizer.ggml.tokens", 8),
                                        ("tokenizer.ggml.merges", 8)])
def test_gguf_array_length_past_the_files_end_is_refused_before_the_reader_runs(gguf_bytes, tmp_path, monkeypatch, key, least):
    import gguf

    at = _array_length_at(gguf_bytes, key.encode())
    path = tmp_path / "array.gguf"
    path.write_bytes(gguf_bytes[:at] + struct.pack("<Q", 2**32) + gguf_bytes[at + 8:])
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the reader was handed the claimed length"))
    with pytest.raises(CheckpointError, match=rf"array\.gguf: cannot read GGUF file, truncated or corrupt\? \(metadata key "
                                              rf"'{key}' claims an array of 4294967296 items, at least {least * 2**32} bytes, "
                                              r"but the file ends \d+ bytes later\)"):
        llama.load(path)


@pytest.mark.parametrize("offset, value, says", [
    (8, 2**40, r"the header claims 1099511627776 tensors and \d+ metadata keys"),
    (16, 2**33, r"the header claims \d+ tensors and 8589934592 metadata keys"),
])
def test_gguf_header_counts_past_the_files_end_are_refused(gguf_bytes, tmp_path, offset, value, says):
    path = tmp_path / "counts.gguf"
    path.write_bytes(gguf_bytes[:offset] + struct.pack("<Q", value) + gguf_bytes[offset + 8:])
    with pytest.raises(CheckpointError, match=rf"counts\.gguf: cannot read GGUF file, truncated or corrupt\? \({says}"):
        llama.load(path)


def test_gguf_string_length_past_the_files_end_is_refused(gguf_bytes, tmp_path):
    key = b"general.architecture"
    at = gguf_bytes.index(key) + len(key) + 4  # the string value's uint64 length
    path = tmp_path / "string.gguf"
    path.write_bytes(gguf_bytes[:at] + struct.pack("<Q", 2**50) + gguf_bytes[at + 8:])
    with pytest.raises(CheckpointError, match=r"string\.gguf: cannot read GGUF file, truncated or corrupt\? \(metadata key "
                                              r"'general\.architecture' \(1125899906842624 bytes claimed\) needs"):
        llama.load(path)


def test_hugging_face_layer_count_is_checked_against_the_safetensors_header(hf_dir, tmp_path):
    directory = Path(shutil.copytree(hf_dir, tmp_path / "ckpt"))
    check_layer_count(directory / "config.json", directory / "model.safetensors")  # 2 and 2: passes
    edit_config(directory, num_hidden_layers=10**9)
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json: field 'num_hidden_layers' = 1000000000, but "
                                              r".*ckpt/model\.safetensors holds the tensors of 2 layers \(indices 0 to 1\)"):
        check_layer_count(directory / "config.json", directory / "model.safetensors")


def test_hugging_face_layer_count_is_checked_against_a_shard_index(hf_dir, tmp_path):
    directory = Path(shutil.copytree(hf_dir, tmp_path / "ckpt"))
    names = safetensors_names(directory / "model.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    assert sorted(weight_names(index)) == sorted(names)
    edit_config(directory, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"field 'num_hidden_layers' = 3, but .*model\.safetensors\.index\.json holds"):
        check_layer_count(directory / "config.json", index)


@pytest.mark.parametrize("value", ["2", 2.0, True, None])
def test_layer_count_check_leaves_a_mistyped_field_to_the_config_reader(hf_dir, tmp_path, value):
    directory = Path(shutil.copytree(hf_dir, tmp_path / "ckpt"))
    edit_config(directory, num_hidden_layers=value)
    check_layer_count(directory / "config.json", directory / "model.safetensors")


def test_safetensors_header_size_past_the_files_end_is_refused(hf_dir, tmp_path):
    data = (hf_dir / "model.safetensors").read_bytes()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file, truncated or corrupt\? "
                                              r"\(its header claims 1099511627776 bytes"):
        safetensors_names(path)


@pytest.fixture(scope="module")
def gpt2_model():
    from jaxattn import gpt2

    return gpt2.random_model("tiny", seed=0)  # 2 layers


@pytest.fixture(scope="module")
def gpt2_dir(gpt2_model, tmp_path_factory):
    from jaxattn import gpt2

    return gpt2.save(tmp_path_factory.mktemp("gpt2") / "ckpt", *gpt2_model)


def _bert_dir(folder: Path, **changes) -> Path:
    """The bundled BERT's files linked into ``folder``, its config.json rewritten with ``changes``."""
    from jaxattn import bert

    folder.mkdir()
    for name in bert.FILES:
        if name != "config.json":
            (folder / name).symlink_to(bert.bundled_model_dir() / name)
    config = json.loads((bert.bundled_model_dir() / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("layout", ["safetensors", "msgpack"])
def test_gpt2_layer_count_is_checked_against_the_weights_before_the_tables_are_built(gpt2_model, tmp_path, layout):
    from jaxattn import gpt2

    params, config, _ = gpt2_model
    directory = gpt2.save(tmp_path / "ckpt", params, config, format=layout)
    weights = "model.safetensors" if layout == "safetensors" else "flax_model.msgpack"
    read = gpt2.params_from_safetensors if layout == "safetensors" else gpt2.params_from_msgpack
    read(directory / weights, config)  # 2 and 2: reads
    with pytest.raises(CheckpointError, match=rf"ckpt/{re.escape(weights)}: the config's n_layer = 3, but the file holds "
                                              r"the tensors of 2 layers \(indices 0 to 1\)"):
        read(directory / weights, config._replace(n_layer=3))


def test_bert_layer_count_is_checked_against_the_weights_before_the_table_is_built(tmp_path):
    from jaxattn import bert

    directory = _bert_dir(tmp_path / "bert", num_hidden_layers=5)
    with pytest.raises(CheckpointError, match=r"bert/model\.safetensors: the config's num_hidden_layers = 5, but the "
                                              r"file holds the tensors of 6 layers \(indices 0 to 5\)"):
        bert.load(directory)


_BOUNDED_LOAD = textwrap.dedent("""
    import importlib, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    from jaxattn.checkpoint import CheckpointError
    for module, path in zip(sys.argv[1::2], sys.argv[2::2]):
        try:
            importlib.import_module(f"jaxattn.{module}").load(path)
        except CheckpointError as e:
            print(module, "CheckpointError:", e)
""")


def test_hugging_face_loads_with_a_huge_layer_count_are_refused_within_bounded_memory(hf_dir, gpt2_dir, tmp_path):
    llama_dir = Path(shutil.copytree(hf_dir, tmp_path / "llama"))
    edit_config(llama_dir, num_hidden_layers=10**9)
    gpt2_copy = Path(shutil.copytree(gpt2_dir, tmp_path / "gpt2"))
    edit_config(gpt2_copy, n_layer=10**9)
    bert_dir = _bert_dir(tmp_path / "bert", num_hidden_layers=10**9)
    argv = ["llama", str(llama_dir), "gpt2", str(gpt2_copy), "bert", str(bert_dir)]
    proc = subprocess.run([sys.executable, "-c", _BOUNDED_LOAD, *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith("llama CheckpointError:") and "field 'num_hidden_layers' = 1000000000" in lines[0]
    assert lines[1].startswith("gpt2 CheckpointError:") and "the config's n_layer = 1000000000" in lines[1]
    assert lines[2].startswith("bert CheckpointError:") and "the config's num_hidden_layers = 1000000000" in lines[2]


# ----------------------------------------------------------------------------------------------------
# Shard names stay inside the checkpoint folder
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard", ["ABSOLUTE", "../outside.safetensors", "sub/../../outside.safetensors", "..\\outside.safetensors"])
def test_shard_index_naming_a_file_outside_the_checkpoint_is_refused(hf_dir, tmp_path, shard):
    directory = Path(shutil.copytree(hf_dir, tmp_path / "ckpt"))
    shutil.copy(directory / "model.safetensors", tmp_path / "outside.safetensors")  # a real file there: not followed
    (directory / "model.safetensors").unlink()
    shard = str(tmp_path / "outside.safetensors") if shard == "ABSOLUTE" else shard
    names = safetensors_names(tmp_path / "outside.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    with pytest.raises(CheckpointError, match=re.escape(f"file name {shard!r} is not inside the checkpoint")):
        llama.load(directory)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "", "C:\\x"])
def test_resolve_refuses_required_names_outside_the_folder(tmp_path, name):
    with pytest.raises(CheckpointError, match=r"is not inside the checkpoint"):
        resolve(tmp_path, required=[name])
    with pytest.raises(CheckpointError, match=r"is not inside the checkpoint"):
        resolve(tmp_path, required=[], any_of=[["model.safetensors", name]])


def test_resolve_still_finds_names_in_subfolders(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.safetensors").write_bytes(b"x")
    assert resolve(tmp_path, required=["sub/w.safetensors", "./sub/w.safetensors"]).files["sub/w.safetensors"].is_file()


# ----------------------------------------------------------------------------------------------------
# GGUF head counts named
# ----------------------------------------------------------------------------------------------------


BAD_HEADS = [
    ("head_count 0", {"llama.attention.head_count": 0}, r"metadata key 'llama\.attention\.head_count' must be >= 1, found 0"),
    ("head_count not dividing", {"llama.attention.head_count": 5, "llama.attention.head_count_kv": 5},
     r"metadata key 'llama\.attention\.head_count' = 5 does not divide 'llama\.embedding_length' = 32"),
    ("head_count_kv 0", {"llama.attention.head_count_kv": 0},
     r"metadata key 'llama\.attention\.head_count_kv' must be >= 1 and divide 'llama\.attention\.head_count' = 4 "
     r"\(grouped-query attention\), found 0"),
    ("head_count_kv not dividing", {"llama.attention.head_count_kv": 3}, r"metadata key 'llama\.attention\.head_count_kv' must be >= 1 and divide"),
    ("embedding_length 0", {"llama.embedding_length": 0}, r"metadata key 'llama\.embedding_length' must be >= 1, found 0"),
    ("head_count dividing but wrong", {"llama.attention.head_count": 8, "llama.attention.head_count_kv": 8},
     r"llama\.rope\.dimension_count = 8 but the head dim is 4 \('llama\.embedding_length' = 32 / "
     r"'llama\.attention\.head_count' = 8\); .* so one of them is wrong"),
]


@pytest.mark.parametrize("name, changes, says", BAD_HEADS, ids=[b[0] for b in BAD_HEADS])
def test_gguf_head_counts_are_named_when_wrong(gguf_parts, tmp_path, name, changes, says):
    meta, tensors = gguf_parts
    path = write_gguf(tmp_path / "heads.gguf", {**meta, **changes}, tensors)
    with pytest.raises(CheckpointError, match=rf"heads\.gguf: {says}"):
        llama.load(path)


# ----------------------------------------------------------------------------------------------------
# Causal offsets of any size
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset, keeps", [(2**31, "all"), (2**40, "all"), (2**64, "all"), (4, "all"), (-3, "none"),
                                           (-(2**40), "none"), (-(2**63), "none")])
def test_causal_mask_offset_of_any_size_is_clamped_to_the_same_mask(offset, keeps):
    np.testing.assert_array_equal(np.asarray(jaxattn.causal_mask(3, 4, offset)), np.full((3, 4), keeps == "all"))
    if abs(offset) < 2**63:  # a NumPy int too
        np.testing.assert_array_equal(np.asarray(jaxattn.causal_mask(3, 4, np.int64(offset))), np.full((3, 4), keeps == "all"))


@pytest.mark.parametrize("offset", [2**31, 2**40, -(2**31), -(2**63)])
def test_attention_causal_offset_of_any_size_equals_the_clamped_one(offset):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((3, 4), (5, 4), (5, 2)))
    v[1, 0] = np.nan  # a non-finite value: its bookkeeping uses the offset too
    clamped = 5 if offset > 0 else -3
    out, w = jaxattn.attention(q, k, v, is_causal=True, causal_offset=offset)
    ref_out, ref_w = jaxattn.attention(q, k, v, is_causal=True, causal_offset=clamped)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref_w))
    np.testing.assert_array_equal(np.asarray(jaxattn.attention_weights(q, k, is_causal=True, causal_offset=offset)),
                                  np.asarray(ref_w))
    mh_out, mh_w = jaxattn.multi_head_attention(q[:, None], k[:, None], v[:, None], is_causal=True, causal_offset=offset)
    np.testing.assert_array_equal(np.asarray(mh_w[0]), np.asarray(ref_w))
    np.testing.assert_array_equal(np.asarray(mh_out[:, 0]), np.asarray(ref_out))


# ----------------------------------------------------------------------------------------------------
# An unusable compilation cache folder: one warning, and the run goes on
# ----------------------------------------------------------------------------------------------------


def _unusable_cache(tmp_path, monkeypatch):
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "jaxattn").write_text("a file where the cache folder goes")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(jio.NO_CACHE_VARIABLE, raising=False)


def test_cache_folder_that_is_a_file_warns_once_and_turns_nothing_on(tmp_path, monkeypatch):
    _unusable_cache(tmp_path, monkeypatch)
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(RuntimeWarning, match=r"compiled programs are not kept across runs: the cache folder '.*xdg/jaxattn' "
                                            r"cannot be used \(it is a file, not a folder\)"):
        assert jio.use_compilation_cache() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jio.use_compilation_cache() is None  # said once
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.parametrize("refusal", ["access", "probe"])
def test_cache_folder_that_cannot_be_written_warns_and_turns_nothing_on(tmp_path, monkeypatch, refusal):
    import tempfile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(jio.NO_CACHE_VARIABLE, raising=False)
    if refusal == "access":  # what a folder without write permission gives (root passes os.access: simulated)
        monkeypatch.setattr(os, "access", lambda *a, **k: False)
        says = "no write permission"
    else:  # a read-only file system
        def refuse(*args, **kwargs):
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
        says = "Read-only file system"
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(RuntimeWarning, match=rf"cannot be used \({says}\)") as said:
        assert jio.use_compilation_cache() is None
    assert len(said) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jio.use_compilation_cache() is None  # said once
    assert jax.config.jax_compilation_cache_dir == before


def test_lab_with_an_unusable_cache_folder_runs_and_warns_once(tmp_path):
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "jaxattn").write_text("x")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu")
    env.pop(jio.NO_CACHE_VARIABLE, None)
    proc = subprocess.run([sys.executable, "experiments/lab.py", "--parts", "1", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Warning") == 1 and "compiled programs are not kept across runs" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "compiled programs: not kept" in proc.stdout
    assert (tmp_path / "out" / "part1.json").is_file()


# ----------------------------------------------------------------------------------------------------
# Output folders checked before any work: one line, exit 2, nothing written
# ----------------------------------------------------------------------------------------------------


def test_output_folder_is_created_and_returned(tmp_path):
    out = jio.prepare_output_folder(tmp_path / "a" / "b", ["x.json", "sub/", "sub/y.png"])
    assert out == tmp_path / "a" / "b" and out.is_dir() and _tree(tmp_path) == ["a", "a/b"]


def test_output_folder_checked_with_create_false_leaves_nothing(tmp_path):
    (tmp_path / "kept").mkdir()
    out = jio.prepare_output_folder(tmp_path / "kept" / "a" / "b", ["x.json"], create=False)
    assert out == tmp_path / "kept" / "a" / "b" and _tree(tmp_path) == ["kept"]


BAD_FOLDERS = [
    ("out is a file", {"f": "file"}, "f", r"--out '.*f' exists and is not a folder"),
    ("out inside a file", {"f": "file"}, "f/sub", r"--out '.*f/sub' cannot be created: '.*f' is not a folder"),
    ("a file target is a folder", {"d/x.json": "dir"}, "d", r"'.*d/x\.json' is a folder, but the run writes a file there"),
    ("a folder target is a file", {"d/sub": "file"}, "d", r"'.*d/sub' exists and is not a folder, but the run writes into it"),
    ("a target's folder is a file", {"d/sub": "file"}, "d/", r"'.*d/sub' exists and is not a folder"),
]


@pytest.mark.parametrize("name, layout, out, says", BAD_FOLDERS, ids=[b[0] for b in BAD_FOLDERS])
def test_output_folder_that_cannot_take_the_results_is_refused_in_one_line(tmp_path, name, layout, out, says):
    for rel, kind in layout.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir() if kind == "dir" else p.write_text("x")
    before = _tree(tmp_path)
    targets = ["x.json", "sub/"] if name != "a target's folder is a file" else ["sub/y.png"]
    with pytest.raises(jio.OutputFolderError, match=says) as e:
        jio.prepare_output_folder(str(tmp_path / out), targets)
    assert "\n" not in str(e.value)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("refusal", ["access", "probe"])
def test_output_folder_that_cannot_be_written_is_refused_and_nothing_is_left(tmp_path, monkeypatch, refusal):
    # As root a read-only folder is still writable: the two checks are made to fail instead.
    import tempfile

    if refusal == "access":
        monkeypatch.setattr(os, "access", lambda *a, **k: False)
        says = "Permission denied"
    else:
        def refuse(*args, **kwargs):
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
        says = "Read-only file system"
    (tmp_path / "kept").mkdir()
    with pytest.raises(jio.OutputFolderError, match=rf"--out '.*kept/new/out': cannot write there \({says}\)"):
        jio.prepare_output_folder(tmp_path / "kept" / "new" / "out", ["x.json"])
    assert _tree(tmp_path) == ["kept"]


@pytest.mark.parametrize("target", ["/abs.json", "../up.json", ""])
def test_output_targets_outside_the_folder_are_a_programming_error(tmp_path, target):
    with pytest.raises(ValueError, match="must be a relative path inside the output folder"):
        jio.prepare_output_folder(tmp_path, [target])


def test_output_folder_check_is_public():
    assert {"prepare_output_folder", "OutputFolderError"} <= set(jio.__all__)


# (script, argv before --out, a file the script writes into --out)
SCRIPTS = [
    ("lab.py", ["--parts", "1", "--no-cache"], "part1.json"),
    ("trophy.py", ["--random-gpt2", "tiny", "--no-cache"], "trophy.html"),
    ("heads.py", ["--random-gpt2", "tiny", "--parts", "bound"], "bound.json"),
    ("train_scale.py", ["--quick", "--no-cache"], "history.json"),
    ("winograd.py", ["--model", "minilm"], "winograd.md"),
    ("bench_gpt2.py", [], "bench_gpt2.json"),
    ("bench_llama.py", [], "bench_llama.json"),
    ("conformance.py", ["--quick"], "conformance.json"),
    ("bench_attention.py", ["--quick"], "bench_attention.md"),
]


def _run_script(script, argv, monkeypatch):
    """The script's main, run in this process on ``argv``: its exit status."""
    main = runpy.run_path(str(ROOT / "experiments" / script))["main"]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        code = main(argv) if main.__code__.co_argcount else main()
    except SystemExit as e:
        code = e.code
    return code


@pytest.mark.parametrize("case", ["out is a file", "a target is a folder", "out cannot be written"])
@pytest.mark.parametrize("script, argv, target", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_experiment_with_an_unusable_out_exits_2_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, script, argv,
                                                                                 target, case):
    import tempfile

    monkeypatch.chdir(tmp_path)
    if case == "out is a file":
        (tmp_path / "out").write_text("x")
        says = "exists and is not a folder"
    elif case == "a target is a folder":
        (tmp_path / "out" / target).mkdir(parents=True)
        says = f"{target}' is a folder, but "
    else:
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
        says = "cannot write there (Permission denied)"
    before = _tree(tmp_path)
    assert _run_script(script, [*argv, "--out", str(tmp_path / "out")], monkeypatch) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert captured.out == ""  # nothing ran
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("case", ["json is a folder", "json inside a file"])
def test_bench_mesh_with_an_unusable_json_exits_2_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    if case == "json is a folder":
        (tmp_path / "b.json").mkdir()
        target, says = tmp_path / "b.json", "b.json' is a folder, but "
    else:
        (tmp_path / "f").write_text("x")
        target, says = tmp_path / "f" / "b.json", "exists and is not a folder"
    before = _tree(tmp_path)
    assert _run_script("bench_mesh.py", ["--model", "tiny", "--json", str(target)], monkeypatch) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert captured.out == ""
    assert _tree(tmp_path) == before


def test_trophy_target_that_is_a_folder_is_refused_before_anything_is_written(tmp_path):
    """The command line, end to end: `--out D` with D/trophy.html a folder."""
    (tmp_path / "d" / "trophy.html").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "experiments/trophy.py", "--random-gpt2", "tiny", "--no-cache",
                           "--out", str(tmp_path / "d")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {str(tmp_path / 'd' / 'trophy.html')!r} is a folder, but the run "
                                                "writes a file there"]
    assert _tree(tmp_path) == ["d", "d/trophy.html"]


def test_a_gguf_of_another_architecture_is_refused_before_its_vocabulary_is_read(tmp_path, monkeypatch):
    """A Qwen-3-like file with a 262,144-entry vocabulary: refused from its header's first key, naming the
    architecture and the supported ones, without the GGUF reader ever parsing the vocabulary."""
    import gguf

    vocab = [f"t{i}" for i in range(262_144)]
    path = write_gguf(tmp_path / "qwen.gguf", {"general.architecture": "qwen3", "qwen3.block_count": 2,
                                               "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": vocab},
                      {"token_embd.weight": np.zeros((4, 8), np.float32)})
    assert _gguf.read_architecture(path) == "qwen3"
    opened = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(CheckpointError, match=r"qwen\.gguf: general\.architecture is 'qwen3'; this loader reads "
                                              r"'llama', 'gemma3' \(nothing else of the file was read\)"):
        llama.load(path)
    assert not opened


def test_gpt2_save_as_msgpack_refuses_a_folder_holding_safetensors(gpt2_model, tmp_path):
    """load reads model.safetensors first: msgpack weights saved beside one would not be the ones loaded."""
    from jaxattn import gpt2

    params, config, tokenizer = gpt2_model
    directory = gpt2.save(tmp_path / "ckpt", params, config, tokenizer)
    changed = jax.tree.map(lambda a: a + 1.0, params)
    with pytest.raises(ValueError, match=r"already holds model\.safetensors, which load reads before flax_model\.msgpack"):
        gpt2.save(directory, changed, config, tokenizer, format="msgpack")
    assert not (directory / "flax_model.msgpack").exists()
    gpt2.save(directory, changed, config, tokenizer)  # as safetensors: replaced, and loaded
    again, _, _ = gpt2.load(directory)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(changed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_nan_weight_is_named_by_its_checkpoint_name(gpt2_model, tmp_path):
    """The Hugging Face name one can look up in the file (GPT-2's optional 'transformer.' prefix aside), not
    the params' path ('transformer/h/1/mlp/c_fc/kernel')."""
    from safetensors.numpy import load_file, save_file

    from jaxattn import gpt2

    params, config, tokenizer = gpt2_model
    directory = gpt2.save(tmp_path / "ckpt", params, config, tokenizer)
    tensors = load_file(str(directory / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("h.1.mlp.c_fc.weight"))
    tensors[key] = np.where(np.arange(tensors[key].size).reshape(tensors[key].shape) == 3, np.nan, tensors[key])
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: weight '(transformer\.)?h\.1\.mlp\.c_fc\.weight' holds NaN"):
        gpt2.load(directory)


def test_atomic_write_keeps_a_replaced_files_mode_and_leaves_nothing_on_failure(tmp_path):
    import stat

    from jaxattn.io import atomic_write

    path = tmp_path / "result.json"
    atomic_write(path, "{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a new file: readable by all
    path.chmod(0o600)
    atomic_write(path, "[1]")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "[1]"  # not loosened

    def fail(f):
        f.write(b"half")
        raise RuntimeError("stopped halfway")

    with pytest.raises(RuntimeError, match="stopped halfway"):
        atomic_write(path, fail)
    assert path.read_text() == "[1]" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


# (script, argv, what the one-line error says): each refused before the script's work starts
BAD_FLAGS = [
    ("lab.py", ["--parts", "3", "--model", "/no/such/dir"], r"argument --model: no such directory '/no/such/dir'"),
    ("trophy.py", ["--random-gpt2", "tiny", "--top", "-2"], r"argument --top: must be a positive int"),
    ("trophy.py", ["--random-gpt2", "tiny", "--layer", "-1"], r"argument --layer: must be an int >= 0"),
    ("train_scale.py", ["--quick", "--head-dims", "8", "0"], r"argument --head-dims: must be a positive int"),
    ("winograd.py", ["--model", "minilm", "--seed", "-1"], r"argument --seed: must be an int >= 0"),
    ("bench_sweep.py", ["--repeats", "2"], r"argument --repeats: must be an int >= 3"),
    ("bench_gpt2.py", ["--repeats", "2"], r"argument --repeats: must be an int >= 3"),
    ("trained_heads.py", ["--model", "minilm", "--sentences", "10000"], r"--sentences 10000: the WSC273 collection has 273"),
    ("train_scale.py", ["--steps", "10"], r"argument --warmup: must be less than --steps \(10\), received 30"),
    ("train_scale.py", ["--learning-rates", "nan"], r"argument --learning-rates: must be a finite number > 0"),
    ("train_scale.py", ["--learning-rates", "-1"], r"argument --learning-rates: must be a finite number > 0"),
    ("train_scale.py", ["--threshold", "nan"], r"argument --threshold: must be a finite number > 0"),
    ("train_scale.py", ["--seeds", "0", "0"], r"argument --seeds: each value once, received \[0, 0\]"),
    ("train_scale.py", ["--task", "text", "--context", "100000"], r"argument --context: "),
    ("trophy.py", ["--random-gpt2", "tiny", "--model", "minilm"], r"--model and --random-gpt2 name two models"),
    ("heads.py", ["--random-gpt2", "tiny", "--model", "minilm"], r"--model and --random-gpt2 name two models"),
    ("lab.py", ["--parts", "3", "--random-gpt2", "tiny", "--model", "minilm"], r"--model and --random-gpt2 name two models"),
    # a hub id neither cached nor reachable (the hub switched off here): refused before parts 1-2 run
    ("lab.py", ["--parts", "1,3", "--model", "smolm2"], r"argument --model: cannot fetch 'smolm2' from the Hugging Face hub"),
]


@pytest.mark.parametrize("script, argv, says", BAD_FLAGS, ids=[f"{s} {' '.join(a[-2:])}" for s, a, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_by_name_before_any_work(tmp_path, monkeypatch, capsys, offline_hub, script, argv, says):
    monkeypatch.chdir(tmp_path)
    code = _run_script(script, [*argv, "--out", str(tmp_path / "out")], monkeypatch)
    assert code == 2
    assert re.search(says, capsys.readouterr().err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def test_heads_checks_its_parts_arguments_before_the_first_part_and_lists_what_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = _run_script("heads.py", ["--random-gpt2", "tiny", "--parts", "effects,window", "--length", "100000",
                                    "--out", str(tmp_path / "a")], monkeypatch)
    assert "--length 100000" in str(code) and not (tmp_path / "a").exists()  # before the effect tables ran
    code = _run_script("heads.py", ["--random-gpt2", "tiny", "--parts", "bound", "--out", str(tmp_path / "b")], monkeypatch)
    assert code == 0 and "wrote bound.json to" in capsys.readouterr().out
    (tmp_path / "b" / "stale.txt").write_text("from before")
    import os
    os.utime(tmp_path / "b" / "stale.txt", (0, 0))
    code = _run_script("heads.py", ["--random-gpt2", "tiny", "--parts", "bound", "--out", str(tmp_path / "b")], monkeypatch)
    out = capsys.readouterr().out
    assert code == 0 and "wrote bound.json to" in out and "stale.txt" not in out


@pytest.mark.slow
def test_heads_removes_an_earlier_runs_page_when_its_model_has_none(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "heads.html").write_text("an earlier run's page, of another model")
    code = _run_script("heads.py", ["--model", "minilm", "--parts", "effects", "--reference", "0", "--out", str(out)],
                       monkeypatch)  # an encoder: tables, no page
    printed = capsys.readouterr().out
    assert code == 0 and f"removed {out / 'heads.html'}: an earlier run's page" in printed
    assert not (out / "heads.html").exists() and (out / "heads.json").exists()
