"""Build jaxattn's HTML API reference from its docstrings with pdoc (the ``docs`` extra).

    python tools/api_docs.py api-docs        # what `make docs` runs; open api-docs/index.html

One page per public module: ``jaxattn`` and every module or package below it none of whose path parts
starts with ``_``. Each page lists the names of the module's ``__all__`` with their signatures and
docstrings (Google style). Annotations pdoc cannot resolve (jaxtyping's shapes, imported for type
checkers only) are shown as written, without a warning.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jaxattn, whatever is installed


def public_modules(package: Path = ROOT / "jaxattn") -> list[str]:
    """``jaxattn`` and its public modules and packages, sorted by name."""
    names = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            names.add(".".join(parts))
    return sorted(names)


def _in_parents_all(module: str) -> bool:
    """Whether the package above ``module`` names it in its ``__all__`` (``jaxattn.probes``): pdoc walks those."""
    parent, _, leaf = module.rpartition(".")
    return bool(parent) and leaf in getattr(importlib.import_module(parent), "__all__", ())


def build(out: Path) -> list[str]:
    """Write the reference into ``out`` (emptied first); returns the modules documented."""
    import pdoc
    import pdoc.render

    modules = public_modules()
    given = [m for m in modules if not _in_parents_all(m)]  # pdoc documents those with their parent
    if out.exists():
        for path in sorted(out.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
    pdoc.render.configure(docformat="google", math=False, show_source=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Error parsing type annotation")
        pdoc.pdoc(*given, output_directory=out)
    return modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="api-docs", help="output folder (default api-docs)")
    args = parser.parse_args(argv)
    modules = build(Path(args.out))
    print(f"wrote the API reference of {len(modules)} modules to {args.out}/ (open {args.out}/index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
