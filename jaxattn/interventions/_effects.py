"""Every head's effect on a metric, each table one compiled program: ablation, patching, gradients.

A metric is a function of the model's output (``metric(output) -> scalar``): a log-probability
difference read off the logits, or any function of an encoder's hidden states. It must return one real
number (a Python int or float, or a 0-d integer or float array); any other result (complex, boolean, not
a scalar, not a number) raises ``TypeError`` or ``ValueError`` naming ``metric`` when the table is traced.
Each table is ``[L, N]``:

- :func:`ablation_effects`: ``metric(head (l, n) zeroed) - metric(clean)``, through ``head_mask``;
- :func:`patching_effects`: ``metric(head (l, n)'s tensor replaced by value) - metric(clean)``, through
  ``patch``: activation patching from another input's run, or mean-ablation with :func:`reference_mean`;
  for a residual-stream or block-output site (:data:`POSITION_SITES`) the table is by layer and
  position, ``[L, T]``;
- :func:`joint_patching_effect`: several heads patched at once (one number), against the sum of their
  single patching effects;
- :func:`gate_gradients`: ``∂metric/∂head_mask`` at ones;
- :func:`attribution_patching`: ``Σ (value - clean) · ∂metric/∂tensor`` over the head's entries, the
  first-order estimate of :func:`patching_effects`;
- :func:`attention_gradient`: ``A ⊙ ∂metric/∂A`` for every weight ``[L, N, T, S]``; summed over a row, the
  attention × gradient attribution of that query;
- :func:`layer_gradients`: the total derivative of the metric with respect to any captured tensor.

An intervention at layer ``l`` leaves the layers below it as they are, so the L·N (or L·T) interventions
of a table resume at their own layer from the clean stream entering it (computed once), grouped by
layer, ``jax.vmap`` over ``chunk`` of them at a time beside the clean run they are measured from, in one
``jax.jit`` program that takes the weights as arguments (``_programs``; a batch whose sequences share a
prefix runs the prefix once, ``_packing``). A model module without the protocol's ``resume`` (an
encoder), or ``resume=False``, runs whole forwards: ``jax.lax.map`` over the stacked masks or patches
with ``batch_size=chunk``. Both give the same table (to float rounding).

Axis alphabet: B inputs of a batch, L layers, N heads, T queries, S keys, H head dim.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._sites import CAPTURE_NAMES, pad_site, site_shapes
from jaxattn.interventions import _mesh
from jaxattn.interventions._model import Bound, on_device
from jaxattn.interventions._programs import check_chunk as _check_chunk
from jaxattn.interventions._programs import default_float as _float
from jaxattn.interventions._programs import program as _program
from jaxattn.interventions._programs import resumable, resumed_effects
from jaxattn.interventions._programs import run_map as _run_map
from jaxattn.interventions._programs import scalar as _scalar
from jaxattn.interventions._programs import bucketed as _bucketed
from jaxattn.interventions._programs import table_args as _table_args

Array = jax.Array
Metric = Callable[[Any], Array]

# The captured tensors a head owns (their head axis is N, or K for keys and values), which can be patched per head.
HEAD_SITES = ("q", "k", "v", "attn_weights", "z")
# The residual stream and the blocks' outputs ([L, T, D]), which can be patched per layer and position.
POSITION_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def _check_bound(bound: Any) -> Bound:
    if not isinstance(bound, Bound):
        raise TypeError(f"bound must be a jaxattn.interventions.Bound (from bind), received {type(bound).__name__}")
    return bound


def _check_metric(metric: Any) -> Metric:
    if not callable(metric):
        raise TypeError(f"metric must be a function output -> scalar, received {type(metric).__name__}")
    return metric


def head_masks(n_layers: int, n_heads: int, *, value: float = 0.0) -> Array:
    """``[L·N, L, N]``: ones, with ``value`` at head ``(l, n)`` in mask ``l·N + n`` (one head ablated each)."""
    eye = jnp.eye(n_layers * n_heads, dtype=_float()).reshape(n_layers * n_heads, n_layers, n_heads)
    return 1.0 - (1.0 - value) * eye


def head_where(name: str, shape: Sequence[int], *, positions: Any = None) -> Array:
    """``[L·N, L, ...]`` boolean patch masks for ``name``: mask ``l·N + n`` selects head ``(l, n)``.

    Args:
      name: a tensor with a head axis: ``q``, ``k``, ``v`` (``[L, T, K, H]``: a query head ``n`` reads
        key/value head ``n // (N/K)``), ``attn_weights`` (``[L, N, T, S]``) or ``z`` (``[L, T, N, H]``).
      shape: the tensor's full shape ``[L, ...]`` (as captured, without a batch axis).
      positions: optional boolean ``[T]``: patch only these query positions (all when ``None``).

    Returns:
      boolean masks, size 1 along the axes they do not select (they broadcast in the patch).
    """
    if name not in HEAD_SITES:
        raise ValueError(f"name must be a tensor with a head axis, one of {HEAD_SITES}, received {name!r}")
    axes = CAPTURE_NAMES[name][0].split()
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes) + 1:
        raise ValueError(f"shape must be the {name} shape [L, {', '.join(axes)}], received {shape}")
    L = shape[0]
    head_axis = 1 + (axes.index("N") if "N" in axes else axes.index("K"))
    t_axis = 1 + axes.index("T")
    keep = [1] * len(shape)
    keep[0], keep[head_axis] = L, shape[head_axis]
    if positions is not None:
        pos = np.asarray(positions)
        if pos.dtype != np.bool_ or pos.shape != (shape[t_axis],):
            raise ValueError(f"positions must be boolean [T] = ({shape[t_axis]},), received dtype {pos.dtype.name} shape {pos.shape}")
        keep[t_axis] = shape[t_axis]
    heads = shape[head_axis]
    out = np.zeros((L * heads, *keep), bool)
    for i in range(L * heads):
        index = [i, i // heads] + [slice(None)] * (len(shape) - 1)
        index[1 + head_axis] = i % heads
        out[tuple(index)] = True
    if positions is not None:
        pos_shape = [1] * (len(shape) + 1)
        pos_shape[1 + t_axis] = shape[t_axis]
        out = out & pos.reshape(pos_shape)
    return jnp.asarray(out)


def metric_value(bound: Bound, metric: Metric) -> Array:
    """``metric(bound())``: the clean value every table is measured from (compiled)."""
    _check_bound(bound), _check_metric(metric)
    return _program(_clean_fn(bound.apply, metric), None)(_table_args(bound, metric), None)


@functools.lru_cache(maxsize=64)
def _clean_fn(apply: Callable[..., Any], metric: Metric) -> Callable[[Any, Any], Array]:
    return lambda args, _: _scalar(metric, apply(args), args)


@functools.lru_cache(maxsize=64)
def _mask_fn(apply: Callable[..., Any], metric: Metric) -> Callable[[Any, Any], Array]:
    return lambda args, mask: _scalar(metric, apply(args, head_mask=mask), args)


@functools.lru_cache(maxsize=64)
def _patch_fn(apply: Callable[..., Any], metric: Metric, name: str) -> Callable[[Any, Any], Array]:
    return lambda args_value, where: _scalar(metric, apply(args_value[0], patch={name: (args_value[1], where)}),
                                             args_value[0])


@functools.lru_cache(maxsize=64)
def _position_patch_fn(apply: Callable[..., Any], metric: Metric, name: str, L: int,
                       T: int) -> Callable[[Any, Any], Array]:
    """Patch ``name`` at one ``(layer, position)`` pair (``[2]`` ints; ``(-1, -1)`` patches nothing): the
    ``where [L, T, 1]`` is made inside the program from the pair, not stored for all L·T of them."""

    def fn(args_value, at):
        where = (jnp.arange(L)[:, None, None] == at[0]) & (jnp.arange(T)[None, :, None] == at[1])  # [L, T, 1]
        return _scalar(metric, apply(args_value[0], patch={name: (args_value[1], where)}), args_value[0])

    return fn


def ablation_effects(bound: Bound, metric: Metric, *, chunk: int | None = 16, value: float = 0.0,
                     resume: bool = True, mesh: Any = None, data_axis: str = "data") -> Array:
    """``[L, N]``: ``metric(head (l, n) multiplied by value) - metric(clean)``; ``value=0`` ablates.

    Every ablation multiplies one head's output ``z`` by ``value`` through ``head_mask`` (Hugging Face's
    meaning), so the head adds ``value ·`` its usual contribution to the residual stream. The clean
    metric comes from the same compiled program (an all-ones mask), so a head with no effect gives 0.

    Args:
      bound: the model on its inputs (:func:`bind`).
      metric: ``output -> scalar``.
      chunk: how many runs go at once (``jax.vmap``) inside the one program: at most ``chunk`` copies of
        the activations are alive. Resumed, a batch holds one layer's heads and the clean run they are
        measured from (at least 2 runs); ``None`` runs a layer's heads at once (all L·N, whole forwards).
      value: the gate of the ablated head, a finite real number (0: removed; 1: no change).
      resume: resume each ablation at its layer from the clean stream entering it (when the model has the
        protocol's ``resume``; see the module docstring); ``False``: whole forwards in one ``lax.map``.
      mesh: a ``jax.sharding.Mesh``: the L·N ablations are split over its ``data_axis`` (``chunk`` at a
        time on each device) and the model runs as its params are placed (``module.shard``: split over the
        model axis too; otherwise replicated); the table comes back replicated on the mesh. ``None``: one
        device.
      data_axis: the mesh axis the ablations are split over.

    Raises:
      TypeError, ValueError: naming ``bound``, ``metric`` (also for a result that is not a real scalar),
        ``chunk``, ``value``, ``mesh`` or ``data_axis``.
    """
    _check_bound(bound), _check_metric(metric)
    value = _check_gate(value)
    if mesh is not None:
        _mesh.check(mesh, data_axis)
    L, N = bound.n_layers, bound.n_heads
    _check_chunk(chunk, L * N)
    if resume and resumable(bound):
        return resumed_effects(bound, metric, kind="gate", G=N, extra=on_device(np.asarray(value, _float())), chunk=chunk,
                               shape=(L, N), mesh=mesh, data_axis=data_axis)
    masks = jnp.concatenate([jnp.ones((1, L, N), _float()), head_masks(L, N, value=value)])
    return _run_map(_table_args(bound, metric), _mask_fn(bound.apply, metric), masks, chunk, mesh, data_axis).reshape(L, N)


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def _check_gate(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"value must be a real number (the ablated head's gate), received {type(value).__name__}")
    if not np.isfinite(value):
        raise ValueError(f"value must be finite (the ablated head's gate), received {value!r}")
    return float(value)


def _value_shape(bound: Bound, name: str, value: Array) -> tuple[int, ...]:
    rank = 1 + len(CAPTURE_NAMES[name][0].split())
    if value.ndim == rank + 1 and bound.batch is not None:
        if value.shape[0] != bound.batch:
            raise ValueError(f"value must have the bound's batch of B = {bound.batch} inputs on its first axis "
                             f"([B, L, ...]; or no batch axis, [L, ...], shared by all), received shape "
                             f"{tuple(value.shape)}")
        return tuple(value.shape[1:])
    if value.ndim != rank:
        raise ValueError(f"value must have shape [L, ...] ({rank} axes) or, for a batch, [B, L, ...], "
                         f"received shape {tuple(value.shape)}")
    return tuple(value.shape)


def _check_value_shape(bound: Bound, name: str, value: Array) -> None:
    """Refuse a value that does not broadcast to the captured ``name`` at the bound's length, before any
    program is compiled or run: the shape comes from the model's sizes (nothing traced)."""
    shape = _value_shape(bound, name, value)  # per input: a batch axis checked and set aside
    s, T = bound.spec.sizes(bound.config), bound.args["ids"].shape[-1]
    captured = (s.layers, *site_shapes(T=T, S=T, N=s.heads, K=s.kv_heads, H=s.head_dim, D=s.width)[name])
    if not _broadcasts(shape, captured):
        raise ValueError(f"value must have the shape of the captured {name}, {captured} (or 1 along an axis; "
                         f"a batched bound's may lead with B), received {tuple(value.shape)}")


def _check_value(name: str, value: Any, sites: tuple[str, ...] = HEAD_SITES) -> Array:
    if name not in sites:
        if sites == HEAD_SITES:
            raise ValueError(f"name must be a tensor with a head axis, one of {HEAD_SITES}, received {name!r}")
        raise ValueError(f"name must be a tensor with a head axis, one of {HEAD_SITES}, or a residual-stream or "
                         f"block-output site, one of {POSITION_SITES}, received {name!r}")
    dtype = getattr(value, "dtype", None) or np.asarray(value).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"value must be a float array (a captured {name}), received dtype {np.dtype(dtype).name}")
    return on_device(value)


