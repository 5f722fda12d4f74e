"""Models on a ``jax.sharding`` mesh: where each parameter lives, and what the forward adds under Explicit axes.

Placement (every model module's ``shard``). A family declares, per weight, which of its dims is a
LOGICAL axis split over the mesh's model axis (:data:`HEADS`, :data:`KV_HEADS` or :data:`MLP`), Megatron
style: q, k, v column-split by heads, the output projection row-split by heads, the MLP's first matrices
column-split and its last row-split by hidden unit, so that each device computes whole heads and a slice
of the MLP, and each sublayer's output is one sum over the model axis. Every other weight (norms,
embeddings, biases of the residual stream) is replicated (the embedding's rows may be split too,
:data:`VOCAB`). :func:`layout` turns a declaration into ``NamedSharding``s (a :class:`Layout`), refusing a logical size the model axis does not divide, and
:func:`put` sends arrays there (also one tensor at a time while loading: :func:`placer`).

The forward under Explicit axes (``jax.make_mesh``'s default). Sharding in types follows the params
through q, k, v, the attention maps and ``z`` (heads split over the model axis, a batch vmapped over
the data axis). Where a type cannot be decided locally (a sum over heads or hidden units split over the
model axis, a row lookup by token ids split over the data axis, the attention's bookkeeping of
non-finite values) the model runs that piece through :func:`auto`: inside it the mesh's axes are Auto
(XLA's partitioner places it, as under Auto axes), and its outputs leave with the shardings it is given:
replicated over the per-example dims, or split by heads like ``q`` (a vmapped batch axis keeps its split). Without a
mesh, or under Auto axes, :func:`auto` and :func:`zeros` add nothing to the program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxattn._checks import check_float_dtype
from jaxattn.checkpoint import flatten, unflatten

Array = jax.Array

# The logical axes a family may declare; the first three are split over the model axis (Megatron).
HEADS = "heads"  # query heads (q, and the output projection's input)
KV_HEADS = "kv_heads"  # key/value heads (k, v)
MLP = "mlp"  # the MLP's hidden units
VOCAB = "vocab"  # the token embedding's rows (and an untied head's columns): with split_vocab (vocab-parallel)


def _check_axis(mesh: Any, axis: Any, keyword: str, where: str) -> None:
    if not isinstance(axis, str):
        raise TypeError(f"{where}: {keyword} must be a mesh axis name (str) or None, received {axis!r}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{where}: the mesh has no axis {axis!r} (its axes: {', '.join(map(repr, mesh.axis_names))}); "
                         f"name the axis to use with {keyword}=")


def check_mesh(mesh: Any, where: str, **axes: Any) -> None:
    """``mesh`` a concrete ``jax.sharding.Mesh`` holding each named axis (``None``: not used)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh (jax.make_mesh), received {type(mesh).__name__}")
    for keyword, axis in axes.items():
        if axis is not None:
            _check_axis(mesh, axis, keyword, where)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _rule(key: str, rules: Mapping[str, tuple[str | None, ...]]) -> tuple[str | None, ...] | None:
    """The rule of the longest key suffix (whole ``/``-separated parts) that matches ``key``."""
    parts = key.split("/")
    best = None
    for suffix, dims in rules.items():
        want = suffix.split("/")
        if parts[-len(want):] == want and (best is None or len(want) > best[0]):
            best = (len(want), dims)
    return None if best is None else best[1]


class Layout(NamedTuple):
    """Where a family's weights go on a mesh: :meth:`sharding` of any weight by its key and shape."""

    mesh: Any
    rules: Mapping[str, tuple[str | None, ...]]
    assign: Mapping[str, str | None]  # logical axis -> mesh axis (None: not split)
    where: str

    def sharding(self, key: str, shape: tuple[int, ...]) -> NamedSharding:
        dims = _rule(key, self.rules) or (None,) * len(shape)
        if len(dims) == len(shape) - 1:  # a block's weight stacked over the layers: the layer axis is replicated
            dims = (None, *dims)
        if len(dims) != len(shape):
            raise ValueError(f"{self.where}: weight '{key}' has shape {tuple(shape)}, its split rule {dims} "
                             f"names {len(dims)} dims")
        return NamedSharding(self.mesh, PartitionSpec(*(None if d is None else self.assign[d] for d in dims)))


