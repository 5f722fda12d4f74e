"""The package's shape: what a bare install imports, which extra each part names, which way imports run."""

import ast
import importlib
import inspect
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
             "jaxattn._backends", "jaxattn._conformance", "jaxattn._logits", "jaxattn._dpa",
             "jaxattn._checks", "jaxattn._extras", "jaxattn._typing", "jaxattn.io", "jaxattn.progress",
             "jaxattn._exported"},
    "probes": {"jaxattn", "jaxattn.probes"},
    "models": {"jaxattn.checkpoint", "jaxattn.gpt2", "jaxattn.bert", "jaxattn._nn", "jaxattn.train", "jaxattn.nnx",
               "jaxattn.llama", "jaxattn._gguf", "jaxattn._spm", "jaxattn._llamalike", "jaxattn._sites", "jaxattn.models", "jaxattn.decoder",
               "jaxattn._sharding", "jaxattn._inputs"},
    "lab": {"jaxattn.lab", "jaxattn.viz", "jaxattn.interventions", "jaxattn.winograd"},
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


def _import_edges(path: Path) -> list[tuple[str, int]]:
    """``(module, line)`` for every jaxattn module the file imports, at any depth (a function's own imports too).

    ``from jaxattn.x import name`` is an edge to ``jaxattn.x.name`` when that is a module (what Python
    executes), else to ``jaxattn.x``; ``import jaxattn`` and ``from jaxattn import attention`` are edges to
    the package's face, ``jaxattn/__init__.py``. Relative imports are resolved against the file's package.
    A submodule's implicit import of its parent packages is not an edge: the parent is already running or
    done when its submodule runs.
    """
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    edges = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            if base and base.split(".")[0] == "jaxattn":
                edges += [(_target(base, a.name), node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            edges += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "jaxattn"]
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold a cycle (two or more nodes, or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_cycles_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_jaxattn_modules():
    files = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {module: set() for module in files}
    where: dict[tuple[str, str], int] = {}
    unknown = []
    for module, path in files.items():
        for target, line in _import_edges(path):
            if target not in files:
                unknown.append(f"{module}:{line} imports {target}, which is no module of the package")
                continue
            graph[module].add(target)
            where.setdefault((module, target), line)
    assert not unknown, "\n".join(unknown)
    report = []
    for component in _cycles(graph):
        inside = [f"  {a}:{where[a, b]} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
        report.append(f"import cycle among {component}:\n" + "\n".join(inside))
    assert not report, "\n".join(report)


def test_experiments_use_public_names_only():
    private = []
    for path in sorted((ROOT / "experiments").glob("*.py")):
        for module, names in _imports(path):
            if any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names):
                private.append(f"{path.name}: {module} {names}")
    assert not private, "\n".join(private)


def _puts_the_checkout_first(tree: ast.Module) -> int | None:
    """The line of a top-level ``sys.path.insert(0, <the checkout>)``, or None."""
    for node in tree.body:
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "sys.path.insert" and ast.unparse(node.value.args[0]) == "0"
                and "parent.parent" in ast.unparse(node.value.args[1])):
            return node.lineno
    return None


def test_experiments_import_the_checkouts_own_jaxattn():
    # Each script that imports jaxattn at its top level first puts its checkout at the head of sys.path;
    # one that imports it only inside functions does the same at its top, or (the two that import it only
    # in child processes) hands those the checkout through PYTHONPATH.
    problems = []
    for path in sorted((ROOT / "experiments").glob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               and any(m.split(".")[0] == "jaxattn" for m in
                       ([n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]))]
        first = _puts_the_checkout_first(tree)
        if top and (first is None or first > min(top)):
            problems.append(f"{path.name}:{min(top)} imports jaxattn before putting its checkout first on sys.path")
        if not top and _imports(path) and first is None and "PYTHONPATH" not in path.read_text():
            problems.append(f"{path.name} imports jaxattn in child processes without handing them the checkout")
    assert not problems, "\n".join(problems)


def test_an_experiment_runs_its_checkouts_jaxattn_over_an_installed_one(tmp_path):
    # Another "jaxattn" first on PYTHONPATH (as another checkout installed in development mode would be):
    # the script must still import the package beside it.
    impostor = tmp_path / "jaxattn"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("raise ImportError('the other jaxattn was imported')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_sweep.py"), "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "usage" in run.stdout, run.stderr[-2000:]
    assert "the other jaxattn" not in run.stderr


def test_no_public_module_only_reexports_a_private_one():
    # A public x.py that re-exports _x.py hides where its names live: define them in x.py instead.
    for path in PACKAGE.glob("*.py"):
        if not path.name.startswith("_"):
            assert not (PACKAGE / f"_{path.name}").exists(), f"{path.name} beside _{path.name}"


def _public_modules() -> dict[str, Path]:
    """Every public module of the package: a file none of whose path parts is private, or a package's face."""
    paths = sorted(PACKAGE.rglob("*.py"))
    public = [p for p in paths if not any(part.startswith("_") for part in p.relative_to(ROOT).parts[:-1])
              and (p.name == "__init__.py" or not p.name.startswith("_"))]
    return {_module_name(p): p for p in public}


def _top_level_names(path: Path) -> set[str]:
    """The names a file binds at its top level by ``def``, ``class`` or assignment (not by import)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _owned_files(module: str, path: Path) -> list[Path]:
    """The module's file and, for a package's face, the files of its own private submodules."""
    if path.name != "__init__.py":
        return [path]
    return [path] + sorted(p for p in path.parent.glob("_*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("module", sorted(_public_modules()))
def test_every_public_module_has_all_and_owns_its_names(module):
    # A name is owned by a module when it is defined there or in one of the module's own private
    # submodules (jaxattn.probes._rows for jaxattn.probes, jaxattn._attention for jaxattn), never when it
    # is imported from another module: each name of __all__ has one home, where its docs live.
    mod = importlib.import_module(module)
    assert hasattr(mod, "__all__"), f"{module} has no __all__"
    assert len(set(mod.__all__)) == len(mod.__all__), f"{module}.__all__ repeats a name"
    defined = set().union(*(_top_level_names(p) for p in _owned_files(module, _public_modules()[module])))
    foreign = []
    for name in mod.__all__:
        assert not name.startswith("_"), f"{module}.__all__ lists the private name {name}"
        assert hasattr(mod, name), f"{module}.__all__ lists {name}, which the module does not have"
        obj = getattr(mod, name)
        if inspect.ismodule(obj):
            home = obj.__name__
            ok = home == f"{module}.{name}"
        elif callable(obj) or inspect.isclass(obj):
            home = getattr(obj, "__module__", None)
            ok = home == module or (home or "").startswith(module + "._")
        else:
            home = "another module (imported here, not assigned)"
            ok = name in defined
        if not ok:
            foreign.append(f"{module}.{name} is defined in {home}")
    assert not foreign, "\n".join(foreign)


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
         ("jaxattn.nnx", "nnx"), ("jaxattn.llama", "models"), ("jaxattn.interventions", "models"),
         ("jaxattn.winograd", "models")]


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