def _every_layer(bound: Bound, name: str, value: Array) -> Array:
    """``value`` with a layer axis of 1 broadcast to the bound's ``L`` layers (the same replacement in each
    layer's patch, as ``patch=`` reads it); a concrete value on the host, so nothing is compiled."""
    shape = _value_shape(bound, name, value)
    if shape[0] != 1 or bound.n_layers == 1:
        return value
    axis = value.ndim - len(shape)  # 1 with a batch axis
    full = (*value.shape[:axis], bound.n_layers, *value.shape[axis + 1:])
    if isinstance(value, jax.core.Tracer):
        return jnp.broadcast_to(value, full)
    return on_device(np.broadcast_to(np.asarray(value), full))


def _where_shape(bound: Bound, name: str, value: Array) -> tuple[int, ...]:
    """The full per-input shape of ``name``, from the value (size-1 axes filled in from a capture's shape)."""
    shape = _value_shape(bound, name, value)
    if 1 not in shape[1:]:
        return shape
    out = jax.eval_shape(lambda a: bound.apply(a, capture=(name,)), bound.args).captured[name]
    return tuple(out.shape[1:]) if bound.batch is not None else tuple(out.shape)


def _position_pairs(L: int, T: int, positions: Any) -> tuple[np.ndarray, int]:
    """``([1 + L·P, 2] (layer, position) pairs, P)``: row 0 patches nothing, then layer-major, position-minor."""
    if positions is None:
        cols = np.arange(T)
    else:
        pos = np.asarray(positions)
        if pos.dtype != np.bool_ or pos.shape != (T,):
            raise ValueError(f"positions must be boolean [T] = ({T},), received dtype {pos.dtype.name} shape {pos.shape}")
        cols = np.flatnonzero(pos)
        if cols.size == 0:
            raise ValueError(f"positions must select at least one of the T = {T} positions, received none")
    layers, where = np.meshgrid(np.arange(L), cols, indexing="ij")  # [L, P] each
    pairs = np.concatenate([[[-1, -1]], np.stack([layers.ravel(), where.ravel()], axis=1)]).astype(np.int32)
    return pairs, int(cols.size)


