"""Files at the edges: a msgpack checkpoint nested too deep, the WSC273 converter's output file, the API
reference's output folder; and jaxattn.nnx's shape errors in Flax's words. No network."""

import importlib.util
import io
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.sax.saxutils import escape

import jax.numpy as jnp
import pytest

from jaxattn.checkpoint import CheckpointError, read_msgpack, weight_names

ROOT = Path(__file__).resolve().parents[1]


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) with its text."""
    return {str(p.relative_to(folder)): p.read_text(encoding="utf-8") for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------------
# A flax_model.msgpack nested too deep
# ----------------------------------------------------------------------------------------------------


def _nested_msgpack(depth: int) -> bytes:
    """msgpack of ``{"a": {"a": ... {"leaf": 1.0}}}`` with ``depth`` maps above the leaf's, written by hand
    (msgpack's own packer refuses to nest this deep)."""
    return b"\x81\xa1a" * depth + b"\x81\xa4leaf\xca" + struct.pack(">f", 1.0)


@pytest.mark.parametrize("depth", [100, 1000, 5000])
@pytest.mark.parametrize("reader", [read_msgpack, weight_names], ids=["read_msgpack", "weight_names"])
def test_msgpack_nested_too_deep_is_a_checkpoint_error_naming_the_file(tmp_path, depth, reader):
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(_nested_msgpack(depth))
    with pytest.raises(CheckpointError) as info:
        reader(path)
    assert str(info.value) == (f"{path}: not a Flax checkpoint: its msgpack data nests more than 64 levels deep "
                               "(a checkpoint's tree nests a few)")


def test_msgpack_nested_as_deep_as_allowed_is_read(tmp_path):
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(_nested_msgpack(63))  # 63 maps above the leaf's: 64 levels
    assert weight_names(path) == ["/".join(["a"] * 63 + ["leaf"])]


# ----------------------------------------------------------------------------------------------------
# tools/convert_wsc273.py: its output file
# ----------------------------------------------------------------------------------------------------


convert = _tool("convert_wsc273")


def _collection(path: Path) -> Path:
    """A made-up collection in WSCollection.xml's format: 273 problems in 136 schemas (pairs, and the
    three-sentence schema at 252), each sentence's answers both named before the pronoun."""
    schemas = []
    for g, members in enumerate(convert.schema_groups()):
        for j, _ in enumerate(members):
            adjective = ("kind", "rude", "late")[j]
            schemas.append(
                f"<schema><text><txt1>Ann{g} thanked Bob{g} because</txt1><pron> she </pron>"
                f"<txt2>was {adjective}.</txt2></text><answers><answer>Ann{g}</answer><answer>Bob{g}</answer>"
                f"</answers><correctAnswer>{'AB'[j % 2]}</correctAnswer><source>{escape('tests & co')}</source></schema>")
    path.write_text(f'<?xml version="1.0" encoding="UTF-8"?>\n<collection>\n{chr(10).join(schemas)}\n</collection>\n',
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    return _collection(tmp_path_factory.mktemp("wsc") / "WSCollection.xml")


def test_converter_writes_the_json_of_a_collection(collection, tmp_path, capsys):
    out = tmp_path / "wsc273.json"
    assert convert.main([str(collection), str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert len(data["problems"]) == 273 and data["problems"][252]["text"] == "Ann126 thanked Bob126 because [she] was kind."
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)
    assert f"wrote 273 problems in 136 schemas to {out}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wsc273.json"]  # no temporary file left


class _FailingHalfway:
    """A file opened for writing whose first write writes half its data, then raises ``error``."""

    def __init__(self, f, error):
        self._f, self._error = f, error

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise self._error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk_full", "killed"])
def test_converter_writes_atomically_keeping_the_old_file_when_a_write_fails_halfway(
        collection, tmp_path, monkeypatch, capsys, error):
    out = tmp_path / "wsc273.json"
    out.write_text("the old data\n", encoding="utf-8")
    real_open = io.open

    def failing_open(file, mode="r", *args, **kwargs):  # every way to open a file for writing reaches io.open
        f = real_open(file, mode, *args, **kwargs)
        return _FailingHalfway(f, error) if any(c in mode for c in "wax+") else f

    monkeypatch.setattr(io, "open", failing_open)
    if isinstance(error, OSError):
        assert convert.main([str(collection), str(out)]) == 2
        assert capsys.readouterr().err == (f"error: out {str(out)!r}: cannot write there (No space left on device); "
                                           "nothing was changed\n")
    else:
        with pytest.raises(KeyboardInterrupt):
            convert.main([str(collection), str(out)])
    monkeypatch.undo()
    assert _tree(tmp_path) == {"wsc273.json": "the old data\n"}  # whole, and no temporary file left


def test_converter_refuses_a_folder_as_its_output(collection, tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    assert convert.main([str(collection), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: out {str(out)!r} is a folder; give the JSON file to write there "
                                       "(e.g. jaxattn/data/wsc273.json)\n")
    assert _tree(tmp_path) == {"existing/notes.txt": "mine"}


def test_converter_refuses_an_output_whose_folder_is_missing(collection, tmp_path, capsys):
    out = tmp_path / "missing" / "wsc273.json"
    assert convert.main([str(collection), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: out {str(out)!r}: its folder {str(out.parent)!r} does not exist\n")
    assert not (tmp_path / "missing").exists()


def test_converter_refuses_a_read_only_folder(collection, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "read-only"
    folder.mkdir()
    out = folder / "wsc273.json"
    out.write_text("the old data\n", encoding="utf-8")
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes into a read-only folder anyway: refuse the write as the folder would
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    try:
        assert convert.main([str(collection), str(out)]) == 2
    finally:
        folder.chmod(0o755)
    assert capsys.readouterr().err == (f"error: out {str(out)!r}: cannot write there (Permission denied); "
                                       "nothing was changed\n")
    assert _tree(tmp_path) == {"read-only/wsc273.json": "the old data\n"}


def test_converter_run_on_a_folder_exits_non_zero_without_a_traceback(collection, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_wsc273.py"), str(collection), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith(f"error: out {str(tmp_path)!r} is a folder")


# ----------------------------------------------------------------------------------------------------
# tools/api_docs.py: its output folder
# ----------------------------------------------------------------------------------------------------


api_docs = _tool("api_docs")


@pytest.fixture
def fake_pdoc(monkeypatch):
    """pdoc.pdoc replaced: it writes a page per module given and an index, or, with ``fail`` set, some of
    the pages and part of the index and then raises (a build that fails halfway)."""
    import pdoc

    state = {"fail": False, "calls": 0}

    def render(*modules, output_directory):
        state["calls"] += 1
        out = Path(output_directory)
        for m in modules:
            page = out.joinpath(*m.split(".")).with_suffix(".html")
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(f"new page of {m}", encoding="utf-8")
            if state["fail"]:
                (out / "index.html").write_text("a partial ind", encoding="utf-8")
                raise RuntimeError("pdoc failed while rendering")
        (out / "index.html").write_text("new index", encoding="utf-8")

    monkeypatch.setattr(pdoc, "pdoc", render)
    return state


def _old_reference(out: Path, *, marker: bool = True) -> dict[str, str]:
    out.mkdir()
    (out / "index.html").write_text("old index", encoding="utf-8")
    (out / "jaxattn").mkdir()
    (out / "jaxattn" / "viz.html").write_text("old page", encoding="utf-8")
    if marker:
        (out / api_docs.MARKER).write_text("old marker", encoding="utf-8")
    return _tree(out)


def test_api_docs_refuses_a_folder_it_did_not_write_and_leaves_it_as_it_was(tmp_path, fake_pdoc, capsys):
    out = tmp_path / "my-project"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work", encoding="utf-8")
    (out / "index.html").write_text("my own page", encoding="utf-8")
    assert api_docs.main([str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: {out}: refusing to replace a folder this tool did not write (no {api_docs.MARKER} in it, and it "
        "holds 'thesis.tex'); give a new or empty folder, or remove this one yourself\n")
    with pytest.raises(api_docs.OutputFolderError, match=rf"^{out}: refusing to replace a folder this tool did not write"):
        api_docs.build(out)
    assert fake_pdoc["calls"] == 0  # refused before any work
    assert _tree(tmp_path) == {"my-project/index.html": "my own page", "my-project/thesis.tex": "years of work"}


def test_api_docs_refuses_a_file_as_its_output(tmp_path, fake_pdoc):
    out = tmp_path / "api-docs"
    out.write_text("a file", encoding="utf-8")
    with pytest.raises(api_docs.OutputFolderError, match=rf"^{out}: exists and is not a folder"):
        api_docs.build(out)
    assert _tree(tmp_path) == {"api-docs": "a file"}


def test_api_docs_keeps_the_old_pages_when_generation_fails(tmp_path, fake_pdoc):
    out = tmp_path / "api-docs"
    before = _old_reference(out)
    fake_pdoc["fail"] = True
    with pytest.raises(RuntimeError, match="pdoc failed while rendering"):
        api_docs.build(out)
    assert _tree(tmp_path) == {f"api-docs/{k}": v for k, v in before.items()}  # and no temporary folder left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api-docs"]


@pytest.mark.parametrize("old", ["marked", "unmarked pdoc pages", "empty", "missing"])
def test_api_docs_replaces_its_own_reference_whole(tmp_path, fake_pdoc, old):
    out = tmp_path / "api-docs"
    if old == "empty":
        out.mkdir()
    elif old != "missing":
        _old_reference(out, marker=old == "marked")  # a reference from before the marker: pdoc's pages only
        (out / "jaxattn" / "gone.html").write_text("a module since removed", encoding="utf-8")
    modules = api_docs.build(out)
    files = _tree(out)
    assert files["index.html"] == "new index" and files[api_docs.MARKER] == api_docs._MARKER_TEXT
    assert "jaxattn/gone.html" not in files and files["jaxattn.html"] == "new page of jaxattn"
    assert "jaxattn.viz" in modules and sorted(p.name for p in tmp_path.iterdir()) == ["api-docs"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)


# ----------------------------------------------------------------------------------------------------
# jaxattn.nnx: shape errors name the arguments and carry Flax's words
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 3, 4, 5), (3, 4, 5), (3, 4, 5)),
         r"^query, key and value must have the same rank: query has shape \(2, 3, 4, 5\) \[batch\.\.\., T, N, H\], "
         r"key \(3, 4, 5\) \[batch\.\.\., S, K, H\], value \(3, 4, 5\) \[batch\.\.\., S, K, V\]; "
         r"q, k, v must have same rank, but got 4, 3, 3$"),
        (((2, 3, 4, 5), (1, 3, 4, 5), (1, 3, 4, 5)),
         r"^key must have shape \[batch\.\.\., S, K, H\] with the batch dims of query \(2, 3, 4, 5\) .*"
         r"received \(1, 3, 4, 5\); q, k, v batch dims must match, but got shapes \(2, 3, 4, 5\), \(1, 3, 4, 5\)"),
        (((2, 3, 4, 5), (2, 3, 4, 5), (2, 6, 4, 5)),
         r"^key and value must have the same length S: key has shape \(2, 3, 4, 5\), value has shape \(2, 6, 4, 5\); "
         r"k, v lengths must match, but got 3 and 6$"),
        (((2, 3, 4, 5), (2, 3, 4, 6), (2, 3, 4, 5)),
         r"^query and key must have the same head dimension H: query has shape \(2, 3, 4, 5\) \[batch\.\.\., T, N, H\], "
         r"key \(2, 3, 4, 6\) \[batch\.\.\., S, K, H\]; q, k depths must match, but got 5 and 6$"),
        (((2, 3, 4, 5), (2, 3, 3, 5), (2, 3, 3, 5)),
         r"^the number of query heads N must be a multiple of the number of key/value heads K .*query has shape "
         r"\(2, 3, 4, 5\), N=4, key \(2, 3, 3, 5\), K=3; Query heads \(4\) must be multiple of Key heads \(3\)$"),
    ],
    ids=["same_rank", "batch_dims", "lengths", "depths", "heads"],
)
def test_nnx_shape_errors_name_the_arguments_in_flaxs_words(shapes, message):
    from jaxattn.nnx import dot_product_attention

    q, k, v = (jnp.ones(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=message):
        dot_product_attention(q, k, v)


@pytest.mark.parametrize("phrase", ["same rank", "lengths must match", "depths must match"])
def test_nnx_module_call_errors_match_flaxs_phrases(phrase):
    """The three words Flax's own attention tests match, through the drop-in attention_fn with a module
    (the path that sows the weights)."""
    from flax import nnx

    from jaxattn.nnx import dot_product_attention

    q = jnp.ones((2, 3, 4, 5), jnp.float32)
    k = {"same rank": q[0], "lengths must match": q, "depths must match": jnp.ones((2, 3, 4, 6), jnp.float32)}[phrase]
    v = {"same rank": q[0], "lengths must match": jnp.ones((2, 6, 4, 5), jnp.float32), "depths must match": q}[phrase]
    module = nnx.Module()
    for fn in (nnx.dot_product_attention, dot_product_attention):
        with pytest.raises(ValueError, match=phrase):
            fn(q, k, v, module=module)