def layout(rules: Mapping[str, tuple[str | None, ...]], counts: Mapping[str, tuple[str, int]], mesh: Any, *,
           model_axis: str | None, split_vocab: bool, where: str) -> Layout:
    """A checked :class:`Layout`.

    Args:
      rules: ``{key suffix: logical axis per dim}`` (``None`` for a dim that is not split), the longest
        suffix of whole key parts that matches wins; a weight no rule matches is replicated.
      counts: ``{logical axis: (config field, size)}``: how many heads, hidden units or tokens each logical
        axis holds (a weight's dim may hold several features per head), checked against the model axis.
      mesh: a ``jax.sharding.Mesh``.
      model_axis: the mesh axis :data:`HEADS`, :data:`KV_HEADS` and :data:`MLP` are split over; ``None``
        replicates every weight.
      split_vocab: split :data:`VOCAB` over ``model_axis`` too.
      where: the public function, for messages.

    Raises:
      ValueError: an axis the mesh lacks, or a logical size the model axis does not divide, naming the
        config field, its size, the axis and its size.
    """
    check_mesh(mesh, where, model_axis=model_axis)
    if not isinstance(split_vocab, bool):
        raise TypeError(f"{where}: split_vocab must be a bool, received {split_vocab!r}")
    assign = {HEADS: model_axis, KV_HEADS: model_axis, MLP: model_axis, VOCAB: model_axis if split_vocab else None}
    used = {d for dims in rules.values() for d in dims if d is not None and assign[d] is not None}
    for logical in sorted(used):
        field, count = counts[logical]
        size = mesh.shape[assign[logical]]
        if count % size:
            raise ValueError(
                f"{where}: {field}={count} ({logical}) is not divisible by the size {size} of mesh axis "
                f"{model_axis!r}; use a {model_axis!r} axis whose size divides {count} ({_divisors(count)})"
                + ("" if logical != VOCAB else ", or split_vocab=False"))
    return Layout(mesh, rules, assign, where)


def placer(dtype: Any, at: Layout | None = None) -> Callable[[str, Any], Array]:
    """``place(key, array)``: a NumPy array (or anything ``np.asarray`` reads) as a param of ``dtype``, on
    the default device (``at=None``: ``jnp.asarray``) or sent straight to its shards of the layout ``at``:
    the loaders' one tensor at a time, so a model is never whole on the host in float32."""
    dtype = check_float_dtype(dtype)
    if at is None:
        return lambda key, a: jnp.asarray(a, dtype)

    def place(key: str, a: Any) -> Array:
        a = np.asarray(a, dtype)
        return put(a, at.sharding(key, a.shape))

    return place


def put(value: Any, sharding: NamedSharding) -> Array:
    """``value`` on its shards: a ``jax.Array`` through ``jax.device_put``; a host array through
    ``jax.make_array_from_callback``, so that each process (one, or several under
    ``jax.distributed.initialize()``) sends only the slices its own devices hold."""
    if isinstance(value, jax.Array):
        return jax.device_put(value, sharding)
    a = np.asarray(value)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


_SHARD_DOC = """``params`` placed on ``mesh``: ``jax.device_put`` of each weight with a ``NamedSharding``, Megatron style.

    {what} Each device then computes whole heads and a slice of the MLP, and each sublayer's output
    is one sum over ``model_axis``. Everything else (norms, embeddings, the residual stream's biases) is
    replicated; ``split_vocab=True`` also splits the token embedding's rows over ``model_axis``
    (vocab-parallel), which saves its memory at the price of a gather across the axis in the lookup and
    the unembedding. A batch runs as ``jax.jit(jax.vmap(forward))`` over token ids split over the mesh's
    data axis, under Explicit or Auto mesh axes (``docs/scaling.md`` gives the output shardings).

    Args:
      params: the params pytree (e.g. from :func:`load`), checked by :func:`check_params` first.
      config: its config.
      mesh: a ``jax.sharding.Mesh``, e.g. ``jax.make_mesh((2, 2), ("data", "model"))``.
      model_axis: the mesh axis heads and hidden units are split over; ``None`` replicates every weight.
      split_vocab: also split the embedding's rows over ``model_axis``.

    Raises:
      ValueError: a ``model_axis`` the mesh does not have, or a head count or width the axis size does
        not divide, naming the config field, its size, the axis and its size.
    """

_SHARDINGS_DOC = """``{key: NamedSharding}``: where :func:`shard` puts each weight of :func:`param_shapes` on ``mesh``.

    For placing arrays as they are made: ``load(..., mesh=)`` sends each tensor there as it is read, and
    ``jax.jit(init, out_shardings=jaxattn.checkpoint.unflatten(...))`` makes params in place. Arguments and
    errors as :func:`shard`.
    """