def _pad_to_bucket(bound: Bound, name: str, value: Array, shape: tuple[int, ...]) -> tuple[Array, tuple[int, ...]]:
    """A patch value ``[L, ...]`` of the bound's T tokens, and its full shape, at the bucket's length
    (:func:`jaxattn._sites.pad_site`; on the host for a concrete value, nothing compiled per length). The
    value was checked at the prompt's length first (:func:`_check_value_shape`)."""
    T, B = bound.args["ids"].shape[-1], bound.bucket["ids"].shape[-1]
    axes = ["L", *CAPTURE_NAMES[name][0].split()]
    padded = pad_site(name, value, T, B) if isinstance(value, jax.core.Tracer) else \
        on_device(pad_site(name, np.asarray(value), T, B, np))
    return padded, tuple(B if a in "TS" else n for a, n in zip(axes, shape))


def _pad(a: Any, widths: Any) -> Any:
    """``a`` zero-padded: on the host when concrete (no program compiled for a new length), else traced."""
    if isinstance(a, jax.core.Tracer):
        return jnp.pad(a, widths)
    return on_device(np.pad(np.asarray(a), widths))


def patching_effects(bound: Bound, metric: Metric, value: Any, *, name: str = "z", positions: Any = None,
                     chunk: int | None = 16, resume: bool = True, mesh: Any = None,
                     data_axis: str = "data") -> Array:
    """``[L, N]``: ``metric(head (l, n)'s name replaced by value) - metric(clean)`` (activation patching);
    ``[L, T]`` by layer and position for a residual-stream or block-output site.

    Args:
      bound: the model on the input patched into (e.g. "... too big").
      metric: ``output -> scalar``.
      value: the replacement, the shape of the captured tensor ``[L, ...]`` (or ``[B, L, ...]`` for a
        batched bound): usually ``source(capture=(name,)).captured[name]`` from the same model on another
        input of the same length (e.g. "... too small"), or :func:`reference_mean` (mean-ablation; size-1
        axes broadcast). A leading B axis must equal the bound's batch (``ValueError`` naming ``value``
        otherwise).
      name: ``z`` (each head's output, default), ``attn_weights`` (its attention pattern, applied to the
        clean values), ``q``; or ``k``/``v`` (under grouped-query attention a key/value head is shared by
        N/K query heads, so patching one replaces it for all of them: the table is then ``[L, K]``). Or
        a site of :data:`POSITION_SITES`: ``resid_pre``, ``resid_mid``, ``resid_post`` (the residual
        stream entering the block, after its attention, leaving it), ``attn_out``, ``mlp_out`` (what the
        attention and the MLP add to it); entry ``[l, t]`` then patches the ``D`` features of layer
        ``l`` at position ``t`` alone, and everything after it recomputes from the patched stream.
      positions: optional boolean ``[T]``: for a head site, the query positions patched (all of them
        together, in every head's intervention); for a position site, the positions patched one at a
        time: the table is then ``[L, P]``, one column per selected position in increasing order (``P``
        is the number selected; all ``T`` when ``None``).
      chunk, resume, mesh, data_axis: as in :func:`ablation_effects` (with ``mesh``, the patches are
        split over ``data_axis``).

    Raises:
      TypeError, ValueError: naming ``bound``, ``metric``, ``value``, ``name``, ``positions``, ``chunk``,
        ``mesh`` or ``data_axis``.
    """
    _check_bound(bound), _check_metric(metric)
    if mesh is not None:
        _mesh.check(mesh, data_axis)
    value = _every_layer(bound, name, _check_value(name, value, HEAD_SITES + POSITION_SITES))
    _check_value_shape(bound, name, value)
    shape = _where_shape(bound, name, value)
    fast = resume and resumable(bound)
    padded = fast and _bucketed(bound, metric)  # a RowMetric's table runs at the bucket's length
    if name in POSITION_SITES:  # [L, T, D]: one (layer, position) pair per intervention, row 0 the clean run
        L, T = shape[0], shape[1]
        pairs, P = _position_pairs(L, T, positions)
        _check_chunk(chunk, L * P)
        if fast:
            labels = pairs[1:P + 1, 1]
            if padded:
                value, shape = _pad_to_bucket(bound, name, value, shape)
                if positions is None and mesh is None:  # every position of the bucket (a pad's effect is 0, cut)
                    table = resumed_effects(bound, metric, kind="position", G=shape[1], extra=value, chunk=chunk,
                                            name=name, shape=shape, labels=np.arange(shape[1]))
                    return _cut_columns(table, T)
            return resumed_effects(bound, metric, kind="position", G=P, extra=value, chunk=chunk, name=name,
                                   shape=shape, labels=labels, mesh=mesh, data_axis=data_axis)
        fn = _position_patch_fn(bound.apply, metric, name, L, T)
        return _run_map((bound.args, value), fn, jnp.asarray(pairs), chunk, mesh, data_axis).reshape(L, P)
    if fast:
        axes = CAPTURE_NAMES[name][0].split()
        heads = shape[1 + (axes.index("N") if "N" in axes else axes.index("K"))]
        _check_chunk(chunk, shape[0] * heads)
        pos = None if positions is None else _check_positions(positions, shape[1 + axes.index("T")])
        if padded:  # the padded rows are never patched
            T = shape[1 + axes.index("T")]
            value, shape = _pad_to_bucket(bound, name, value, shape)
            pos = _pad(np.ones((T,), bool) if pos is None else pos, (0, shape[1 + axes.index("T")] - T))
        return resumed_effects(bound, metric, kind="head", G=heads, extra=(value, pos), chunk=chunk, name=name,
                               shape=shape, mesh=mesh, data_axis=data_axis)
    where = head_where(name, shape, positions=positions)  # [L·N, L, ...]
    where = jnp.concatenate([jnp.zeros_like(where[:1]), where])  # row 0: nothing patched (the clean run)
    effects = _run_map((bound.args, value), _patch_fn(bound.apply, metric, name), where, chunk, mesh, data_axis)
    return effects.reshape(bound.n_layers, -1)


