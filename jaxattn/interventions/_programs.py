"""How the effect tables run: resumed from each intervention's layer, or as whole forwards.

An intervention at layer ``l`` (a head's gate, a patch of a head's tensor or of the stream at one
position) leaves layers ``0..l-1`` as they are in the clean run. So each table runs the clean forward
once, keeping the stream entering every layer (``resid_pre``) and the maps, and resumes every
intervention at its own layer through the model protocol's ``resume`` (:class:`Bound.resume`): the
interventions are grouped by layer, each group with the clean run resumed beside it (the value it is
measured from, from the same batch of the same program), and ``jax.vmap`` runs a group, ``chunk`` at a
time, in one ``lax.scan`` over the groups: one compiled program per table, whose layer is a traced
scalar. A module without ``resume`` (an encoder), or ``resume=False``, runs each intervention as a whole
forward (``lax.map`` over them).

A metric may declare which rows of a causal model's logits it reads, as a :class:`LogitMetric` (a
sorted tuple of positions, the same for every sequence of a batch; :func:`choice_metric` makes one): the
resumed runs then unembed those rows only (the unembedding of every position can cost a fifth of a
forward) and hand the metric logits that are NaN elsewhere. The clean run checks once that
the metric gives the same value with those rows alone (``ValueError`` otherwise).

Axis alphabet: B inputs of a batch, L layers, N heads, T tokens, D width, V vocabulary, G the
interventions of one layer, C the interventions run at once (a chunk, the clean run included).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._sites import CAPTURE_NAMES
from jaxattn.interventions import _mesh
from jaxattn.interventions._metrics import LogitMetric, RowMetric
from jaxattn.interventions._model import Bound, on_device
from jaxattn.interventions._packing import (
    Packing,
    pack_maps,
    pack_stream,
    pack_value,
    pack_where,
    plan,
    unpack,
    value_packs,
)

Array = jax.Array
Metric = Callable[[Any], Array]


def scalar(metric: Metric, out: Any, args: Any = None, unembed: Any = None, config: Any = None) -> Array:
    """``metric(out)`` as a float scalar; a result that is not one real number (int or float) is refused.

    A :class:`RowMetric` gets its rows of ``out`` (:func:`row_logits`, from ``args``' ids and mask; unembedded
    from ``last_hidden_state`` by ``unembed`` when given, else read off ``out.logits``). The checks read only
    the result's type, dtype and shape, which are static under ``jax.jit``.
    """
    value = metric(*row_logits(metric, out, args, unembed, config)) if isinstance(metric, RowMetric) else metric(out)
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        dtype = value.dtype
    elif isinstance(value, (int, float, complex)):  # bool is an int: refused below by its dtype
        dtype = np.asarray(value).dtype
    else:
        raise TypeError(f"metric must return a real scalar (an int or float, or a 0-d array of one), received "
                        f"{type(value).__name__}")
    if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"metric must return a real scalar (an int or float, or a 0-d array of one), received "
                        f"dtype {np.dtype(dtype).name}")
    if jnp.shape(value) != ():
        raise ValueError(f"metric must return a scalar, received shape {tuple(jnp.shape(value))}")
    value = jnp.asarray(value)
    return value.astype(jnp.promote_types(value.dtype, jnp.float32))


def real_rows(rows: tuple[int, ...], ids: Array, mask: Array) -> tuple[Array, Array, Array]:
    """``(at [R], ok [R], next_ids [R])`` of one sequence (``ids, mask [T]``): the position of each real-token
    index of ``rows`` (negative: from the last real token), whether the sequence has it, and the id of the
    real token after it (-1 when none). Traced arrays of the real-token count, not of the length."""
    keep = mask.astype(bool)  # [T]
    n = jnp.sum(keep)
    k = jnp.asarray(rows, jnp.int32)  # [R]
    k = jnp.where(k < 0, n + k, k)  # [R]
    count = jnp.cumsum(keep)  # [T]: real tokens up to and at each position
    first = lambda c: jnp.argmax(keep[None, :] & (count[None, :] == c[:, None]), axis=1)  # noqa: E731  [R]
    at, after = first(k + 1), first(k + 2)  # the k-th real token's position, the next one's
    ok = (k >= 0) & (k < n)  # [R]
    return at, ok, jnp.where(ok & (k + 1 < n), ids[after], -1)


def row_logits(metric: RowMetric, out: Any, args: Any, unembed: Any, config: Any) -> tuple[Array, Array]:
    """``(logits [(B,) R, V], next_ids [(B,) R])`` of a :class:`RowMetric`'s rows, NaN for a row a sequence
    does not have: ``unembed(last_hidden_state at the rows)`` when ``unembed`` is given, else ``out.logits``
    at the rows."""
    if unembed is None and getattr(out, "logits", None) is None:
        raise ValueError("metric is a RowMetric, which reads a causal language model's logits, but the bound's "
                         "model gives none (an encoder): use a plain metric of its output")
    src = out.last_hidden_state if unembed is not None else out.logits  # [(B,) T, D or V]

    def one(ids, mask, x):
        at, ok, nxt = real_rows(metric.rows, ids, mask)
        return jnp.take(x, at, axis=0), ok, nxt  # [R, D or V], [R], [R]

    ids, mask = args["ids"], args["mask"]
    x, ok, nxt = (jax.vmap(one) if ids.ndim == 2 else one)(ids, mask, src)
    logits = unembed(args["params"], config, x) if unembed is not None else x  # [(B,) R, V]
    return jnp.where(ok[..., None], logits, jnp.nan), nxt


def default_float() -> Any:
    """The default float dtype: float32, or float64 under ``jax.enable_x64`` (finite differences need it)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def check_chunk(chunk: Any, total: int) -> int:
    if chunk is None:
        return total
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (interventions run at once) or None (all), received {chunk!r}")
    return min(int(chunk), total)


