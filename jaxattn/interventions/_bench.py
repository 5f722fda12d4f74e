"""Timing effect tables: each way of running them, wall and CPU time, compilation apart from the steady state.

What ``experiments/heads.py --parts bench`` measures, as a function that returns data (nothing printed).

Axis alphabet: L layers, N heads, T tokens.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

Array = jax.Array

# The ways a table can run, as keyword arguments of the table functions.
WAYS = {
    "fast": {},  # resumed at each intervention's layer (the default)
    "map": {"resume": False},  # whole forwards, one lax.map program
    "loop": {"loop": True},  # whole forwards, a Python loop of one jitted forward each
}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``(result, wall seconds, CPU seconds of this process)`` of ``fn()``, its arrays ready."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0, time.process_time() - c0


def _summary(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def _largest(a: np.ndarray) -> float:
    """``max |a|``, NaN when ``a`` holds a NaN (0 for no entries)."""
    return float(np.max(np.abs(np.asarray(a, np.float64)), initial=0.0))


def _nan_max(xs: Sequence[float]) -> float:
    """The largest of ``xs``, NaN when one is NaN (Python's ``max`` keeps or drops a NaN by its place)."""
    return float(np.max(np.asarray(xs, np.float64)))


def benchmark_tables(tables: Mapping[str, Callable[..., Any]], *, ways: Sequence[str] = ("fast", "loop"),
                     repeats: int = 3) -> dict[str, Any]:
    """Time every table each way: one first call (it compiles), then ``repeats`` steady runs of them all.

    Args:
      tables: ``{name: run}`` with ``run(**kw) -> table``, ``kw`` one of :data:`WAYS` (e.g. ``lambda **kw:
        ablation_effects(bound, metric, **kw)``). Each way should get functions nothing has compiled yet
        (e.g. a fresh metric), so that its first call includes its compilation.
      ways: which of :data:`WAYS` to run, in order.
      repeats: steady runs per way (>= 1), each running every table once.

    Returns:
      ``{way: {"first": {"wall", "cpu"}, "steady": {"wall", "cpu"} (median, min, max over the repeats of
      the total over the tables), "compile_wall": first minus the steady median, "per_table": {name:
      {"first_wall", "wall", "cpu"} (medians)}}}``, ``"max_difference"`` ``{way: max |table - the first
      way's|}``, ``"max_relative_difference"`` (over each table's largest entry) and ``"interventions"``
      (entries of every table). A NaN in any way's table makes its differences NaN: it never reads as 0.

    Raises:
      ValueError: naming ``tables`` (not a non-empty mapping), ``repeats`` or ``ways``.
    """
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"tables must be a non-empty mapping {{name: run}}, received "
                         f"{dict(tables) if isinstance(tables, Mapping) else type(tables).__name__}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, received {repeats!r}")
    unknown = [w for w in ways if w not in WAYS]
    if unknown or not ways:
        raise ValueError(f"ways must name some of {tuple(WAYS)}, received {tuple(ways)}")
    out: dict[str, Any] = {"repeats": repeats, "tables": list(tables)}
    results: dict[str, dict[str, np.ndarray]] = {}
    for way in ways:
        kw = WAYS[way]
        first = {name: _timed(lambda run=run: run(**kw)) for name, run in tables.items()}
        results[way] = {name: np.asarray(r[0]) for name, r in first.items()}
        runs = [{name: _timed(lambda run=run: run(**kw))[1:] for name, run in tables.items()} for _ in range(repeats)]
        wall = [sum(r[n][0] for n in tables) for r in runs]
        cpu = [sum(r[n][1] for n in tables) for r in runs]
        first_wall = sum(r[1] for r in first.values())
        out[way] = {
            "first": {"wall": first_wall, "cpu": sum(r[2] for r in first.values())},
            "steady": {"wall": _summary(wall), "cpu": _summary(cpu)},
            "compile_wall": first_wall - float(np.median(wall)),
            "per_table": {n: {"first_wall": first[n][1], "wall": float(np.median([r[n][0] for r in runs])),
                              "cpu": float(np.median([r[n][1] for r in runs]))} for n in tables},
        }
    base = results[ways[0]]
    out["max_difference"] = {w: _nan_max([_largest(results[w][n] - base[n]) for n in tables]) for w in ways}
    out["max_relative_difference"] = {  # each table's largest difference over its largest entry
        w: _nan_max([_largest(results[w][n] - base[n]) / _nan_max([_largest(base[n]), 1e-30]) for n in tables])
        for w in ways}
    out["interventions"] = int(sum(np.asarray(t).size for t in base.values()))
    return out