def joint_patching_effect(bound: Bound, metric: Metric, value: Any, heads: Any, *, name: str = "z",
                          mesh: Any = None) -> Array:
    """``metric(every head in heads patched with value at once) - metric(clean)``: one scalar.

    Set against the sum of the heads' single effects (:func:`patching_effects`), it says whether the
    effects add up: they do when the heads act independently on the metric.

    Args:
      bound, metric, value, name: as in :func:`patching_effects` (a tensor with a head axis).
      heads: ``(layer, head)`` pairs (key/value heads for ``k``, ``v``), or ``"all"``: every head of every
        layer.
      mesh: a ``jax.sharding.Mesh`` to run on, the model as its params are placed (``module.shard``); the
        result comes back replicated on it.

    Raises:
      TypeError, ValueError: naming ``bound``, ``metric``, ``value``, ``name`` or ``heads``.
    """
    _check_bound(bound), _check_metric(metric)
    value = _every_layer(bound, name, _check_value(name, value))
    _check_value_shape(bound, name, value)
    shape = _where_shape(bound, name, value)
    if _bucketed(bound, metric):  # a RowMetric's effect runs at the bucket's length, the value padded alike
        value, shape = _pad_to_bucket(bound, name, value, shape)
    every = head_where(name, shape)  # [L·G, L, ...], one head each
    G = every.shape[0] // shape[0]
    if isinstance(heads, str) and heads == "all":
        picked = list(range(every.shape[0]))
    else:
        pairs = np.asarray(heads)
        # NumPy makes (True, 1) an int pair: a bool anywhere is refused, as elsewhere in this module
        has_bool = pairs.dtype == np.bool_ or (isinstance(heads, (list, tuple)) and any(
            isinstance(x, (bool, np.bool_)) for pair in heads for x in np.ravel(np.asarray(pair, object))))
        if (pairs.ndim != 2 or pairs.shape[1:] != (2,) or pairs.shape[0] == 0 or not np.issubdtype(pairs.dtype, np.integer)
                or has_bool):
            raise ValueError(f"heads must be 'all' or a non-empty list of (layer, head) int pairs, received {heads!r}")
        if np.any(pairs < 0) or np.any(pairs[:, 0] >= shape[0]) or np.any(pairs[:, 1] >= G):
            raise ValueError(f"heads must be (layer, head) pairs with layer < {shape[0]} and head < {G}, received "
                             f"{pairs.tolist()}")
        picked = (pairs[:, 0] * G + pairs[:, 1]).tolist()
    where = jnp.any(every[jnp.asarray(picked)], axis=0)  # [L, ...]
    run = _program(_patch_fn(bound.apply, metric, name), None)
    effect = lambda args_value, where: run(args_value, where) - run(args_value, jnp.zeros_like(where))  # noqa: E731
    args = _table_args(bound, metric)
    if mesh is None:
        return effect((args, value), where)
    _mesh.check(mesh, None, used=False)
    return _mesh.run(effect, mesh, (args, value), where, replicate=True)


