"""Files on disk: writes that are never half-done, JSON for results, output folders checked before a run,
and JAX's compilation cache folder.

A reader sees either the old file or the whole new one: data goes to a temporary file in the same
folder, which then replaces the target with ``os.replace``. :func:`prepare_output_folder` checks, before
any work, that a script's output folder can take every file it will write. :func:`use_compilation_cache`
keeps compiled programs on disk across runs; nothing here turns it on by itself. Needs only NumPy (and
JAX for the cache, imported when it is used).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "NO_CACHE_VARIABLE",
    "OutputFolderError",
    "atomic_write",
    "compilation_cache_dir",
    "compilation_cache_disabled",
    "int_at_least",
    "positive_float",
    "mesh_arg",
    "prepare_output_folder",
    "to_jsonable",
    "use_compilation_cache",
    "write_json",
]

NO_CACHE_VARIABLE = "JAXATTN_NO_CACHE"  # set to anything but "", "0", "false" or "no": no persistent cache


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[Any], None]) -> Path:
    """Write ``data`` to ``path`` atomically; returns the absolute path.

    The data goes to a temporary file beside ``path``, flushed to disk (``fsync``), then renamed over it, so
    ``path`` holds the old contents or the new, never part of them. A file replaced keeps its permission
    bits; a new one is readable by all (``0o644``), as results are meant to be.

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
            f.flush()
            os.fsync(f.fileno())
        try:  # mkstemp creates 0600: keep a replaced file's mode, else readable by all
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp, mode)
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


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 1) -> Path:
    """Write ``data`` (through :func:`to_jsonable`) to ``path`` as JSON, atomically; returns the absolute path."""
    return atomic_write(path, json.dumps(to_jsonable(data), indent=indent) + "\n")


class OutputFolderError(ValueError):
    """An output folder cannot take a run's results; the message (one line) names the folder or file and why."""


def prepare_output_folder(
    out: str | os.PathLike,
    targets: Mapping[str, str] | Sequence[str] = (),
    *,
    argument: str = "--out",
    writer: str = "the run writes",
    create: bool = True,
) -> Path:
    """Check, before a run does any work, that ``out`` is (or can be made) a writable folder in which every
    one of ``targets`` can be written; create it (unless ``create=False``). Returns its absolute path.

    A script calls this first and, on :class:`OutputFolderError`, prints the message as one line and exits
    with status 2: no compute is spent and no result is half-written. Nothing is left behind on failure:
    the folders this call created are removed again. Writability is checked with ``os.access`` and then
    by creating and removing a file there (``os.access`` alone says yes to root on a read-only mount).

    Args:
      out: the output folder; missing folders on its path are created.
      targets: the names the run writes inside ``out`` (relative; a name ending in ``/`` is a folder).
        A mapping gives each the words of whoever writes it (``{"part1.json": "part 1 writes"}``), quoted
        in the message; a sequence quotes ``writer`` for all.
      argument: how ``out`` was given (a script's option), quoted in the messages.
      writer: see ``targets``.
      create: ``False`` leaves no trace: the folders made to check that a file can be written there are
        removed again (a run that may still fail before its first result, e.g. loading a model, then
        leaves nothing behind; :func:`atomic_write` creates the folder when the first result is written).

    Raises:
      OutputFolderError: ``out`` is empty or holds a null byte, is (or lies inside) a file, cannot be
        created or written to; a file target is a folder; a folder target (or a folder on a target's path)
        is a file.
      ValueError: a target that is absolute, leaves the folder (``..``) or holds a null byte.
    """
    out = os.fspath(out)
    if isinstance(out, bytes):
        out = os.fsdecode(out)
    if out == "":
        raise OutputFolderError(f"{argument} is empty: give the folder to write the results to")
    if "\x00" in out:  # no file system takes it: refused before anything is made or looked up
        raise OutputFolderError(f"{argument} {out!r} is not a usable path: it holds a null byte (\\x00)")
    try:
        path = os.path.abspath(out)
        existing = path  # the nearest part of the path that exists
        while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
    except ValueError as e:  # e.g. an embedded null byte
        raise OutputFolderError(f"{argument} {out!r} is not a usable path: {e}") from None
    if not os.path.isdir(existing):
        if existing == path:
            raise OutputFolderError(f"{argument} {out!r} exists and is not a folder")
        raise OutputFolderError(f"{argument} {out!r} cannot be created: {existing!r} is not a folder")
    items = list(targets.items()) if isinstance(targets, Mapping) else [(t, writer) for t in targets]
    for name, who in items:
        parts = Path(name.rstrip("/")).parts
        if not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"targets: {name!r} must be a relative path inside the output folder")
        if "\x00" in name:
            raise ValueError(f"targets: {name!r} holds a null byte (\\x00), which no file name can")
        for depth in range(1, len(parts) + 1):
            target = os.path.join(path, *parts[:depth])
            is_folder = depth < len(parts) or name.endswith("/")
            if is_folder and os.path.lexists(target) and not os.path.isdir(target):
                raise OutputFolderError(f"{target!r} exists and is not a folder, but {who} into it")
            if not is_folder and os.path.isdir(target):
                raise OutputFolderError(f"{target!r} is a folder, but {who} a file there")
    created = []  # the folders makedirs will create, deepest first
    folder = path
    while folder != existing:
        created.append(folder)
        folder = os.path.dirname(folder)
    try:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
        if not create:
            _remove_empty(created)
    except (OSError, ValueError) as e:
        _remove_empty(created)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise OutputFolderError(f"{argument} {out!r}: cannot write there ({reason})") from None
    return Path(path)


