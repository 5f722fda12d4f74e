"""Build jaxattn's HTML API reference from its docstrings with pdoc (the ``docs`` extra).

    python tools/api_docs.py api-docs        # what `make docs` runs; open api-docs/index.html

One page per public module: ``jaxattn`` and every module or package below it none of whose path parts
starts with ``_``. Each page lists the names of the module's ``__all__`` with their signatures and
docstrings (Google style). Annotations pdoc cannot resolve (jaxtyping's shapes, imported for type
checkers only) are shown as written, without a warning.

The output folder is only ever replaced whole, and only if this tool wrote it: the reference is built in
a new temporary folder beside it, which then takes its place (the old one is removed after the swap), so
a build that fails halfway leaves the old reference as it was. A folder that holds anything this tool
did not write (recognised by the marker file it leaves, ``.jaxattn-api-docs``, or by holding nothing but
pdoc's pages of jaxattn) is refused, naming it: a mistyped folder is never emptied.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
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


MARKER = ".jaxattn-api-docs"  # written into every reference this tool builds: a folder it may replace
_MARKER_TEXT = "The API reference of jaxattn, written by tools/api_docs.py; the tool replaces this folder whole.\n"


class OutputFolderError(ValueError):
    """The output folder cannot take the reference: it is a file, or holds what this tool did not write."""


def _pdoc_pages(modules: list[str]) -> set[str]:
    """The names pdoc writes at the top of the output folder for ``modules``."""
    tops = {m.split(".")[0] for m in modules}
    return {"index.html", "search.js"} | tops | {f"{t}.html" for t in tops}


def check_output_folder(out: Path, modules: list[str]) -> None:
    """Refuse ``out`` unless it is missing, empty, or a reference this tool wrote.

    Raises:
      OutputFolderError: ``out`` is not a folder, or holds a file neither this tool nor pdoc wrote
        (the message names the folder and one such entry).
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputFolderError(f"{out}: exists and is not a folder; give the folder for the API reference")
    names = sorted(p.name for p in out.iterdir())
    if not names or MARKER in names:
        return
    foreign = [n for n in names if n not in _pdoc_pages(modules)]
    if foreign:
        raise OutputFolderError(
            f"{out}: refusing to replace a folder this tool did not write (no {MARKER} in it, and it holds "
            f"{foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); "
            f"give a new or empty folder, or remove this one yourself")


def _swap_in(new: Path, out: Path) -> None:
    """Put the folder ``new`` at ``out`` (both in one folder), removing what ``out`` held after the swap."""
    if not out.exists():
        os.replace(new, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old.", suffix=".tmp"))
    os.replace(out, old / out.name)  # a rename: the old reference is whole until the new one is in place
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old / out.name, out)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def build(out: Path) -> list[str]:
    """Write the reference into the folder ``out``, replacing it whole; returns the modules documented.

    ``out`` may be missing, empty, or a reference this tool wrote (see the module's docstring); it is
    replaced only once the new reference is complete, so on any failure it is left as it was.

    Raises:
      OutputFolderError: ``out`` is a file, or a folder this tool did not write (nothing is written).
    """
    import pdoc
    import pdoc.render

    out = Path(out).absolute()
    modules = public_modules()
    check_output_folder(out, modules)
    given = [m for m in modules if not _in_parents_all(m)]  # pdoc documents those with their parent
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.new.", suffix=".tmp"))
    try:
        pdoc.render.configure(docformat="google", math=False, show_source=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Error parsing type annotation")
            pdoc.pdoc(*given, output_directory=new)
        (new / MARKER).write_text(_MARKER_TEXT, encoding="utf-8")
        new.chmod(0o755)  # mkdtemp creates 0700; the reference is meant to be read
        _swap_in(new, out)
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)
    return modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="api-docs", help="output folder (default api-docs)")
    args = parser.parse_args(argv)
    try:
        modules = build(Path(args.out))
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the API reference to {args.out}/ ({e}); {args.out} is as it was", file=sys.stderr)
        return 2
    print(f"wrote the API reference of {len(modules)} modules to {args.out}/ (open {args.out}/index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