def _check_positions(positions: Any, T: int) -> Array:
    pos = np.asarray(positions)
    if pos.dtype != np.bool_ or pos.shape != (T,):
        raise ValueError(f"positions must be boolean [T] = ({T},), received dtype {pos.dtype.name} shape {pos.shape}")
    return on_device(pos)


def gate_gradients(bound: Bound, metric: Metric, *, mesh: Any = None) -> Array:
    """``[L, N]``: ``∂metric/∂head_mask`` at ``head_mask = 1`` (one backward pass).

    ``metric(ablate (l, n)) - metric(clean) ≈ -gate_gradients[l, n]`` to first order: the gradient is the
    linear estimate of every ablation at once ("attribution patching" of the gates). With ``mesh`` (a
    ``jax.sharding.Mesh``), the one backward pass runs there, the model as its params are placed
    (``module.shard``; otherwise replicated), the table replicated on the mesh: there is no interventions
    axis to split over its data axis.
    """
    _check_bound(bound), _check_metric(metric)
    ones = on_device(np.ones((bound.n_layers, bound.n_heads), _float()))  # made on the host: nothing compiled
    args = _table_args(bound, metric)
    if mesh is not None:
        _mesh.check(mesh, None, used=False)
        return _mesh.run(_gate_program(bound.apply, metric), mesh, ones, args, replicate=True)
    return _gate_program(bound.apply, metric)(ones, args)


