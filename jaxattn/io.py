"""Files on disk: writes that are never half-done, JSON for results, and JAX's compilation cache folder.

A reader sees either the old file or the whole new one: data goes to a temporary file in the same
folder, which then replaces the target with ``os.replace``. :func:`use_compilation_cache` keeps
compiled programs on disk across runs; nothing here turns it on by itself. Needs only NumPy (and JAX
for the cache, imported when it is used).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = [
    "NO_CACHE_VARIABLE",
    "atomic_write",
    "compilation_cache_dir",
    "compilation_cache_disabled",
    "to_jsonable",
    "use_compilation_cache",
    "write_json",
]

NO_CACHE_VARIABLE = "JAXATTN_NO_CACHE"  # set to anything but "", "0", "false" or "no": no persistent cache


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[Any], None]) -> Path:
    """Write ``data`` to ``path`` atomically; returns the absolute path.

    Args:
      path: the file to write; its folder is created if missing.
      data: ``bytes``, ``str`` (written as UTF-8), or a function that writes to a binary file object
        (e.g. ``lambda f: fig.savefig(f, format="png")``).
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def to_jsonable(x: Any) -> Any:
    """NumPy/JAX arrays and scalars to lists and Python numbers, recursively (non-finite floats to strings)."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "__array__") and not isinstance(x, (str, bytes)):
        return to_jsonable(np.asarray(x).tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    return x


def write_json(path: str | os.PathLike, data: Any, *, indent: int = 1) -> Path:
    """Write ``data`` (through :func:`to_jsonable`) to ``path`` as JSON, atomically; returns the absolute path."""
    return atomic_write(path, json.dumps(to_jsonable(data), indent=indent) + "\n")


def compilation_cache_dir() -> Path:
    """The default folder for compiled programs: ``$XDG_CACHE_HOME/jaxattn``, else ``~/.cache/jaxattn``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "jaxattn"


def compilation_cache_disabled() -> bool:
    """True when the environment variable :data:`NO_CACHE_VARIABLE` (``JAXATTN_NO_CACHE``) asks for no cache."""
    value = os.environ.get(NO_CACHE_VARIABLE, "").strip().lower()
    return value not in ("", "0", "false", "no")


def use_compilation_cache(path: str | os.PathLike | None = None, *, enabled: bool = True) -> Path | None:
    """Keep every program JAX compiles from now on in ``path``, and load it from there in later runs.

    This turns on JAX's persistent compilation cache (``jax_compilation_cache_dir``) with no lower
    bound on compile time or entry size, so the many small programs of a lab run are kept too. It
    changes JAX's configuration for the whole process: call it once, at the start of a script, before
    the first compilation. A cached program is the same executable, so results are bit-identical.
    The folder is trusted: whoever can write to it can make this process run code (JAX's warning);
    keep it private.

    Args:
      path: the folder (created when needed); default :func:`compilation_cache_dir`.
      enabled: ``False`` does nothing (a script's ``--no-cache``).

    Returns:
      The folder's absolute path, or ``None`` when nothing was turned on: ``enabled=False``, or the
      environment variable ``JAXATTN_NO_CACHE`` is set (to anything but ``""``, ``"0"``, ``"false"``,
      ``"no"``).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, received {type(enabled).__name__}")
    if not enabled or compilation_cache_disabled():
        return None
    folder = compilation_cache_dir() if path is None else Path(os.fspath(path)).absolute()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"path: the compilation cache must be a folder, and {str(folder)!r} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: every entry, whatever its size
    return folder
