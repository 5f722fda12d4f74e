"""Programs kept on disk as ``jax.export`` artifacts, so that a later run skips tracing and lowering them.

JAX's persistent compilation cache keeps compiled executables, but finds them by the lowered program, so
every run still traces and lowers a program before it can look it up: for the saturation sweep (ten
``d_k`` traced into one program per dtype) that is most of a warm run. With a folder set
(:func:`keep_in`, which :func:`jaxattn.io.use_compilation_cache` calls with ``<cache>/exported``),
:func:`call` keeps the program's exported StableHLO there, named by a hash of everything the program
depends on: its name, its static arguments, the shapes and dtypes of its inputs, the jaxattn sources,
the jax and jaxlib versions, the backend and whether 64-bit types are on. A later run deserializes it and
calls it (its compilation then comes from the persistent cache). The executable is compiled from the
same StableHLO, so results are the same, bit for bit (tested). Serialization needs the ``flatbuffers``
package (``jaxattn[lab]``); without it, or with no folder set, :func:`call` runs the jitted program.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import jax

_FOLDER: list[Path | None] = [None]
_LOADED: dict[str, Any] = {}  # key -> Exported, so a second call in one process reuses its jitted caller


def can_serialize() -> bool:
    """Whether ``jax.export`` can serialize here (it needs the ``flatbuffers`` package)."""
    return importlib.util.find_spec("flatbuffers") is not None


def keep_in(folder: str | os.PathLike | None) -> None:
    """Keep exported programs in ``folder`` from now on (created when first written); ``None``: stop."""
    _FOLDER[0] = None if folder is None else Path(folder)


def folder() -> Path | None:
    """The folder exported programs are kept in, or None (off)."""
    return _FOLDER[0]


@functools.lru_cache(maxsize=1)
def _sources() -> str:
    """A hash of every jaxattn source file: a changed program is never read from an older artifact."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _key(name: str, args: tuple, statics: dict[str, Any]) -> str:
    import jaxlib

    leaves, tree = jax.tree.flatten(args)
    avals = [str(jax.typeof(x)) for x in leaves]  # shape, dtype, weak type
    parts = [name, repr(sorted(statics.items())), repr(avals), str(tree), _sources(), jax.__version__,
             jaxlib.__version__, jax.default_backend(), str(jax.config.jax_enable_x64)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def call(fn: Callable[..., Any], name: str, *args: Any, **statics: Any) -> Any:
    """``fn(*args, **statics)`` (``fn`` a ``jax.jit`` whose static arguments are ``statics``), through an
    exported artifact of it when a folder is set and serialization is available."""
    where = folder()
    if where is None or not can_serialize():
        return fn(*args, **statics)
    key = _key(name, args, statics)
    exported = _LOADED.get(key)
    if exported is None:
        path = where / f"{name}-{key}.jaxexport"
        if path.is_file():
            try:
                exported = jax.export.deserialize(bytearray(path.read_bytes()))
            except Exception as e:  # a damaged file: said, then made again
                warnings.warn(f"could not read the exported program {str(path)!r} ({type(e).__name__}: {e}); "
                              "exporting it again", RuntimeWarning, stacklevel=2)
        if exported is None:
            exported = jax.export.export(fn)(*args, **statics)
            _write(path, bytes(exported.serialize()))
        _LOADED[key] = exported
    return exported.call(*args)
