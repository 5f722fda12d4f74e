"""The documentation holds up in a clone: the API reference lists every public name with its signature and
docstring, every relative link and repository path in README.md and docs/ names a file that exists, and
the ring example of docs/core.md runs as written, its gradient included."""

import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests._oracle import assert_close, reference_forward, reference_vjp

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


api_docs = _tool("api_docs")


# ----------------------------------------------------------------------------------------------------
# The API reference (make docs)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("api-docs")
    return out, api_docs.build(out)


def _section(page: str, name: str) -> str:
    """The ``<section id="name">`` of a pdoc page, up to the next section."""
    start = page.find(f'<section id="{name}">')
    assert start >= 0, f"no section for {name}"
    end = page.find("<section id=", start + 1)
    return page[start:] if end < 0 else page[start:end]


def test_public_modules_are_every_module_without_a_private_part():
    modules = api_docs.public_modules()
    assert {"jaxattn", "jaxattn.gpt2", "jaxattn.llama", "jaxattn.bert", "jaxattn.interventions", "jaxattn.probes",
            "jaxattn.models", "jaxattn.viz", "jaxattn.lab"} <= set(modules)
    assert not [m for m in modules if any(part.startswith("_") for part in m.split("."))]


def test_the_api_reference_lists_every_name_of_every_all_with_its_signature_and_docstring(reference):
    out, modules = reference
    assert (out / "index.html").is_file()
    missing = []
    for module in modules:
        page_path = out.joinpath(*module.split(".")).with_suffix(".html")
        assert page_path.is_file(), f"no page for {module}"
        page = page_path.read_text(encoding="utf-8")
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj):
                if f'href="{name}.html"' not in page and f'href="{module.rpartition(".")[2]}/{name}.html"' not in page:
                    missing.append(f"{module}.{name}: no link to its page")
                continue
            if f'<section id="{name}">' not in page:
                missing.append(f"{module}.{name}: no section")
                continue
            section = _section(page, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                if f'<span class="name">{name}</span>' not in section:
                    missing.append(f"{module}.{name}: no name in its section")
                if inspect.isfunction(obj) and '<span class="signature' not in section:
                    missing.append(f"{module}.{name}: no signature")
                doc = inspect.getdoc(obj)
                if doc:
                    words = re.findall(r"\b[A-Za-z]{4,}\b", re.sub(r":\w+:", "", doc.split("\n")[0]))[:4]  # plain words of its first line
                    text = html.unescape(re.sub(r"<[^>]+>", "", section))
                    if 'class="docstring"' not in section or not all(w in text for w in words):
                        missing.append(f"{module}.{name}: its docstring is not on the page")
    assert not missing, "\n".join(missing)


def test_every_callable_in_an_all_has_a_docstring():
    bare = []
    for module in api_docs.public_modules():
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and not inspect.getdoc(obj):
                bare.append(f"{module}.{name}")
    assert not bare, "no docstring: " + ", ".join(bare)


# ----------------------------------------------------------------------------------------------------
# Links and paths
# ----------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
TOP = ("jaxattn/", "experiments/", "tests/", "docs/", "tools/", "data/", ".ci/")
PATH = re.compile(r"`((?:%s)[^`\s]*?)`" % "|".join(re.escape(t) for t in TOP))  # `jaxattn/x.py` and the like


def _links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold code, not links
    return LINK.findall(text)


def test_the_link_finder_finds_links_and_only_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](one.md) ![b](pic.png \"t\") [c](https://x.org) `[d](not.md)`\n```\n[e](code.md)\n```\n")
    assert _links(page) == ["one.md", "pic.png", "https://x.org", "not.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_of_the_repository(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor of this page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists() or ROOT not in path.parents:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to files the repository does not have: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(page):
    text = page.read_text(encoding="utf-8")
    named = {m.rstrip("/.,:") for m in PATH.findall(text)}
    named = {n.split("::")[0] for n in named if "*" not in n and "<" not in n and "{" not in n}
    absent = sorted(n for n in named if not (ROOT / n).exists() and not (ROOT / n.split(":")[0]).exists())
    assert not absent, f"{page.relative_to(ROOT)} names paths the repository does not have: {absent}"
    assert "../shared" not in text, f"{page.relative_to(ROOT)} points at ../shared, which a clone does not have"


# ----------------------------------------------------------------------------------------------------
# The ring example of docs/core.md, on 4 host devices
# ----------------------------------------------------------------------------------------------------

RING_SAVE = """
np.savez({out!r}, q=np.asarray(q), k=np.asarray(k), v=np.asarray(v), out=np.asarray(out), dq=np.asarray(dq),
         dk=np.asarray(dk), dv=np.asarray(dv), value=np.asarray(value),
         dq_spec=str(dq.sharding.spec), devices=jax.device_count())
"""


def _ring_example() -> str:
    text = (ROOT / "docs" / "core.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    ring = [b for b in blocks if "ring_attention_shard" in b and "value_and_grad" in b]
    assert len(ring) == 1, "docs/core.md must hold one ring example with its gradient"
    return ring[0]


@pytest.mark.slow  # a 4-device subprocess; make test runs the ring on one device (tests/test_ring.py)
def test_the_ring_example_of_core_md_runs_as_written_and_matches_the_float64_reference(tmp_path):
    saved = tmp_path / "ring.npz"
    script = tmp_path / "ring_example.py"
    script.write_text(_ring_example() + RING_SAVE.format(out=str(saved)))
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = np.load(saved)
    assert int(r["devices"]) == 4 and "batch" in str(r["dq_spec"]) and "seq" in str(r["dq_spec"])
    B, T, N, _ = r["q"].shape
    causal = np.tril(np.ones((T, T), bool))
    for b in range(B):
        for n in range(N):
            q, k, v = (r[x][b, :, n] for x in ("q", "k", "v"))
            out, _ = reference_forward(q, k, v, mask=causal)
            dq, dk, dv = reference_vjp(q, k, v, 2 * out, mask=causal)  # d(sum out²)/d out = 2 out
            for name, want in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
                assert_close(r[name][b, :, n], want, err_msg=f"{name} of example {b}, head {n}")
    assert float(r["value"]) == pytest.approx(float(np.sum(r["out"].astype(np.float64) ** 2)), rel=1e-5)