@functools.lru_cache(maxsize=64)
def _gate_program(apply: Callable[..., Any], metric: Metric) -> Callable[[Any, Any], Array]:
    return jax.jit(jax.grad(lambda m, args: _scalar(metric, apply(args, head_mask=m), args)))


def _reduce_heads(x: Array, name: str, batched: bool) -> Array:
    """Sum ``x`` (``[(B,) L, ...]``) over every axis but layers and the head axis: ``[L, N]``."""
    axes = CAPTURE_NAMES[name][0].split()
    head = 1 + (axes.index("N") if "N" in axes else axes.index("K"))
    lead = 1 if batched else 0
    x = jnp.moveaxis(x, lead + head, lead + 1)  # [(B,) L, N, ...]
    sum_axes = tuple(range(lead + 2, x.ndim)) + ((0,) if batched else ())
    return jnp.sum(x, axis=sum_axes)


def layer_gradients(bound: Bound, metric: Metric, name: str, *, chunk: int | None = 8, mesh: Any = None,
                    data_axis: str = "data") -> tuple[Array, Array]:
    """``(x, ∂metric/∂x)`` for the captured tensor ``x = name`` of every layer, ``[(B,) L, ...]`` each.

    Each layer's gradient is the total derivative: the tensor of layer ``l`` is patched with its own value
    (``where`` true at layer ``l`` only), so every later layer recomputes from it. Patching all layers at
    once would hold the later layers' tensors fixed and drop the paths through them; instead the L
    backward passes run as one ``lax.map`` (``chunk`` at a time); with ``mesh``, the layers are split over
    its ``data_axis`` (as in :func:`ablation_effects`). A :class:`RowMetric`'s gradients are computed at the
    bucket's length (without ``mesh``) and cut to the prompt's on the host.
    """
    clean, grads, cut = _layer_gradients(bound, metric, name, chunk, mesh, data_axis)
    return cut(clean), cut(grads)