# ----------------------------------------------------------------------------------------------------
# Whole forwards: a lax.map over the interventions
# ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def program(fn: Callable[[Any, Any], Array], size: int | None) -> Callable[[Any, Any], Array]:
    """``jit(lax.map(fn, xs, batch_size=size))`` (:func:`._mesh.map_program`), or ``jit(fn)`` for one item
    (``size=None``); kept per ``(fn, size)`` so a second table of the same shapes compiles nothing."""
    if size is None:
        return jax.jit(fn)
    return _mesh.map_program(fn, size)


def run_map(args: Any, fn: Callable[[Any, Any], Array], xs: Any, chunk: int | None,
            mesh: Any = None, data_axis: str = "data") -> Array:
    """``[fn(args, x) for x in xs]``: one ``jit(lax.map(..., batch_size=chunk))``, or with ``mesh`` the items
    split over its ``data_axis`` (:mod:`._mesh`). ``xs[0]`` is the clean intervention (no change); the result
    is ``fn(xs[1:]) - fn(xs[0])``, both from the same compiled program."""
    total = jax.tree.leaves(xs)[0].shape[0]
    if mesh is not None:
        values = _mesh.mesh_map(fn, args, xs, chunk, mesh, data_axis)
        return _mesh.run(lambda v: v[1:] - v[0], mesh, values, replicate=True)
    size = check_chunk(chunk, total)
    pad = -total % size  # whole chunks only (one compiled body): repeat the clean row
    padded = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, axis=0)]), xs)
    values = program(fn, size)(args, padded)[:total]
    return values[1:] - values[0]


# ----------------------------------------------------------------------------------------------------
# The logits rows a metric reads
# ----------------------------------------------------------------------------------------------------


def logit_rows(metric: Metric, T: int) -> tuple[int, ...] | None:
    """A :class:`LogitMetric`'s rows checked: sorted distinct positions in ``[0, T)``; ``None`` (all rows) for
    any other metric."""
    rows = metric.rows if isinstance(metric, LogitMetric) else None
    if rows is None:
        return None
    try:
        out = tuple(int(r) for r in rows)
        ok = all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in rows)
    except TypeError:
        out, ok = (), False
    if not ok or not out or list(out) != sorted(set(out)) or out[0] < 0 or out[-1] >= T:
        raise ValueError(f"metric.rows must be a non-empty sorted tuple of distinct positions in [0, T) = "
                         f"[0, {T}) (the logits rows the metric reads), received {rows!r}")
    return out


