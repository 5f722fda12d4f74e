"""Files that are never half-written: an atomic write, and JSON for results (arrays included).

A reader sees either the old file or the whole new one: data goes to a temporary file in the same
folder, which then replaces the target with ``os.replace``. Needs only NumPy.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["atomic_write", "to_jsonable", "write_json"]


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
