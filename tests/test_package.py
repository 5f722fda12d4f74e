"""The package's shape: what a bare install imports, which extra each part names, which way imports run."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxattn"

# Layers, lowest first: a module may import its own layer and the ones below, never one above. The
# package's face (``jaxattn/__init__.py``) sits with the probes: ``import jaxattn`` gives ``jaxattn.probes``.
LAYERS = {
    "core": {"jaxattn._attention", "jaxattn._blockwise", "jaxattn._masks", "jaxattn._ring",
             "jaxattn._backends", "jaxattn._conformance",
             "jaxattn._checks", "jaxattn._extras", "jaxattn._typing", "jaxattn.io", "jaxattn.progress"},
    "probes": {"jaxattn", "jaxattn.probes"},
    "models": {"jaxattn.checkpoint", "jaxattn.gpt2", "jaxattn.bert", "jaxattn._nn", "jaxattn.train", "jaxattn.nnx",
               "jaxattn.llama", "jaxattn._gguf", "jaxattn._sites", "jaxattn.models", "jaxattn._decoder"},
    "lab": {"jaxattn.lab", "jaxattn.viz", "jaxattn.interventions"},
}
ORDER = list(LAYERS)


def _layer(module: str) -> str:
    for name, members in LAYERS.items():
        if module in members or any(module.startswith(m + ".") for m in members if m != "jaxattn"):
            return name
    raise AssertionError(f"{module} is in no layer of this test: add it to LAYERS")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, [names])`` for every jaxattn import in the file (``import x`` gives no names)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxattn":
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "jaxattn"]
    return out


def _target(module: str, name: str) -> str:
    """``module.name`` when that is a module of the package (``from jaxattn import gpt2``), else ``module``."""
    path = PACKAGE.parent / (module + "." + name).replace(".", "/")
    return f"{module}.{name}" if path.with_suffix(".py").exists() or path.is_dir() else module


def test_imports_run_one_way_core_probes_models_lab():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        own = ORDER.index(_layer(_module_name(path)))
        for module, names in _imports(path):
            for target in [_target(module, n) for n in names] or [module]:
                if ORDER.index(_layer(target)) > own:
                    wrong.append(f"{_module_name(path)} ({ORDER[own]}) imports {target} ({_layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_experiments_use_public_names_only():
    private = []
    for path in sorted((ROOT / "experiments").glob("*.py")):
        for module, names in _imports(path):
            if any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names):
                private.append(f"{path.name}: {module} {names}")
    assert not private, "\n".join(private)


def test_no_public_module_only_reexports_a_private_one():
    # A public x.py that re-exports _x.py hides where its names live: define them in x.py instead.
    for path in PACKAGE.glob("*.py"):
        if not path.name.startswith("_"):
            assert not (PACKAGE / f"_{path.name}").exists(), f"{path.name} beside _{path.name}"


BARE = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # as if not installed: find_spec returns None, import raises ImportError
import numpy as np, jaxattn
q = np.random.default_rng(0).standard_normal((3, 8)).astype("float32")
out, w = jaxattn.attention(q, q, q)
out_b, lse = jaxattn.blockwise_attention(q, q, q, block_q=2, block_k=2)
assert np.allclose(out, out_b, atol=1e-6)
print("entropy", float(jaxattn.probes.entropy(w).sum()) > 0)
for module, extra in {parts!r}:
    try:
        __import__(module)
    except ImportError as e:
        print(module, "->", e)
    else:
        print(module, "-> imported")
"""

EXTRAS = {
    "models": ["safetensors", "tokenizers", "huggingface_hub", "flax", "gguf"],
    "lab": ["matplotlib"],
    "train": ["optax"],
    "nnx": ["flax"],
}
PARTS = [("jaxattn.gpt2", "models"), ("jaxattn.bert", "models"), ("jaxattn.lab", "lab"), ("jaxattn.train", "train"),
         ("jaxattn.nnx", "nnx"), ("jaxattn.llama", "models"), ("jaxattn.interventions", "models")]


def test_core_and_probes_need_only_jax_and_numpy_and_each_part_names_its_extra():
    blocked = sorted({p for ps in EXTRAS.values() for p in ps} | {"jaxtyping", "beartype", "transformers"})
    code = BARE.format(blocked=blocked, parts=PARTS)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "entropy True"
    for (module, extra), line in zip(PARTS, lines[1:]):
        assert line.startswith(f"{module} -> {module} needs the optional dependencies of jaxattn[{extra}]"), line
        assert f"pip install 'jaxattn[{extra}]'" in line, line
        assert EXTRAS[extra][0] in line, line  # names what is missing


@pytest.mark.parametrize("module, extra", PARTS)
def test_each_part_imports_with_its_extra(module, extra):
    __import__(module)  # all extras are installed for the tests (make test installs .[all,dev])