def _layer_gradients(bound: Bound, metric: Metric, name: str, chunk: int | None, mesh: Any,
                     data_axis: str) -> tuple[Array, Array, Callable[[Array], Array]]:
    """``(x, ∂metric/∂x, cut)`` of :func:`layer_gradients` at the length the table runs at (the bucket's for a
    :class:`RowMetric`), and ``cut``, which takes an array of ``x``'s shape to the bound's own length (on
    the host; the identity at the bound's own length)."""
    _check_bound(bound), _check_metric(metric)
    if name not in CAPTURE_NAMES or name == "attn_logits":
        raise ValueError(f"name must be a patchable capture name, received {name!r}")
    batched = bound.batch is not None
    L = bound.n_layers
    size = _check_chunk(chunk, L)
    if mesh is not None:
        _mesh.check(mesh, data_axis)
        clean = _mesh.run(lambda args: bound.apply(args, capture=(name,)).captured[name], mesh, bound.args)
        grads = _mesh.mesh_map(_layer_fn(bound.apply, metric, name, L, batched), (bound.args, clean),
                               jnp.arange(L), chunk, mesh, data_axis)  # [L, (B,) ...]
        grads = _mesh.run(lambda c, g: (c, jnp.moveaxis(g, 0, 1) if batched else g), mesh, clean, grads, replicate=True)
        return (*grads, lambda a: a)
    padded = _bucketed(bound, metric)
    args = _table_args(bound, metric)
    clean = bound.apply(args, capture=(name,)).captured[name]  # [(B,) L, ...]
    layers = np.minimum(np.arange(L + (-L % size), dtype=np.int32), L - 1)  # whole chunks; extras repeat the last
    grads = _layer_program(bound.apply, metric, name, L, batched, size)(args, clean, on_device(layers))
    grads = grads[:L]  # [L, (B,) ...]
    return clean, (jnp.moveaxis(grads, 0, 1) if batched else grads), _cut_to_bound(bound, name) if padded else (lambda a: a)


def _cut_to_bound(bound: Bound, name: str) -> Callable[[Array], Array]:
    """An array ``[L, ...]`` of ``name`` at the bucket's length cut to the bound's T (:func:`_cut`)."""
    T = bound.args["ids"].shape[-1]
    index = tuple(slice(0, T) if a in "TS" else slice(None) for a in ["L", *CAPTURE_NAMES[name][0].split()])
    return lambda a: _cut(a, index)


def _cut_columns(table: Array, T: int) -> Array:
    """A table ``[L, B]`` by layer and position at the bucket's length cut to ``[L, T]`` (:func:`_cut`)."""
    return _cut(table, (slice(None), slice(0, T)))


def _cut(a: Array, index: tuple) -> Array:
    """``a[index]``: on the host for a concrete array (no program compiled per length; put back where ``a`` was
    when it was placed on one device), traced otherwise (part of the caller's program)."""
    if isinstance(a, jax.core.Tracer):
        return a[index]
    cut = np.asarray(a)[index]
    return jax.device_put(cut, a.sharding) if a.committed and len(a.sharding.device_set) == 1 else on_device(cut)


def _layer_grad(apply: Callable[..., Any], metric: Metric, name: str, L: int, batched: bool, args: Any, x: Array,
                layer: Array) -> Array:
    """``∂metric/∂x[layer]`` with layer ``layer``'s tensor patched with its own value ``x``: ``[(B,) ...]``."""
    rank = 1 + len(CAPTURE_NAMES[name][0].split())
    where = (jnp.arange(L) == layer).reshape((L,) + (1,) * (rank - 1))
    g = jax.grad(lambda v: _scalar(metric, apply(args, patch={name: (v, where)}), args))(x)
    return g[:, layer] if batched else g[layer]  # [(B,) ...]


@functools.lru_cache(maxsize=64)
def _layer_fn(apply: Callable[..., Any], metric: Metric, name: str, L: int, batched: bool) -> Callable[..., Array]:
    return lambda args_x, layer: _layer_grad(apply, metric, name, L, batched, args_x[0], args_x[1], layer)


@functools.lru_cache(maxsize=64)
def _layer_program(apply: Callable[..., Any], metric: Metric, name: str, L: int, batched: bool,
                   size: int) -> Callable[..., Array]:
    one = functools.partial(_layer_grad, apply, metric, name, L, batched)
    return jax.jit(lambda args, x, layers: jax.lax.map(lambda l: one(args, x, l), layers, batch_size=size))