def _remove_empty(folders: Sequence[str]) -> None:
    """Remove ``folders`` (deepest first), each only if empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except (OSError, ValueError):
            pass


def compilation_cache_dir() -> Path:
    """The default folder for compiled programs: ``$XDG_CACHE_HOME/jaxattn``, else ``~/.cache/jaxattn``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "jaxattn"


def compilation_cache_disabled() -> bool:
    """True when the environment variable :data:`NO_CACHE_VARIABLE` (``JAXATTN_NO_CACHE``) asks for no cache."""
    value = os.environ.get(NO_CACHE_VARIABLE, "").strip().lower()
    return value not in ("", "0", "false", "no")


_CACHE_WARNED: set[str] = set()  # default cache folders already reported unusable in this process


def _cache_problem(folder: Path) -> str | None:
    """Why no compiled program could be kept in ``folder`` (created when missing), or ``None``: it can."""
    try:
        if folder.exists() and not folder.is_dir():
            return "it is a file, not a folder"
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            return "no write permission"
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
    except (OSError, ValueError) as e:
        return e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return None


def use_compilation_cache(path: str | os.PathLike | None = None, *, enabled: bool = True) -> Path | None:
    """Keep every program JAX compiles from now on in ``path``, and load it from there in later runs.

    This turns on JAX's persistent compilation cache (``jax_compilation_cache_dir``) with no lower
    bound on compile time or entry size, so the many small programs of a lab run are kept too. It
    changes JAX's configuration for the whole process: call it once, at the start of a script, before
    the first compilation. A cached program is the same executable, so results are bit-identical.
    The saturation sweep's programs are also kept traced, as ``jax.export`` artifacts in
    ``<folder>/exported`` (when ``flatbuffers`` is installed, as ``jaxattn[lab]`` does), so a later run
    skips tracing and lowering them too; they give the same numbers, bit for bit.
    The folder is trusted: whoever can write to it can make this process run code (JAX's warning);
    keep it private.

    The cache is an optimisation. When the default folder (:func:`compilation_cache_dir`) cannot be
    used (a file in its place, no write permission, a read-only file system; a file is created and
    removed there to find out), nothing is turned on: one ``RuntimeWarning`` names the folder and why
    (once per process), and the result is ``None``.

    Args:
      path: the folder (created when needed); default :func:`compilation_cache_dir`.
      enabled: ``False`` does nothing (a script's ``--no-cache``).

    Returns:
      The folder's absolute path, or ``None`` when nothing was turned on: ``enabled=False``, the
      environment variable ``JAXATTN_NO_CACHE`` is set (to anything but ``""``, ``"0"``, ``"false"``,
      ``"no"``), or the default folder cannot be used.

    Raises:
      ValueError: an explicit ``path`` that is a file.
      OSError: an explicit ``path`` that cannot be created or written to.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, received {type(enabled).__name__}")
    if not enabled or compilation_cache_disabled():
        return None
    if path is not None:
        folder = Path(os.fspath(path)).absolute()
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"path: the compilation cache must be a folder, and {str(folder)!r} is a file")
        folder.mkdir(parents=True, exist_ok=True)
        problem = _cache_problem(folder)
        if problem is not None:
            raise PermissionError(f"path: cannot write compiled programs to {str(folder)!r} ({problem})")
    else:
        folder = compilation_cache_dir()
        problem = _cache_problem(folder)
        if problem is not None:
            if str(folder) not in _CACHE_WARNED:
                _CACHE_WARNED.add(str(folder))
                warnings.warn(
                    f"compiled programs are not kept across runs: the cache folder {str(folder)!r} cannot be used "
                    f"({problem}); set XDG_CACHE_HOME to a writable folder, or {NO_CACHE_VARIABLE}=1 to skip the cache",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: every entry, whatever its size
    from jaxattn import _exported

    _exported.keep_in(folder / "exported")  # the saturation sweep's programs, traced once (jax.export)
    return folder


# ----------------------------------------------------------------------------------------------------
# Command-line argument types shared by the experiment scripts (argparse ``type=``).
# ----------------------------------------------------------------------------------------------------


def int_at_least(minimum: int, what: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: the text as an int >= ``minimum``; anything else is argparse's usage error
    (exit 2) saying what it must be (``what`` is added to that phrase)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}{what}, received {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type=``: the text as a finite float > 0 (else a usage error, exit 2)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, received {text!r}")
    return value


positive_float.__name__ = "float > 0"


def mesh_arg(text: str) -> tuple[int, int]:
    """An argparse ``type=``: ``DATAxMODEL`` (e.g. ``2x3``) as two positive ints (else a usage error, exit 2)."""
    import argparse

    parts = text.split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"must be DATAxMODEL, two positive ints such as 2x3, received {text!r}")
    return int(parts[0]), int(parts[1])
