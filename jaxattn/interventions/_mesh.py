"""Effect tables on a ``jax.sharding`` mesh: the interventions split over its data axis, the model as given.

A table stacks its interventions (head masks, patch masks, layers) on a leading axis and runs one
program over them (``_effects``). With ``mesh=``, that axis is padded to a whole number of rows per
device, split over the mesh's data axis, and each group of devices along it runs the same program on
its own rows (:func:`split`: a ``shard_map`` over the data axis alone, in one ``jax.jit`` under
``jax.set_mesh(mesh)``): the same function as on one device, so the same numbers. The bound's params keep their placement when they are already on
the mesh (``module.shard``: the model then runs split over the model axis too); every other array of the
bound is replicated onto the mesh. Tables come back replicated on every device of the mesh (readable by
every process under ``jax.distributed``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Array = jax.Array


def check(mesh: Any, data_axis: Any, *, used: bool = True) -> None:
    """``mesh`` a ``jax.sharding.Mesh`` holding ``data_axis`` (the axis a table's interventions are split over;
    ``used=False``: a function that splits nothing and passes ``None``), ``TypeError``/``ValueError`` naming them."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (jax.make_mesh) or None, received {type(mesh).__name__}")
    if used and (not isinstance(data_axis, str) or data_axis not in mesh.axis_names):
        raise ValueError(f"data_axis must name an axis of the mesh (its axes: {', '.join(map(repr, mesh.axis_names))}), "
                         f"received {data_axis!r}")


def _on(mesh: Any, leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def place(args: Any, mesh: Any) -> Any:
    """Every array of ``args`` on ``mesh``: already there, kept (params from ``module.shard``); else replicated."""

    def one(leaf: Any) -> Any:
        if not isinstance(leaf, (jax.Array, np.ndarray)) or _on(mesh, leaf):
            return leaf
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            raise ValueError(f"an array of the bound lives on another mesh ({leaf.sharding.mesh.shape_tuple}) than "
                             f"mesh= ({mesh.shape_tuple}): shard the params on the mesh the table runs on")
        return jax.device_put(leaf, NamedSharding(mesh, P()))

    return jax.tree.map(one, args)


@functools.lru_cache(maxsize=64)
def _split_program(program: Callable[..., Any], n_fixed: int, mesh: Any, data_axis: str) -> Callable[..., Any]:
    """``program(*fixed, *xs)`` in a ``shard_map`` over ``data_axis`` alone: each device group runs it on its
    own rows of ``xs`` (the other mesh axes stay as they are: the model split as its params are), the
    results concatenated over the groups and handed back replicated."""

    def local(*inputs):
        return program(*inputs)

    def run(*inputs):
        specs = (P(),) * n_fixed + (P(data_axis),) * (len(inputs) - n_fixed)
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(data_axis), axis_names={data_axis},
                             check_vma=False)(*inputs)

    return jax.jit(run, out_shardings=NamedSharding(mesh, P()))


def split(program: Callable[..., Any], fixed: tuple, xs: tuple, mesh: Any, data_axis: str, *,
          multiple: int = 1) -> Any:
    """``program(*fixed, *xs)`` (stacked results ``[n, ...]`` over the rows of ``xs``, each ``[n, ...]``) with
    the rows split over ``data_axis``: padded with copies of row 0 to a multiple of ``multiple`` rows per
    device (a ``lax.map`` of whole chunks), each device's rows run by one ``program`` in a ``shard_map``, the
    padded rows dropped; ``fixed`` placed on the mesh (:func:`place`), the result replicated on it."""
    n = jax.tree.leaves(xs)[0].shape[0]
    D = mesh.shape[data_axis]
    per = -(-n // D)
    per += -per % multiple
    pad = D * per - n
    xs = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, axis=0)]), xs)
    with jax.set_mesh(mesh):
        xs = jax.device_put(xs, NamedSharding(mesh, P(data_axis)))
        out = _split_program(program, len(fixed), mesh, data_axis)(*place(fixed, mesh), *xs)
        return jax.tree.map(lambda a: a[:n], out)


def mesh_map(fn: Callable[[Any, Any], Array], args: Any, xs: Any, chunk: int | None, mesh: Any,
             data_axis: str) -> Any:
    """``[fn(args, x) for x in xs]`` stacked, the items split over ``data_axis``, ``chunk`` at a time on each
    device (:func:`split` of one ``jit(lax.map)``), replicated on ``mesh``."""
    total = jax.tree.leaves(xs)[0].shape[0]
    per = -(-total // mesh.shape[data_axis])
    size = per if chunk is None else min(int(chunk), per)
    return split(map_program(fn, size), (args,), (xs,), mesh, data_axis, multiple=size)


@functools.lru_cache(maxsize=64)
def map_program(fn: Callable[[Any, Any], Array], size: int) -> Callable[[Any, Any], Array]:
    """``jit(lax.map(fn, xs, batch_size=size))``, kept per ``(fn, size)``: on one device or on each
    device group of a mesh, the same program."""
    return jax.jit(lambda args, xs: jax.lax.map(lambda x: fn(args, x), xs, batch_size=size))


def run(fn: Callable[..., Any], mesh: Any, *args: Any, replicate: bool = False) -> Any:
    """``fn(*args)`` with ``args`` placed on ``mesh`` (:func:`place`), under ``jax.set_mesh(mesh)``; with
    ``replicate``, the result replicated on every device (a table handed back)."""
    with jax.set_mesh(mesh):
        out = fn(*place(args, mesh))
        return jax.device_put(out, NamedSharding(mesh, P())) if replicate else out