def attribution_patching(bound: Bound, metric: Metric, value: Any, *, name: str = "z",
                         chunk: int | None = 8, mesh: Any = None, data_axis: str = "data") -> Array:
    """``[L, N]``: ``Σ (value - clean) · ∂metric/∂name`` over each head's entries (L backward passes).

    The first-order estimate of :func:`patching_effects` with the same ``value`` (Nanda's "attribution
    patching"), with the total derivative of :func:`layer_gradients`: exact where the metric is linear in
    the patched tensor. ``mesh``, ``data_axis``: as in :func:`layer_gradients`.
    """
    _check_bound(bound)
    value = _check_value(name, value)
    _check_value_shape(bound, name, value)
    clean, grad, cut = _layer_gradients(bound, metric, name, chunk, mesh, data_axis)
    if mesh is None and _bucketed(bound, metric):  # at the bucket's length: the value padded alike
        T = bound.args["ids"].shape[-1]
        shape = tuple(T if a in "TS" else n for a, n in zip(["L", *CAPTURE_NAMES[name][0].split()], clean.shape))
        value, _ = _pad_to_bucket(bound, name, value, shape)
    if not _broadcasts(value.shape, clean.shape):
        raise ValueError(f"value must have the shape of the captured {name}, {tuple(clean.shape)} (or 1 along an "
                         f"axis), received {tuple(value.shape)}")

    table = functools.partial(_attribution_table, name=name, batched=bound.batch is not None)
    return table(value, clean, grad) if mesh is None else _mesh.run(table, mesh, value, clean, grad, replicate=True)


@functools.partial(jax.jit, static_argnames=("name", "batched"))
def _attribution_table(value: Array, clean: Array, grad: Array, *, name: str, batched: bool) -> Array:
    """``Σ (value - clean) · grad`` per (layer, head): one small program."""
    return _reduce_heads((jnp.broadcast_to(value, clean.shape) - clean) * grad, name, batched)


def attention_gradient(bound: Bound, metric: Metric, *, chunk: int | None = 8, mesh: Any = None,
                       data_axis: str = "data") -> Array:
    """``A ⊙ ∂metric/∂A`` for every attention weight: ``[L, N, T, S]`` (``[B, L, N, T, S]`` for a batch).

    ``∂metric/∂A`` is the total derivative (:func:`layer_gradients`): the gradient flows from the weights
    into each head's output ``z = A v`` and on through every later layer. Summed over a query row ``t`` it
    is the attention × gradient attribution of that row; summed over every row and key it equals
    :func:`gate_gradients` (``z`` is linear in ``A``, so scaling a head's weights scales its output like
    its gate does). ``mesh``, ``data_axis``: as in :func:`layer_gradients`.
    """
    weights, grad, cut = _layer_gradients(bound, metric, "attn_weights", chunk, mesh, data_axis)
    return cut(weights * grad) if mesh is None else _mesh.run(jnp.multiply, mesh, weights, grad, replicate=True)


def reference_mean(bounds: Sequence[Bound], name: str = "z") -> Array:
    """``[L, 1, ...]``: ``name`` averaged over the real tokens of each input, then over the inputs.

    The value of mean-ablation (``patching_effects(bound, metric, reference_mean(refs))``): each head's
    output replaced by its average over a reference set, at every position. Inputs may differ in length.

    Args:
      bounds: unbatched :class:`Bound` s of one model on the reference inputs.
      name: a tensor whose per-layer shape starts with T: ``z``, ``q``, ``k``, ``v``, ``resid_pre``, ...
    """
    if isinstance(bounds, Bound) or not bounds:
        raise TypeError("bounds must be a non-empty sequence of Bound (one per reference input)")
    axes = CAPTURE_NAMES.get(name, ("",))[0].split()
    if not axes or axes[0] != "T":
        names = [n for n, (a, _) in CAPTURE_NAMES.items() if a.startswith("T")]
        raise ValueError(f"name must be a tensor with a token axis first, one of {names}, received {name!r}")
    means = []
    for b in _check_all(bounds):
        x = b(capture=(name,)).captured[name]  # [L, T, ...]
        m = b.args["mask"].astype(x.dtype).reshape((1, -1) + (1,) * (x.ndim - 2))  # [1, T, 1...]
        means.append(jnp.sum(x * m, axis=1) / jnp.sum(m))  # [L, ...]
    return jnp.mean(jnp.stack(means), axis=0)[:, None]  # [L, 1, ...]


def _check_all(bounds: Sequence[Any]) -> list[Bound]:
    out = []
    for b in bounds:
        _check_bound(b)
        if b.batch is not None:
            raise ValueError("reference_mean takes unbatched bounds (one input each), received a batched one")
        out.append(b)
    return out