def _runs(rows: tuple[int, ...]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` runs of sorted rows."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [(a, b) for a, b in runs]


def readout(unembed: Any, config: Any, rows: tuple[int, ...] | None, params: Any, out: Any) -> Any:
    """``out`` with its logits made from ``last_hidden_state`` at ``rows`` only (NaN elsewhere) by the
    protocol's ``unembed``; ``rows=None`` leaves ``out`` as it is."""
    if rows is None:
        return out
    h = out.last_hidden_state  # [(B,) T, D]
    T = h.shape[-2]
    parts, at = [], 0
    for a, b in _runs(rows):
        lg = unembed(params, config, h[..., a:b, :])  # [(B,) b - a, V]
        if a > at:
            parts.append(jnp.full(lg.shape[:-2] + (a - at, lg.shape[-1]), jnp.nan, lg.dtype))
        parts.append(lg)
        at = b
    if at < T:
        parts.append(jnp.full(parts[-1].shape[:-2] + (T - at, parts[-1].shape[-1]), jnp.nan, parts[-1].dtype))
    return out._replace(logits=jnp.concatenate(parts, axis=-2))  # [(B,) T, V]


# ----------------------------------------------------------------------------------------------------
# Resumed runs, grouped by layer
# ----------------------------------------------------------------------------------------------------


def bucketed(bound: Bound, metric: Metric) -> bool:
    """Whether a table of ``metric`` runs on the bound's inputs padded to their bucket (:attr:`Bound.bucket`):
    for a :class:`RowMetric`, whose value does not depend on the length, so every prompt length of a bucket
    shares the table's program."""
    return isinstance(metric, RowMetric) and bound.bucket is not None


def table_args(bound: Bound, metric: Metric) -> Any:
    """The arrays a table of ``metric`` runs on: :attr:`Bound.bucket` when :func:`bucketed`, else ``args``."""
    return bound.bucket if bucketed(bound, metric) else bound.args


def resumable(bound: Bound) -> bool:
    """Whether the tables can resume this bound's interventions (its module has the protocol's ``resume``)."""
    return bound.resume is not None and bound.module is not None


@functools.lru_cache(maxsize=64)
def _prefix_program(apply: Callable[..., Any], unembed: Any, config: Any, metric: Metric,
                    rows: Any) -> Callable[..., Any]:
    """The clean run once: ``(resid_pre [(B,) L, T, D], maps [(B,) L, N, T, T], metric, metric on rows)``."""

    def run(args):
        out = apply(args, capture=("resid_pre",))
        clean = scalar(metric, out, args, unembed, config)
        alone = scalar(metric, readout(unembed, config, rows, args["params"], out)) if rows is not None else clean
        return out.captured["resid_pre"], out.attentions, clean, alone

    return jax.jit(run)


def _packing(bound: Bound, kind: str, name: str | None, extra: Any) -> Packing | None:
    """The packing of a batched bound whose sequences share a prefix (a causal model whose ``resume`` packs,
    and a patch value that agrees over the prefix), else ``None``."""
    if bound.batch is None or bound.resume is None or not bound.spec.causal:
        return None
    if any(isinstance(a, jax.core.Tracer) for a in (bound.args["ids"], bound.args["mask"])):
        return None  # traced by a caller's jit or vmap: the plan reads the values; the batch runs unpacked
    pk = plan(bound.args["ids"], bound.args["mask"])
    if pk is None or kind == "gate":
        return pk
    value = extra[0] if kind == "head" else extra
    rank = 1 + len(CAPTURE_NAMES[name][0].split())
    return pk if value_packs(name, value, value.ndim == rank + 1, int(pk.shared)) else None


def _unembed(bound: Bound, rows: Any, metric: Metric) -> Any:
    """The protocol's ``unembed`` when a metric reads some logits rows only (else ``None``: not needed; a
    :class:`RowMetric` of a model without one reads ``out.logits``, or is refused when there are none)."""
    if isinstance(metric, RowMetric):
        return bound.spec.unembed
    if rows is None:
        return None
    unembed = bound.spec.unembed
    if unembed is None:
        raise ValueError("metric.rows asks for logits rows, but the bound's model has no unembed (the model "
                         "protocol's language-model head): use a plain metric, or bind a causal language model")
    return unembed


def _intervention(kind: str, name: str | None, shape: tuple[int, ...], layer: Array, i: Array,
                  extra: Any) -> tuple[Any, Any]:
    """``(head_mask, patch)`` of intervention ``i`` of ``layer`` (``i = -1``: none, the clean run).

    ``gate``: head ``i``'s gate set to ``extra``; ``head``: head ``i``'s ``name`` patched with ``extra =
    (value, positions)``; ``position``: ``name`` at position ``i`` patched with ``extra``.
    """
    L = shape[0]
    at = jnp.arange(L) == layer  # [L]
    if kind == "gate":
        N = shape[1]
        hit = at[:, None] & (jnp.arange(N) == i)[None, :]  # [L, N]
        return jnp.where(hit, extra.astype(default_float()), jnp.ones((), default_float())), None
    axes = CAPTURE_NAMES[name][0].split()
    lead = [L] + [1] * len(axes)
    if kind == "position":
        T = shape[1]
        where = at.reshape(L, 1, 1) & (jnp.arange(T) == i).reshape(1, T, 1)  # [L, T, 1]
        return None, {name: (extra, where)}
    value, positions = extra
    h_axis = 1 + (axes.index("N") if "N" in axes else axes.index("K"))
    heads = [1] * len(lead)
    heads[h_axis] = shape[h_axis]
    where = at.reshape(lead) & (jnp.arange(shape[h_axis]) == i).reshape(heads)
    if positions is not None:
        t_axis = 1 + axes.index("T")
        pos = [1] * len(lead)
        pos[t_axis] = shape[t_axis]
        where = where & positions.reshape(pos)
    return None, {name: (value, where)}


@functools.lru_cache(maxsize=64)
def _resumed_program(resume: Callable[..., Any], unembed: Any, config: Any, batched: bool, metric: Metric, rows: Any,
                     kind: str, name: str | None, shape: tuple[int, ...], packed: bool) -> Callable[..., Array]:
    """``run(args, extra, resid_pre, maps, pk, layers [n], items [n, C]) -> [n, C]`` metric values: a
    ``lax.scan`` over batches of interventions, each batch one layer's (a traced scalar, unbatched),
    ``jax.vmap`` over its C interventions resumed at that layer; ``packed``: the batch runs as one packed
    sequence (``pk``, a :class:`Packing`; ``resid_pre``, ``maps`` and a patch value packed already).
    Kept per model, config and table kind: every bound of one model and shape shares it."""

    def run(args, extra, resid_pre, maps, pk, layers, items):
        def batch(carry, step):
            layer, idx = step
            axis = 1 if batched and not packed else 0
            stream = jax.lax.dynamic_index_in_dim(resid_pre, layer, axis=axis, keepdims=False)

            def one(i):
                head_mask, patch = _intervention(kind, name, shape, layer, i, extra)
                if not packed:
                    out = resume(args, layer, stream, maps, head_mask=head_mask, patch=patch)
                else:
                    patch = patch and {n: (v, pack_where(n, w, pk)) for n, (v, w) in patch.items()}
                    out = unpack(resume(args, layer, stream, maps, head_mask=head_mask, patch=patch,
                                        packed=(pk.keep, pk.positions)), pk)
                return scalar(metric, readout(unembed, config, rows, args["params"], out), args, unembed, config)

            return carry, jax.vmap(one)(idx)  # [C]

        return jax.lax.scan(batch, None, (layers, items))[1]  # [n, C]

    return jax.jit(run)


def _layout(L: int, G: int, chunk: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """``(layers [n], items [n, C], per)``: each layer's G interventions in ``per`` batches of C, slot 0 of
    every batch the clean run (-1), unused slots -1 too; C <= max(chunk, 2)."""
    room = G if chunk is None else max(int(chunk) - 1, 1)  # interventions per batch beside the clean run
    per = -(-G // room)
    size = 1 + -(-G // per)  # as even as the batches can be
    layers = np.repeat(np.arange(L, dtype=np.int32), per)  # [n]
    items = np.full((L * per, size), -1, np.int32)
    for b in range(per):
        picked = np.arange(b, G, per, dtype=np.int32)  # interleaved: batch b takes every per-th intervention
        items[b::per, 1:1 + picked.size] = picked
    return layers, items, per


def resumed_effects(bound: Bound, metric: Metric, *, kind: str, G: int, extra: Any, chunk: int | None,
                    name: str | None = None, shape: tuple[int, ...] = (), labels: np.ndarray | None = None,
                    mesh: Any = None, data_axis: str = "data") -> Array:
    """``[L, G]``: ``metric(intervention g of layer l) - metric(clean)``, every intervention resumed at its
    layer. ``labels [G]`` are the indices the interventions take (heads ``0..G-1`` when ``None``, or the
    selected positions); ``shape`` is the intervened tensor's ``[L, ...]`` (``(L, N)`` for gates). With
    ``mesh``, the batches of interventions are split over its ``data_axis`` (:func:`._mesh.split`)."""
    L = bound.n_layers
    T = int(bound.args["ids"].shape[-1])
    rows = logit_rows(metric, T)
    args = table_args(bound, metric)  # bucketed: a patch value and its shape come padded to the bucket
    prefix = _prefix_program(bound.apply, _unembed(bound, rows, metric), bound.config, metric, rows)
    resid_pre, maps, clean, alone = prefix(args) if mesh is None else _mesh.run(prefix, mesh, args)
    # checked on concrete runs; under a caller's vmap or jit over prompts there is no value to check
    if rows is not None and not isinstance(clean, jax.core.Tracer) \
            and not bool(jnp.abs(clean - alone) <= 1e-5 * jnp.maximum(1.0, jnp.abs(clean))):
        raise ValueError(f"metric.rows = {rows} leaves out logits rows the metric reads: on the clean run "
                         f"it gives {float(clean)!r} from every row and {float(alone)!r} from those rows alone")
    layers, slots, per = _layout(L, G, chunk)
    labels = np.arange(G, dtype=np.int32) if labels is None else np.asarray(labels, np.int32)
    items = np.where(slots >= 0, labels[np.maximum(slots, 0)], -1).astype(np.int32)
    pk = _packing(bound, kind, name, extra)
    if pk is not None:  # the batch's shared prefix once
        resid_pre, maps = pack_stream(resid_pre, pk), pack_maps(maps, pk)
        if kind != "gate":
            value = extra[0] if kind == "head" else extra
            value = pack_value(name, value, value.ndim == len(shape) + 1, pk)
            extra = (value, extra[1]) if kind == "head" else value
    program = _resumed_program(bound.resume, _unembed(bound, rows, metric), bound.config, bound.batch is not None, metric,
                               rows, kind, name, tuple(shape), pk is not None)
    fixed, xs = (args, extra, resid_pre, maps, pk), (on_device(layers), on_device(items))  # nothing compiled
    values = program(*fixed, *xs) if mesh is None else _mesh.split(program, fixed, xs, mesh, data_axis)  # [n, C]
    assemble = functools.partial(_assemble, L=L, G=G, per=per)
    return assemble(values) if mesh is None else _mesh.run(assemble, mesh, values, replicate=True)


@functools.partial(jax.jit, static_argnames=("L", "G", "per"))
def _assemble(values: Array, *, L: int, G: int, per: int) -> Array:
    """The ``[L, G]`` table from the batches' metric values ``[n, C]`` (column 0 each batch's clean run): one
    small program (written eagerly, its dozen operations were a program each)."""
    effects = values[:, 1:] - values[:, :1]  # [n, C - 1], each batch against its own clean run
    table = jnp.zeros((L, G), effects.dtype)
    for b in range(per):  # slot j of batch b holds intervention b + j·per
        picked = np.arange(b, G, per)
        table = table.at[:, picked].set(effects[b::per, :picked.size])
    return table