def public_api(name: str, *, param_shapes: Callable[[Any], Mapping[str, tuple[int, ...]]],
               check_params: Callable[[Any, Any], None], rules: Mapping[str, tuple[str | None, ...]],
               counts: Callable[[Any], Mapping[str, tuple[str, int]]], what: str) -> tuple[Callable, Callable, Callable]:
    """A model module's ``(shard, param_shardings, layout_of)``: one signature and docstring for every family
    (``what`` says which of its weights are split how), and ``layout_of(config, mesh, *, model_axis,
    split_vocab, where)``, the :class:`Layout` its loader places tensors with."""

    def layout_of(config: Any, mesh: Any, *, model_axis: str | None = "model", split_vocab: bool = False,
                  where: str = f"{name}.load") -> Layout:
        return layout(rules, counts(config), mesh, model_axis=model_axis, split_vocab=split_vocab, where=where)

    def param_shardings(config: Any, mesh: Any, *, model_axis: str | None = "model",
                        split_vocab: bool = False) -> dict[str, NamedSharding]:
        where = layout_of(config, mesh, model_axis=model_axis, split_vocab=split_vocab,
                          where=f"{name}.param_shardings")
        return {key: where.sharding(key, shape) for key, shape in param_shapes(config).items()}

    def shard(params: Any, config: Any, mesh: Any, *, model_axis: str | None = "model",
              split_vocab: bool = False) -> dict:
        check_params(params, config)
        where = layout_of(config, mesh, model_axis=model_axis, split_vocab=split_vocab, where=f"{name}.shard")
        return unflatten({key: put(value, where.sharding(key, np.shape(value))) for key, value in flatten(params).items()})

    shard.__doc__ = _SHARD_DOC.format(what=what)
    param_shardings.__doc__ = _SHARDINGS_DOC
    for fn in (shard, param_shardings):
        fn.__module__, fn.__qualname__ = name, fn.__name__
    return shard, param_shardings, layout_of


# ----------------------------------------------------------------------------------------------------
# The forward under Explicit axes
# ----------------------------------------------------------------------------------------------------


def explicit_mesh(*trees: Any) -> Any:
    """The abstract mesh of the first array leaf of ``trees`` whose type has Explicit axes, else ``None``.

    Read from the arrays' types (``jax.typeof``), so it works on tracers, with or without ``jax.set_mesh``.
    """
    for leaf in jax.tree.leaves(trees):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and mesh.explicit_axes:
            return mesh
    return None


def auto(fn: Callable[..., Any], out_specs: Any = None) -> Callable[..., Any]:
    """``fn``, or, when its array arguments carry Explicit mesh axes, ``fn`` run with those axes Auto
    (``jax.sharding.auto_axes``; the Manual axes of a ``shard_map`` stay Manual) and its outputs placed by
    ``out_specs`` (a ``PartitionSpec`` or a pytree prefix of them; ``None``: every output replicated over
    its own dims). A vmapped batch axis keeps its split. Arguments that are not arrays (configs) must be
    closed over."""

    def run(*args: Any) -> Any:
        mesh = explicit_mesh(args)
        if mesh is None:
            return fn(*args)
        specs = PartitionSpec() if out_specs is None else out_specs
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
        return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=shardings)(*args)

    return run


def _sharding_of(x: Any) -> Any:
    return x.sharding if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x).sharding


def head_specs(q: Any) -> tuple[PartitionSpec, PartitionSpec]:
    """``out_specs`` for :func:`auto` of an attention ``(z [T, N, V], weights [N, T, S])``: split over the
    mesh axes of the tokens and heads of ``q [T, N, H]`` (an array or a ``jax.ShapeDtypeStruct``)."""
    t, n = (tuple(getattr(_sharding_of(q), "spec", ())) + (None, None))[:2]
    return PartitionSpec(t, n, None), PartitionSpec(n, t, None)


def maps_like(weights: Array, q: Any) -> Array:
    """``weights [L, N, T, S]`` (a buffer of every layer's maps) split like the maps of ``q [T, N, H]`` under
    Explicit axes (``jax.sharding.reshard``); as it is otherwise."""
    mesh = getattr(_sharding_of(q), "mesh", None)
    if mesh is None or not mesh.explicit_axes:
        return weights
    return jax.sharding.reshard(weights, NamedSharding(mesh, PartitionSpec(None, *head_specs(q)[1])))


def zeros(shape: tuple[int, ...], dtype: Any, like: Any) -> Array:
    """``jnp.zeros(shape, dtype)``; under Explicit axes with the sharding of ``like`` (an array or a
    ``jax.ShapeDtypeStruct``), whose dims are the trailing dims of ``shape`` (the leading ones
    replicated), and inside ``shard_map`` varying over the Manual axes ``like`` varies over: a buffer
    ``like`` is written into (a loop's carry must keep one type)."""
    sharding = _sharding_of(like)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.explicit_axes:
        out = jnp.zeros(shape, dtype)
    else:
        spec = tuple(sharding.spec) + (None,) * (len(like.shape) - len(sharding.spec))
        out = jnp.zeros(shape, dtype, out_sharding=NamedSharding(sharding.mesh, PartitionSpec(
            *(None,) * (len(shape) - like.ndim), *spec)))
    varying = tuple(sorted(getattr(_manual_axis_type(like), "varying", ())))
    return jax.lax.pcast(out, varying, to="varying") if varying else out


def _manual_axis_type(x: Any) -> Any:
    """The Manual mesh axes ``x`` (an array or a ``jax.ShapeDtypeStruct``) varies over, as its type says
    (None outside ``shard_map``'s types)."""
    return getattr(x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x), "manual_axis_type", None)
