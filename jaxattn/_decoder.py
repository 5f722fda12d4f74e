"""One causal decoder for every bundled family: the forward, the key/value-cache generation, span scores.

A family (GPT-2, the Llama family) supplies a :class:`Family`: its sizes, embedding, the block's q/k/v
(its pre-norm and RoPE included), output projection and MLP (its pre-norm included), the final norm and
the unembedding. Everything else, the residual stream, the named sites (capture, patch), the head mask,
causal attention through :func:`jaxattn.multi_head_attention`, padding, the cache and sampling, is
written here once.

The forward, :func:`resume` and generation run the blocks as ONE compiled block in a ``lax.fori_loop``
over the layers: the block's params reach the family as a pytree whose matrices are :class:`LayerWeight`
(a product with one is a ``lax.switch`` over the layers' own matrices, so no weight is copied or
stacked) and whose vectors are stacked ``[L, ...]``. The forward's derivatives run the blocks written
out (:func:`_all_blocks`).

Axis alphabet: T tokens (queries; keys are the same tokens, S = T), N query heads, K key/value heads, H
head dim, D width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxattn import _sharding
from jaxattn._attention import attention_logits, multi_head_attention
from jaxattn._checks import check_int, check_scale
from jaxattn._nn import attention_mask as attention_mask_
from jaxattn._nn import causal_layer, check_span, maps_buffer, positions, sampling, span_log_prob, token_ids
from jaxattn._nn import head_mask as head_mask_
from jaxattn._sites import Sites, check_capture, check_patch, site_shapes, sugar_names, with_sugar
from jaxattn._typing import ArrayLike, Bool, Float, Int, Real
from jaxattn.checkpoint import check_shapes, flatten
from jaxattn.models import ModelOutput, Sizes

Array = jax.Array


class Family(NamedTuple):
    """What a decoder family supplies (module-level functions: the tuple is hashable, a static argument).

    Attributes:
      name: the family's module, for messages (``"jaxattn.llama"``).
      config_type: its config class.
      sizes: ``config -> Sizes``.
      check_params: ``(params, config) -> None``, raising ``ValueError`` naming the key at fault.
      layer: ``(params, i) -> p``, block ``i``'s params (every block's pytree has one structure).
      embed: ``(params, config, ids [T], pos [T]) -> [T, D]``, NaN rows for ids outside ``[0, V)``.
      rotation: ``(config, pos [T], size) -> rot`` handed to ``qkv`` (``None`` without RoPE).
      qkv: ``(p, config, x [T, D], rot) -> (q [T, N, H], k [T, K, H], v [T, K, H])``.
      attn_out: ``(p, config, z [T, N, H]) -> [T, D]``, the output projection.
      mlp: ``(p, config, x [T, D]) -> [T, D]``, the MLP sublayer's contribution (its norm included).
        These three get a block's params ``p``; inside the loop over the layers each matrix of ``p`` is a
        :class:`LayerWeight`, which takes ``x @ w`` and ``w.T`` (all a family does with a matrix).
      final_norm, unembed: ``(params, config, x [..., D])``.
      max_name: the config field of the longest input, for messages.
    """

    name: str
    config_type: type
    sizes: Callable[[Any], Sizes]
    check_params: Callable[[Any, Any], None]
    layer: Callable[[Any, int], Any]
    embed: Callable[..., Array]
    rotation: Callable[..., Any]
    qkv: Callable[..., tuple[Array, Array, Array]]
    attn_out: Callable[..., Array]
    mlp: Callable[..., Array]
    final_norm: Callable[..., Array]
    unembed: Callable[..., Array]
    max_name: str


def check_tree(params: Any, shapes: dict[str, tuple[int, ...]], *, root: str, layout: str, kernel_layout: str) -> None:
    """``params`` a dict with a ``root`` entry whose flattened leaves have exactly ``shapes`` (``ValueError``
    naming the key otherwise); reads shapes and dtypes only, so traced params pass through."""
    if not isinstance(params, dict) or root not in params:
        raise ValueError(f"params must be a dict with a '{root}' entry ({layout})")
    check_shapes(flatten(params), shapes, "params", kernel_layout=kernel_layout)


def check_config(family: Family, config: Any) -> Sizes:
    if not isinstance(config, family.config_type):
        raise TypeError(f"config must be a {family.config_type.__name__}, received {type(config).__name__}")
    return family.sizes(config)


def _ids(family: Family, config: Any, x: Any, name: str = "input_ids") -> Array:
    s = family.sizes(config)
    return token_ids(x, name, low=0, high=s.vocab, max_length=s.max_length, max_name=family.max_name)


def _keep(mask: Any, T: int, *, name: str = "attention_mask") -> Array:
    """The keep-mask ``[T]``; a concrete mask must mark at least one real token."""
    keep = attention_mask_(mask, T)
    if mask is not None and not isinstance(keep, jax.core.Tracer) and not bool(jnp.any(keep)):
        raise ValueError(f"{name} marks no real token (all {T} entries are 0): there is nothing to run the model on")
    return keep


def _key_mask(keep: Array, pos: Array, window: int | None) -> Array:
    """The keep-mask ``[S]`` (padded keys out) or, under a sliding window, ``[T, S]``; a ``[T, S]`` ``keep``
    (each query's keys, :func:`resume`'s packed sequences) stays ``[T, S]``, the window applied to it.

    The window counts positions (real tokens only), so a padded sequence sees the window of the
    sequence alone; causality itself comes from ``is_causal`` (slot order, which padding keeps).
    """
    if window is None:
        return keep  # [S] (or [T, S])
    return (keep if keep.ndim == 2 else keep[None, :]) & (pos[:, None] - pos[None, :] < window)  # [T, S]


# ----------------------------------------------------------------------------------------------------
# The pieces whose sharding a mesh with Explicit axes cannot type by itself (a lookup by token ids split
# over the data axis, a sum over heads or hidden units split over the model axis, the attention's
# bookkeeping): run through _sharding.auto, which is the plain call without such a mesh.
# ----------------------------------------------------------------------------------------------------


def _embed(family: Family, config: Any, params: Any, ids: Array, pos: Array) -> Array:
    return _sharding.auto(lambda params, ids, pos: family.embed(params, config, ids, pos))(params, ids, pos)


def _rotation(family: Family, config: Any, pos: Array, size: int) -> Any:
    return _sharding.auto(lambda pos: family.rotation(config, pos, size))(pos)


def _attn_out(family: Family, config: Any, p: Any, z: Array) -> Array:
    return _sharding.auto(lambda p, z: family.attn_out(p, config, z))(p, z)


def _mlp(family: Family, config: Any, p: Any, x: Array) -> Array:
    return _sharding.auto(lambda p, x: family.mlp(p, config, x))(p, x)


def _attn_logits(q: Array, k: Array, scale: Array, group: int) -> Array:
    """``[N, T, S]``: each query head's logits against its key head (``group = N / K`` query heads each)."""

    def logits(q, k, scale):
        k_rep = jnp.repeat(k, group, axis=1)  # [T, N, H]
        return jax.vmap(lambda qn, kn: attention_logits(qn, kn, scale=scale), in_axes=1)(q, k_rep)

    return _sharding.auto(logits, _sharding.head_specs(q)[1])(q, k, scale)


def _attend(q: Array, k: Array, v: Array, mask: Array, scale: Array, offset: int) -> Array:
    """``z [R, N, H]`` of :func:`jaxattn.multi_head_attention` of ``R`` queries that continue ``offset`` earlier
    keys (causal with ``causal_offset=offset``; ``mask`` says which keys are real)."""
    def attend(q, k, v, mask, scale):
        return multi_head_attention(q, k, v, mask=mask, scale=scale, is_causal=True, causal_offset=offset)

    return _sharding.auto(attend, _sharding.head_specs(q))(q, k, v, mask, scale)[0]


def _unembed(family: Family, config: Any, params: Any, h: Array) -> Array:
    return _sharding.auto(lambda params, h: family.unembed(params, config, h))(params, h)


# ----------------------------------------------------------------------------------------------------
# The forward: one compiled block, run by a loop over the layers
# ----------------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class LayerWeight:
    """Block ``i``'s weight matrix inside the loop over the layers: every layer's matrix (as they lie in the
    params, never stacked) and the loop's traced index ``i``.

    It supports what a family's block functions do with a matrix, ``x @ w`` and ``w.T``: the product is a
    ``lax.switch`` over the layers whose branch ``j`` multiplies by layer ``j``'s matrix, so every weight
    is read where it lies. Picking layer ``i``'s matrix first (a switch that returns it, or a slice of a
    stacked copy) would copy all the weights on every call.

    A one-row ``x [1, D]`` (a generated token) is multiplied as two rows, itself and a row of zeros: XLA
    compiles a matrix-vector product to machine code of its own, one per product (a switch over 30
    layers would compile 30 of each), and hands products of two or more rows to its matrix library,
    which compiles nothing and reads the matrix once either way.
    """

    def __init__(self, layers: tuple[Array, ...], i: Array, transposed: bool = False):
        self.layers, self.i, self.transposed = layers, i, transposed

    def tree_flatten(self):
        return (self.layers, self.i), self.transposed

    @classmethod
    def tree_unflatten(cls, transposed, children):
        return cls(*children, transposed)

    @property
    def T(self) -> "LayerWeight":
        return LayerWeight(self.layers, self.i, not self.transposed)

    def __rmatmul__(self, x: Array) -> Array:
        dims = (((x.ndim - 1,), (1 if self.transposed else 0,)), ((), ()))  # x's last axis against w's rows (or columns)
        dtype = jnp.result_type(x, self.layers[0])

        def product(w, x):
            return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), dims)

        one_row = x.ndim == 2 and x.shape[0] == 1
        if one_row:
            x = jnp.concatenate([x, jnp.zeros_like(x)])  # [2, D]
        y = jax.lax.switch(self.i, [functools.partial(product, w) for w in self.layers], x)
        return y[:1] if one_row else y


def _layers(family: Family, config: Any, params: Any) -> Any:
    """Every block's params as the loop over the layers reads them (:func:`_layer_at`): a pytree shaped like
    one block's, each matrix (two or more axes) a tuple of the layers' own arrays, each vector (a norm's
    scale, a bias) stacked ``[L, ...]`` (a copy of a few numbers per layer)."""
    blocks = [family.layer(params, j) for j in range(family.sizes(config).layers)]
    return jax.tree.map(lambda *a: tuple(a) if a[0].ndim >= 2 else jnp.stack(a), *blocks)


def _layer_at(layers: Any, i: Array) -> Any:
    """Block ``i``'s params (``i`` traced) from :func:`_layers`: its vectors, and a :class:`LayerWeight` for
    each matrix."""
    return jax.tree.map(lambda a: LayerWeight(a, i) if isinstance(a, tuple) else a[i], layers,
                        is_leaf=lambda a: isinstance(a, tuple))


def _block(family: Family, config: Any, p: Any, i: Any, x: Array, rot: Any, mask: Array, scale: Array,
           heads: Array, weights: Array | None, sites: Sites) -> tuple[Array, Array | None]:
    """Block ``i`` (an int, or a traced index inside the loop) on the stream ``x [T, D]`` entering it:
    ``(x [T, D] leaving it, weights [L, N, T, T] with row i written)``; ``p`` is the block's params (in the
    loop, :func:`_layer_at`'s); every named site passes ``sites``."""
    s = family.sizes(config)
    N, K = s.heads, s.kv_heads
    x = sites("resid_pre", i, x)  # [T, D]
    q, k, v = (sites(name, i, a) for name, a in zip("qkv", family.qkv(p, config, x, rot)))  # [T, N|K, H]
    z, weights = causal_layer(q, k, v, mask, scale, weights, i, sites)  # [T, N, H], [L, N, T, T]
    if "attn_logits" in sites.capture:  # per query head, against its key head: the softmax's own input
        sites("attn_logits", i, _attn_logits(q, k, scale, N // K))  # [N, T, T]
    z = sites("z", i, z) * heads[i][None, :, None].astype(z.dtype)  # [T, N, H], each head times its gate
    a = sites("attn_out", i, _attn_out(family, config, p, z))  # [T, D]
    x = sites("resid_mid", i, x + a)  # [T, D]
    m = sites("mlp_out", i, _mlp(family, config, p, x))  # [T, D]
    return sites("resid_post", i, x + m), weights  # [T, D]


class _Run(NamedTuple):
    """What runs the blocks besides the stream: the same for every block."""

    rot: Any  # the family's rotation of the positions (None without RoPE)
    mask: Array  # the keep-mask [S] or [T, S]; causality comes from the slot order
    scale: Array  # the logit scale, float32
    heads: Array  # head_mask [L, N]


def _buffers(family: Family, config: Any, params: Any, x: Array, run: _Run, capture: tuple[str, ...], patch: Any,
             maps: bool) -> tuple[Array | None, dict[str, Array]]:
    """Zeroed ``[L, ...]`` buffers for what the blocks write, made before the loop that carries them: every
    layer's maps (None without ``maps``) and each captured tensor, shaped (and, under Explicit mesh axes,
    split; inside ``shard_map``, varying) like block 0's."""
    L = family.sizes(config).layers
    q, k = jax.eval_shape(lambda x: family.qkv(family.layer(params, 0), config, x, run.rot)[:2], x)
    weights = maps_buffer(_sharding.maps_struct(L, x.shape[0], q, k)) if maps else None  # [L, N, T, T]
    if not capture:
        return weights, {}

    def block0(x):  # what block 0 captures, as a Sites keeps it: [L, ...] buffers
        sites = Sites(capture, patch, L)
        _block(family, config, family.layer(params, 0), 0, x, *run, None, sites)
        return sites.kept

    shapes = jax.eval_shape(block0, x)
    return weights, {name: _sharding.zeros(a.shape, a.dtype, a) for name, a in shapes.items()}


def _blocks(family: Family, config: Any, params: Any, x: Array, start: Any, run: _Run, weights: Array | None,
            sites: Sites) -> tuple[Array, Array | None, dict[str, Array]]:
    """Blocks ``start..L-1`` on the stream ``x [T, D]`` entering block ``start`` (an int or a traced int32
    scalar), as one ``lax.fori_loop``: one compiled block serves every layer (and every start).

    Returns ``(x [T, D] leaving the last block, weights, captured)``: ``weights [L, N, T, T]`` with rows
    ``start..L-1`` written (None stays None), ``captured`` the ``[L, ...]`` buffers of ``sites``, which
    must be made before the loop (:func:`_buffers`)."""
    L = family.sizes(config).layers
    layers = _layers(family, config, params)

    def body(i, carry):
        x, weights, kept = carry
        sites_i = Sites(sites.capture, sites.patch, L, kept)
        x, weights = _block(family, config, _layer_at(layers, i), i, x, *run, weights, sites_i)
        return x, weights, sites_i.kept

    return jax.lax.fori_loop(start, L, body, (x, weights, sites.kept))


def _unrolled(family: Family, config: Any, capture: tuple[str, ...], maps: bool, params: Any, x: Array, run: _Run,
              patch: Any) -> tuple[Array, Array | None, dict[str, Array]]:
    """Every block from the stream ``x [T, D]`` entering block 0, written out one after the other (what
    the derivatives of :func:`_all_blocks` run): ``(x, weights [L, N, T, T] (None without maps), captured)``."""
    L = family.sizes(config).layers
    weights, kept = _buffers(family, config, params, x, run, capture, patch, maps=maps)
    sites = Sites(capture, patch, L, kept)
    for i in range(L):
        x, weights = _block(family, config, family.layer(params, i), i, x, *run, weights, sites)
    return x, weights, sites.kept


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _all_blocks(family: Family, config: Any, capture: tuple[str, ...], maps: bool, params: Any, x: Array, run: _Run,
                patch: Any) -> tuple[Array, Array | None, dict[str, Array]]:
    """Every block from the stream ``x [T, D]`` entering block 0: ``(x, weights [L, N, T, T], captured)``;
    without ``maps`` no map is kept (``weights`` is None: nothing of ``[L, N, T, T]`` is allocated).

    Evaluated as the loop of :func:`_blocks` (one compiled block). Its derivatives, forward and reverse,
    are those of :func:`_unrolled`, the same blocks written out: reverse mode through the loop would add
    the cotangents of EVERY layer's params at every step (each branch of the switch returns zeros for
    the params it does not read), where the written-out blocks give each layer's params their own.
    """
    L = family.sizes(config).layers
    weights, kept = _buffers(family, config, params, x, run, capture, patch, maps=maps)
    return _blocks(family, config, params, x, 0, run, weights, Sites(capture, patch, L, kept))


@functools.partial(_all_blocks.defjvp, symbolic_zeros=True)
def _all_blocks_jvp(family: Family, config: Any, capture: tuple[str, ...], maps: bool, primals: tuple,
                    tangents: tuple) -> tuple:
    """The JVP of :func:`_unrolled`, taken in the inputs that are perturbed only (a parameter without a
    tangent, or an integer input, stays a constant instead of carrying zeros through every product)."""
    leaves, tree = jax.tree.flatten(primals)
    t_leaves = jax.tree.leaves(tangents, is_leaf=lambda t: isinstance(t, SymbolicZero))
    moving = [not isinstance(t, SymbolicZero) for t in t_leaves]
    t_moving = [t for t, m in zip(t_leaves, moving) if m]

    def of_moving(*xs):
        it = iter(xs)
        return _unrolled(family, config, capture, maps, *jax.tree.unflatten(tree, [next(it) if m else a
                                                                            for a, m in zip(leaves, moving)]))

    return jax.jvp(of_moving, tuple(a for a, m in zip(leaves, moving) if m), tuple(t_moving))


def _run(family: Family, config: Any, keep: Array, pos: Array, T: int, heads: Array, scale: Array) -> _Run:
    s = family.sizes(config)
    return _Run(_rotation(family, config, pos, T), _key_mask(keep, pos, s.window), scale, heads)


def _head(family: Family, config: Any, params: Any, x: Array, weights: Array | None, captured: dict) -> ModelOutput:
    h = family.final_norm(params, config, x)  # [T, D]
    return ModelOutput(logits=_unembed(family, config, params, h), last_hidden_state=h, attentions=weights,
                       captured=captured)


@functools.partial(jax.jit, static_argnames=("family", "config", "capture", "maps"))
def _forward(params, ids, keep, heads, scale, patch, *, family: Family, config, capture, maps=True) -> ModelOutput:
    T = ids.shape[0]
    pos = positions(keep)  # [T], real tokens counted from 0 (as Hugging Face's generate does for padding)
    x = _embed(family, config, params, ids, pos)  # [T, D]
    run = _run(family, config, keep, pos, T, heads, scale)
    x, weights, captured = _all_blocks(family, config, capture, maps, params, x, run, patch)
    return _head(family, config, params, x, weights, captured)


@functools.partial(jax.jit, static_argnames=("family", "config", "rows"))
def _resume(params, resid, layer, keep, pos, heads, scale, patch, weights, *, family: Family, config,
            rows: int) -> ModelOutput:
    """Blocks ``layer..L-1`` from the stream ``resid [T, D]`` entering block ``layer`` (a traced int32 scalar):
    the forward's loop, started at ``layer``, so one compiled block serves every start layer. ``rows``:
    the positions the rotation covers, ``[0, rows)``."""
    L = family.sizes(config).layers
    run = _run(family, config, keep, pos, rows, heads, scale)
    q0 = jax.eval_shape(lambda x: family.qkv(family.layer(params, 0), config, x, run.rot)[0], resid)  # [T, N, H]
    weights = _sharding.maps_like(weights, q0)  # under Explicit mesh axes: split like the maps written into it
    x, weights, _ = _blocks(family, config, params, resid, layer, run, weights, Sites((), patch, L))
    return _head(family, config, params, x, weights, {})


def _checked_resume(family: Family, params: Any, config: Any, resid_pre: Any, layer: Any, *,
                    attention_mask: Any = None, positions: Any = None, head_mask: Any = None, scale: Any = None,
                    patch: Any = None, attentions: Any = None) -> ModelOutput:
    """The checked resumed forward of a family (each model module's ``resume`` documents it)."""
    s = check_config(family, config)
    family.check_params(params, config)
    x = _stream(resid_pre, s.width)
    T = x.shape[0]
    at = _layer_index(layer, s.layers)
    keep, pos = _packed_keep(attention_mask, positions, T, s.max_length, family.max_name)
    # the rotation's rows: T covers the positions a [T] mask makes; a packed sequence's concrete positions
    # beyond T need the table up to max_length (traced ones outside [0, T) get NaN rows, never wrong ones)
    concrete = positions is not None and not isinstance(positions, jax.core.Tracer)
    rows = s.max_length if concrete and int(np.max(np.asarray(positions))) >= T else T
    _stream_dtype(family, config, params, x)
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.head_dim)
    shapes = site_shapes(T=T, S=T, N=s.heads, K=s.kv_heads, H=s.head_dim, D=s.width)
    patch = check_patch(patch, shapes, s.layers)
    maps = (s.layers, s.heads, T, T)
    if attentions is None:
        weights = jnp.zeros(maps, x.dtype)
    else:
        weights = jnp.asarray(attentions)
        if weights.shape != maps or not jnp.issubdtype(weights.dtype, jnp.floating):
            raise ValueError(f"attentions must be a float array [L, N, T, T] = {maps} (the clean run's maps), "
                             f"received dtype {weights.dtype.name} shape {tuple(weights.shape)}")
    return _resume(params, x, at, keep, pos, heads, jnp.asarray(scale, jnp.float32), patch, weights.astype(x.dtype),
                   family=family, config=config, rows=rows)


def _packed_keep(mask: Any, pos: Any, T: int, max_length: int, max_name: str) -> tuple[Array, Array]:
    """``(keep [T] or [T, T], positions [T])`` of :func:`resume`: a ``[T]`` mask gives the positions of
    :func:`forward`; a ``[T, T]`` one (packed sequences) needs them given."""
    if mask is not None and jnp.ndim(mask) == 2:
        if tuple(jnp.shape(mask)) != (T, T):
            raise ValueError(f"attention_mask must have shape [T] = ({T},) or [T, T] = ({T}, {T}) (each query's keys), "
                             f"received shape {tuple(jnp.shape(mask))}")
        dtype = getattr(mask, "dtype", None) or np.asarray(mask).dtype
        if dtype != np.bool_:
            raise TypeError(f"attention_mask [T, T] must be boolean (True = the query sees the key), received dtype "
                            f"{np.dtype(dtype).name}")
        if pos is None:
            raise ValueError("positions must be given with a [T, T] attention_mask (packed sequences: each token's "
                             "position in its own sequence)")
        pos_dtype = getattr(pos, "dtype", None) or np.asarray(pos).dtype
        if tuple(jnp.shape(pos)) != (T,) or not jnp.issubdtype(pos_dtype, jnp.integer):
            raise ValueError(f"positions must be integer [T] = ({T},), received dtype {np.dtype(pos_dtype).name} "
                             f"shape {tuple(jnp.shape(pos))}")
        if not isinstance(pos, jax.core.Tracer):
            a = np.asarray(pos)
            outside = np.flatnonzero((a < 0) | (a >= max_length))
            if outside.size:
                row = int(outside[0])
                raise ValueError(f"positions must lie in [0, {max_name}) = [0, {max_length}), received {int(a[row])} "
                                 f"at row {row}")
        return jnp.asarray(mask), jnp.asarray(pos).astype(jnp.int32)
    if T > max_length:
        raise ValueError(f"resid_pre must hold 1 to {max_name}={max_length} tokens, received T={T}")
    if pos is not None:
        raise ValueError("positions are given only with a [T, T] attention_mask (packed sequences); a [T] mask "
                         "makes them from the real tokens")
    keep = _keep(mask, T)
    return keep, positions(keep)


def _stream(x: Any, D: int) -> Array:
    dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"resid_pre must be a float array [T, D] (the stream entering a block), received dtype "
                        f"{np.dtype(dtype).name}")
    shape = tuple(jnp.shape(x))
    if len(shape) != 2 or shape[1] != D or shape[0] < 1:
        raise ValueError(f"resid_pre must have shape [T, D] with D = {D} and T >= 1 (batch with jax.vmap), "
                         f"received shape {shape}")
    return jnp.asarray(x)


def _stream_dtype(family: Family, config: Any, params: Any, x: Array) -> None:
    """``resid_pre``'s dtype must be the residual stream's in :func:`forward`, the embedding's (the params'):
    the loop over the layers carries the stream in one dtype. Shapes and dtypes only (traced params pass)."""
    one = jnp.zeros((1,), jnp.int32)
    want = jax.eval_shape(lambda p: family.embed(p, config, one, one), params).dtype
    if x.dtype != want:
        raise TypeError(f"resid_pre must have the dtype of the residual stream the forward carries, {want.name} "
                        f"(the params' dtype), received dtype {x.dtype.name}; cast it with "
                        f"resid_pre.astype(jnp.{want.name}) or the params to {x.dtype.name}")


def _layer_index(layer: Any, L: int) -> Array:
    """``layer`` as an int32 scalar; a concrete one must lie in ``[0, L)`` (a traced one is clamped by the loop)."""
    if isinstance(layer, jax.core.Tracer):
        if jnp.ndim(layer) != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise TypeError(f"layer must be an int scalar, received a traced {layer.dtype} of shape {layer.shape}")
        return layer.astype(jnp.int32)
    a = np.asarray(layer)
    if isinstance(layer, bool) or a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"layer must be an int (the block the stream enters), received {layer!r}")
    if not 0 <= int(a) < L:
        raise ValueError(f"layer must lie in [0, L) = [0, {L}), received {int(a)}")
    return jnp.asarray(int(a), jnp.int32)


_WARNED_CLOSED_OVER = []  # a warning once per process


def warn_if_params_closed_over(params: Any, input_ids: Any, fn: str) -> None:
    """Warn, once, when ``fn`` is traced by ``jax.jit`` with its ids traced but its params concrete arrays:
    the caller's ``jit`` closed over the weights, which makes every weight a constant of the compiled
    program for XLA to fold (tens of seconds on a 135M model). Nothing is changed; only ``jit`` tracing
    counts (``vmap`` or ``grad`` over a closure compile nothing of the weights)."""
    if _WARNED_CLOSED_OVER or not isinstance(input_ids, jax.core.Tracer):
        return
    from jax._src import core as _core  # the one query of whether a jit trace is running

    under_jit = getattr(_core, "unsafe_am_i_under_a_jit", None)
    if under_jit is None or not under_jit():
        return
    big = [x for x in jax.tree.leaves(params) if not isinstance(x, jax.core.Tracer) and np.size(x) >= 4096]
    if big:
        import warnings

        _WARNED_CLOSED_OVER.append(True)
        warnings.warn(
            f"{fn} is being traced by jax.jit with the ids traced but the params as concrete arrays: the "
            f"jitted function closes over the weights, so each becomes a constant of the compiled program "
            f"and XLA constant-folds them (slow to compile). Pass params as an argument instead: "
            f"jax.jit(lambda p, ids: {fn}(p, config, ids))(params, ids). (Shown once.)",
            stacklevel=4,
        )


def _checked_forward(family: Family, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
            head_mask: Any = None, scale: Any = None, return_attention_logits: bool = False,
            return_qkv: bool = False, return_hidden_states: bool = False, capture: Any = (),
            patch: Any = None) -> ModelOutput:
    """The checked forward of a family (each model module's ``forward`` documents it)."""
    warn_if_params_closed_over(params, input_ids, f"{family.name}.forward")
    s = check_config(family, config)
    family.check_params(params, config)
    ids = _ids(family, config, input_ids)
    T = ids.shape[0]
    keep = _keep(attention_mask, T)
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.head_dim)
    shapes = site_shapes(T=T, S=T, N=s.heads, K=s.kv_heads, H=s.head_dim, D=s.width)
    asked = check_capture(capture)
    flags = dict(want_logits=bool(return_attention_logits), want_qkv=bool(return_qkv),
                 want_hidden=bool(return_hidden_states))
    out = _forward(params, ids, keep, heads, jnp.asarray(scale, jnp.float32), check_patch(patch, shapes, s.layers),
                   family=family, config=config, capture=sugar_names(asked, **flags))
    return with_sugar(out, asked, **flags)


def _checked_log_prob(family: Family, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
             start: Any = 0, end: Any = None, scale: Any = None) -> Array:
    """The checked span score of a family (each model module's ``log_prob`` documents it)."""
    warn_if_params_closed_over(params, input_ids, f"{family.name}.log_prob")
    s = check_config(family, config)
    family.check_params(params, config)
    ids = _ids(family, config, input_ids)
    end = check_span(start, end, ids.shape[0])
    keep = _keep(attention_mask, ids.shape[0])
    scale = jnp.asarray(check_scale(scale, s.head_dim), jnp.float32)
    return _log_prob(params, ids, keep, scale, start, end, family=family, config=config)


@functools.partial(jax.jit, static_argnames=("family", "config"))
def _log_prob(params, ids, keep, scale, start, end, *, family: Family, config) -> Array:
    """The span score as one compiled program: the forward without its maps (nothing of ``[L, N, T, T]``
    is allocated), then :func:`span_log_prob` on its logits."""
    s = family.sizes(config)
    heads = jnp.ones((s.layers, s.heads), jnp.float32)  # no head masked
    out = _forward(params, ids, keep, heads, scale, {}, family=family, config=config, capture=(), maps=False)
    return _sharding.auto(span_log_prob)(out.logits, ids, keep, start, end)


# ----------------------------------------------------------------------------------------------------
# Generation with a key/value cache: one compiled step reads each new token (and a short prompt) and runs
# the layers as the forward does (one block in a loop), so generation compiles ONE block, whatever the
# depth; a long prompt runs in one pass of the forward's loop.
# ----------------------------------------------------------------------------------------------------


def _pick(logits: Array, key: Array | None, temperature: Array, greedy: bool) -> Array:
    """The next token from ``logits [V]``: the argmax, or a draw from ``softmax(logits / temperature)``.

    The draw uses ``(logits - max) / temperature`` with the maximum's entries exactly 0, so a tiny
    temperature (even one that underflows to 0) concentrates on the argmax instead of overflowing.
    """
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    x = logits.astype(jnp.float32)
    top = jnp.max(x)
    scaled = jnp.where(x == top, 0.0, (x - top) / temperature)  # [V], <= 0
    return jax.random.categorical(key, scaled).astype(jnp.int32)


PROMPT_ROWS = 8  # a prompt this long or shorter is read by the generation step itself


def _cache_step(family: Family, config: Any, layers: Any, x: Array, rot: Any, seen: Array, own: Array, at: Array,
                cache: tuple[Array, Array], scale: Array, heads: Array) -> tuple[Array, tuple[Array, Array]]:
    """Every block on rows ``x [R, D]`` that go to cache slots ``at..at+R-1``. Each layer attends, through
    :func:`jaxattn.multi_head_attention`, to the cached keys and values (``cache``, ``[L, S, K, H]`` each)
    that ``seen`` keeps (``[S]``, or ``[R, S]`` under a sliding window) and, causally, to the rows' own
    (``own [R]`` keeps the real ones, ``[R, R]`` under a window); then writes the rows' own into the cache."""
    S = cache[0].shape[1]

    def layer(l, c):
        x, (cache_k, cache_v) = c
        p = _layer_at(layers, l)
        q, k, v = family.qkv(p, config, x, rot)  # [R, N, H], 2 x [R, K, H]
        keys, values = (jnp.concatenate([c[l].astype(q.dtype), a]) for c, a in ((cache_k, k), (cache_v, v)))  # [S + R, K, H]
        z = _attend(q, keys, values, jnp.concatenate([seen, own], axis=-1), scale, S)  # [R, N, H]
        cache_k, cache_v = (jax.lax.dynamic_update_index_in_dim(c, jax.lax.dynamic_update_slice_in_dim(
            c[l], a.astype(c.dtype), at, 0), l, 0) for c, a in ((cache_k, k), (cache_v, v)))
        z = z * heads[l][None, :, None].astype(z.dtype)
        x = x + _attn_out(family, config, p, z)
        return x + _mlp(family, config, p, x), (cache_k, cache_v)  # [R, D]

    return jax.lax.fori_loop(0, family.sizes(config).layers, layer, (x, cache))


@functools.partial(jax.jit, static_argnames=("family", "config", "max_new_tokens", "greedy", "return_logits"))
def _generate(params, prompt, keep, heads, scale, temperature, key, *, family: Family, config, max_new_tokens,
              greedy, return_logits):
    """ONE compiled step of ``R`` rows reads each new token into the next cache slot (a ``lax.scan``), its
    ``R - 1`` other rows repeating it; its rows attend to the cache before the token's slot and causally
    to their own keys, so what a step writes after its token is never seen (the next token's step writes
    over it first). A prompt of at most ``PROMPT_ROWS`` tokens is read by that same step (``R = T``, the
    scan's first step), so generation compiles one block; a longer one in one pass of the forward's loop
    (``R = 1``), which costs a second compiled block and saves reading the prompt a few rows a step.
    Every step unembeds its rows and picks from one, the last real prompt token's or the new token's."""
    s = family.sizes(config)
    L, T, new = s.layers, prompt.shape[0], max_new_tokens
    short = T <= PROMPT_ROWS
    R = T if short else 1  # rows a step reads
    slots = T + new + R - 2  # the prompt, new tokens but the last, the last step's other rows
    pos = positions(keep)  # [T]
    real = jnp.sum(keep).astype(jnp.int32)  # the first new token's position
    key_pos = jnp.concatenate([pos, real + jnp.arange(slots - T, dtype=jnp.int32)])  # [slots]
    key_keep = jnp.concatenate([keep, jnp.ones((slots - T,), bool)])  # [slots]: new tokens are real
    last = jnp.max(jnp.where(keep, jnp.arange(T), -1))  # the last real token: it predicts the first new one
    layers = _layers(family, config, params)
    keys = None if greedy else jax.random.split(key, new)
    run = _run(family, config, keep, pos, T, heads, scale)
    k0 = jax.eval_shape(lambda: family.qkv(family.layer(params, 0), config, _embed(family, config, params, prompt, pos),
                                           run.rot)[1])  # [T, K, H]
    cache = tuple(_sharding.zeros((L, slots, s.kv_heads, s.head_dim), k0.dtype, k0) for _ in "kv")  # split like k

    def step(carry, k):  # feeds new token k - 1 (or, when short, the prompt at k = 0) and picks token k
        cache, token = carry
        reading = (k == 0) if short else False  # the step that reads the prompt
        at = jnp.where(reading, 0, T + k - 1)  # the first slot the step writes
        ids = jnp.where(reading, prompt, token) if short else token[None]  # [R]
        rows_pos = jnp.where(reading, pos, real + k - 1) if short else (real + k - 1)[None]  # [R]
        seen = key_keep & (jnp.arange(slots) < at)  # [slots]: the real tokens before the step
        own = jnp.where(reading, keep, True) if short else jnp.ones((1,), bool)  # [R]
        if s.window is not None:  # query t sees keys s with t - s < window
            seen = seen[None, :] & (rows_pos[:, None] - key_pos[None, :] < s.window)  # [R, slots]
            own = own[None, :] & (rows_pos[:, None] - rows_pos[None, :] < s.window)  # [R, R]
        h = _embed(family, config, params, ids, rows_pos)  # [R, D]
        rot = _rotation(family, config, rows_pos, slots)
        h, cache = _cache_step(family, config, layers, h, rot, seen, own, at, cache, scale, heads)  # [R, D]
        logits = _unembed(family, config, params, family.final_norm(params, config, h))  # [R, V]
        logits = logits[jnp.where(reading, last, 0)] if short else logits[0]  # [V]
        picked = _pick(logits, None if greedy else keys[k], temperature, greedy)
        return (cache, picked), (picked, logits if return_logits else None)

    if short:  # the scan's first step reads the prompt
        first, steps = prompt[0], jnp.arange(new)  # prompt[0]: a placeholder, never read
    else:  # the prompt in one pass of the forward's loop: its keys and values fill the cache's first T slots
        x = _embed(family, config, params, prompt, pos)  # [T, D]
        x, _, kept = _all_blocks(family, config, ("k", "v"), False, params, x, run, {})  # [T, D]
        cache = tuple(jax.lax.dynamic_update_slice(c, kept[n].astype(c.dtype), (0, 0, 0, 0)) for c, n in zip(cache, "kv"))
        logits0 = _unembed(family, config, params, family.final_norm(params, config, x[last]))  # [V]
        first, steps = _pick(logits0, None if greedy else keys[0], temperature, greedy), jnp.arange(1, new)
    _, (picked, logits) = jax.lax.scan(step, (cache, first), steps)
    if not short:
        picked = jnp.concatenate([first[None], picked])  # [new]
        logits = jnp.concatenate([logits0[None], logits]) if return_logits else None  # [new, V]
    ids = jnp.concatenate([prompt, picked])  # [T + new]
    return (ids, logits) if return_logits else ids


def _checked_generate(family: Family, params: Any, config: Any, prompt_ids: Any, *, max_new_tokens: Any,
             attention_mask: Any = None, head_mask: Any = None, temperature: Any = 0.0, key: Any = None,
             scale: Any = None, return_logits: bool = False) -> Any:
    """The checked generation of a family (each model module's ``generate`` documents it)."""
    s = check_config(family, config)
    family.check_params(params, config)
    new = check_int(max_new_tokens, "max_new_tokens")
    ids = _ids(family, config, prompt_ids, "prompt_ids")
    if ids.shape[0] + new > s.max_length:
        raise ValueError(f"prompt_ids T={ids.shape[0]} plus max_new_tokens={new} exceeds "
                         f"{family.max_name}={s.max_length}")
    keep = _keep(attention_mask, ids.shape[0])
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.head_dim)
    greedy, key = sampling(temperature, key)
    return _generate(params, ids, keep, heads, jnp.asarray(scale, jnp.float32),
                     jnp.asarray(0.0 if greedy else temperature, jnp.float32), None if greedy else key, family=family,
                     config=config, max_new_tokens=new, greedy=greedy, return_logits=bool(return_logits))


def stack_layers(family: Family, params: Any, config: Any) -> Any:
    """Every block's params stacked over layers, ``[L, ...]`` leaves (for the protocol's per-layer tables)."""
    L = family.sizes(config).layers
    return jax.tree.map(lambda *a: jnp.stack(a), *[family.layer(params, i) for i in range(L)])


# ----------------------------------------------------------------------------------------------------
# Each family's public forward, log_prob and generate: one signature and one docstring, written here.
# ----------------------------------------------------------------------------------------------------

_FORWARD_DOC = """{title} forward pass on one sequence, with every layer's attention map (jit-compiled).

    {formula} The maps returned are the weights that produced the output.

    A pure function of its array arguments: ``jax.grad`` with respect to ``params`` (or ``head_mask``,
    ``scale``, a patch value), ``jax.jit`` with params as an argument, and ``jax.vmap`` over stacked
    params or over a batch of sequences all work. Only static shapes are checked here; :func:`load` and
    :func:`check_params` check a checkpoint's structure.

    The blocks run as ONE compiled block in a loop over the layers, each layer's weights read where they
    lie in ``params``, so the first call compiles one block whatever the depth; derivatives (``jax.grad``,
    ``jax.jvp``) run the same blocks written out one after another, which gives each layer's params
    their own cotangent.

    Args:
      params: the params pytree (the module docstring's layout), e.g. from :func:`load`.
      config: the model's :class:`{config}`.
      input_ids: integer token ids ``[T]``, ``1 <= T <= {max_name}``. A batch is ``jax.vmap`` of this.
        An id outside ``[0, vocab_size)`` raises ``ValueError`` when the ids are concrete; under
        ``jit``/``vmap`` (traced ids) its position's embedding is NaN, so its logits and those of every
        later position are NaN (never another token's).
      attention_mask: ``[T]``, 1 (or True) for a real token, 0 for padding; ``None``: all real; a concrete
        mask with no real token is refused. Padded keys get weight 0 and positions count real tokens
        only (as Hugging Face's ``generate``), so a left- or right-padded sequence gives at its real
        positions the logits and maps of the sequence alone. Rows at padded positions mean nothing.
      head_mask: ``[L, N]`` (query heads), Hugging Face's meaning: each head's output ``z`` is multiplied
        by its entry before the output projection (0 ablates the head, 1 keeps it; any float,
        differentiable). ``None``: ones.
      scale: the attention logit scale; ``None`` is ``1/sqrt(H)``, the value the model was trained with.
        ``scale=1.0`` runs the trained weights without the ``√d_k`` (the collapse experiment); a traced
        scale is accepted.
      return_attention_logits, return_qkv, return_hidden_states: sugar over ``capture``, filling
        ``attention_logits [L, N, T, T]``, ``q [L, T, N, H]`` and ``k, v [L, T, K, H]``, and
        ``hidden_states [L + 1, T, D]`` (every block's ``resid_pre``, then ``last_hidden_state``).
      capture: names of per-layer tensors to return in ``captured``, each stacked ``[L, ...]``:
        ``resid_pre, q, k, v, attn_logits, attn_weights, z, attn_out, resid_mid, mlp_out, resid_post``
        (shapes and meanings in ``docs/models.md``; ``z [L, T, N, H]`` is each head's output before
        ``head_mask``; ``resid_post`` is before the final norm).
      patch: ``{{name: (value, where)}}`` with ``value`` ``[L, ...]`` (a captured tensor's shape) and a
        boolean ``where`` of the same shape (or 1 along any axis): where True, the forward uses ``value``
        instead of the tensor it made, at the place it is made, so everything downstream sees it (e.g.
        ``z`` of chosen heads from another input). Differentiable in ``value``; ``attn_logits`` is read
        only (patch ``attn_weights``). What that gradient is: ``∂/∂value`` of the patched forward, in
        which the patched entries are inputs, so nothing upstream of them depends on ``value`` and every
        path through a patched entry of a LATER layer is cut. Patching one layer's tensor with its own
        value gives the total derivative with respect to that tensor; patching several layers at once
        gives each a partial derivative that holds the other patched layers fixed (on a random 2-layer
        GPT-2 it moved layer 0's attention × gradient by up to 1.7%, docs/interventions.md):
        :func:`jaxattn.interventions.layer_gradients` patches one layer at a time for that reason.

    Returns:
      A :class:`jaxattn.models.ModelOutput`: ``logits [T, V]`` (``unembed(last_hidden_state)``),
      ``last_hidden_state [T, D]`` (the final norm's output), ``attentions [L, N, T, T]``, ``captured``
      and the sugar fields asked for.
    """

_LOG_PROB_DOC = """``Σ_{{start <= t < end}} log p(ids[t] | ids[:t])`` over real tokens: the log-probability of a span.

    Token ``t`` is scored from the logits of the last real token before it, so a padded sequence scores
    as the sequence alone: the first real token has no prediction and never counts, nor do padded
    positions. ``start`` and ``end`` index the PADDED array (under left padding by ``p`` tokens, position
    ``t`` of the sequence alone is ``t + p``; :func:`jaxattn.models.left_pad` pads a batch) and may be
    traced (``jit``/``vmap`` over spans and batches); concrete values must satisfy
    ``0 <= start <= end <= T``.

    Args:
      input_ids: ``[T]``, e.g. a prefix followed by the continuation that starts at token ``start``.
      attention_mask: ``[T]``, as in :func:`forward`.
      start, end: the span ``[start, end)`` of positions scored; ``end=None`` is ``T``.
      scale: as in :func:`forward`.

    Returns:
      a float32 scalar (nats).
    """

_GENERATE_DOC = """Continue ``prompt_ids`` by ``max_new_tokens`` tokens with a key/value cache; returns ``[T + new]``.

    The cache (every layer's keys, after any rotation, and values: ``[L, slots, K, H]``) is preallocated,
    and ONE compiled step (a ``lax.scan``) reads each new token, attending to the cache and to itself
    through :func:`jaxattn.multi_head_attention`, the layers run as the forward runs them (one compiled
    block in a loop). A prompt of at most 8 tokens is read by that same step, so generation compiles one
    block whatever the depth; a longer one in one pass of the forward's loop (a second compiled block).
    Greedy (``temperature=0``) output is the argmax of the full :func:`forward` at every step. The first
    new token is predicted from the last REAL prompt token, so a left- or right-padded prompt continues
    as the prompt alone (the new tokens come after the whole padded array); a batch of prompts is
    ``jax.vmap`` of this over padded prompts with their ``attention_mask``.

    Args:
      prompt_ids: ``[T]`` token ids.
      max_new_tokens: how many tokens to add, ``>= 1``; ``T + max_new_tokens <= {max_name}``.
      attention_mask: ``[T]`` for a padded prompt, as in :func:`forward` (one with no real token is refused).
      head_mask, scale: as in :func:`forward`.
      temperature: 0 for greedy decoding; a finite ``> 0`` samples from ``softmax(logits / temperature)``
        (a tiny one picks the argmax, never an overflow). Python or NumPy numbers.
      key: a ``jax.random`` key or an int seed (64 bits), needed when ``temperature > 0``.
      return_logits: also return the logits each new token was chosen from, ``[max_new_tokens, V]``.

    Returns:
      ``[T + max_new_tokens]`` int32: the prompt followed by the new tokens (and the logits, on request).
    """


_RESUME_DOC = """{title} forward resumed at block ``layer`` from the residual stream entering it (jit-compiled).

    Runs blocks ``layer..L-1`` only, from ``resid_pre``: given ``out = forward(params, config, ids,
    capture=("resid_pre",))``, ``resume(params, config, out.captured["resid_pre"][l], l)`` gives
    ``out``'s logits and last hidden state (to float rounding) without recomputing blocks ``0..l-1``, and
    with interventions of blocks ``l..L-1`` (``head_mask``, ``patch``) the output :func:`forward` gives
    with the same interventions: an intervention at block ``l`` leaves the blocks before it unchanged, so
    its effect needs only the blocks from ``l`` on (what the effect tables of
    :mod:`jaxattn.interventions` use). The blocks run as one ``lax.fori_loop`` whose start is ``layer``,
    so a traced ``layer`` is accepted and one compiled program serves every start. Under ``jax.vmap`` keep
    ``layer`` unbatched (a batched start runs every sequence for as many blocks as the earliest start
    needs, selecting the rest away). The loop's trip count is traced, so the result can be differentiated
    forward (``jax.jvp``) but not backward (``jax.grad``): :func:`forward` with ``patch`` gives gradients.

    Args:
      params, config: as in :func:`forward`.
      resid_pre: ``[T, D]``, the residual stream entering block ``layer`` (``captured["resid_pre"][layer]``),
        in the dtype :func:`forward` carries it (the params'); another dtype is refused (``TypeError``).
      layer: the first block run, an int in ``[0, L)`` or a traced int32 scalar.
      attention_mask: ``[T]``, as in :func:`forward`: the mask of the run ``resid_pre`` comes from. Or a
        boolean ``[T, T]``, the keys each query sees (causality still applies, in the order of the rows),
        with ``positions``: several sequences packed into one, e.g. two continuations of one prompt with
        the prompt's rows once, each continuation seeing the prompt and itself (what the effect tables
        do with a batch whose sequences share a prefix).
      positions: ``[T]`` int, each row's position in its own sequence, in ``[0, {max_name})``; only with a
        ``[T, T]`` mask. Concrete positions outside are refused (``ValueError``); a traced position outside
        ``[0, T)`` gives its row NaN (RoPE families), never another position's rotation.
      head_mask, patch, scale: as in :func:`forward`; the entries of blocks before ``layer`` have no effect
        (those blocks are not run).
      attentions: ``[L, N, T, T]``, the maps returned for blocks before ``layer`` (the run ``resid_pre``
        comes from: ``out.attentions``), so that a function of the output that reads them sees a whole
        forward's maps; ``None``: zeros there.

    Returns:
      A :class:`jaxattn.models.ModelOutput` with ``logits [T, V]``, ``last_hidden_state [T, D]``,
      ``attentions [L, N, T, T]`` (blocks before ``layer`` from ``attentions``) and nothing captured.
    """


def public_resume(family: Family, *, title: str) -> Callable:
    """A family's public ``resume`` (the model protocol's resumed forward), with its signature and docstring."""

    def resume(
        params: Any,
        config: Any,
        resid_pre: Float[ArrayLike, "T D"],
        layer: Int[ArrayLike, ""],
        *,
        attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | Bool[ArrayLike, "T T"] | None = None,
        positions: Int[ArrayLike, "T"] | None = None,
        head_mask: Real[ArrayLike, "L N"] | None = None,
        scale: Real[ArrayLike, ""] | None = None,
        patch: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
        attentions: Float[ArrayLike, "L N T T"] | None = None,
    ) -> ModelOutput:
        return _checked_resume(family, params, config, resid_pre, layer, attention_mask=attention_mask,
                               positions=positions, head_mask=head_mask, scale=scale, patch=patch,
                               attentions=attentions)

    resume.__doc__ = _RESUME_DOC.format(title=title, max_name=family.max_name)
    resume.__module__ = family.name
    resume.__qualname__ = resume.__name__
    return resume


def public_api(family: Family, *, title: str, formula: str, config_name: str) -> tuple[Callable, ...]:
    """A family's public ``(forward, log_prob, generate)``: the signatures and docstrings every family shares,
    with ``title`` (e.g. "GPT-2's"), ``formula`` (the forward in one paragraph) and the config class name."""

    def forward(
        params: Any,
        config: Any,
        input_ids: Int[ArrayLike, "T"],
        *,
        attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
        head_mask: Real[ArrayLike, "L N"] | None = None,
        scale: Real[ArrayLike, ""] | None = None,
        return_attention_logits: bool = False,
        return_qkv: bool = False,
        return_hidden_states: bool = False,
        capture: Sequence[str] = (),
        patch: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
    ) -> ModelOutput:
        return _checked_forward(family, params, config, input_ids, attention_mask=attention_mask,
                                head_mask=head_mask, scale=scale, return_attention_logits=return_attention_logits,
                                return_qkv=return_qkv, return_hidden_states=return_hidden_states, capture=capture,
                                patch=patch)

    def log_prob(
        params: Any,
        config: Any,
        input_ids: Int[ArrayLike, "T"],
        *,
        attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
        start: Int[ArrayLike, ""] = 0,
        end: Int[ArrayLike, ""] | None = None,
        scale: Real[ArrayLike, ""] | None = None,
    ) -> Float[Array, ""]:
        return _checked_log_prob(family, params, config, input_ids, attention_mask=attention_mask, start=start,
                                 end=end, scale=scale)

    def generate(
        params: Any,
        config: Any,
        prompt_ids: Int[ArrayLike, "T"],
        *,
        max_new_tokens: int,
        attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
        head_mask: Real[ArrayLike, "L N"] | None = None,
        temperature: Any = 0.0,
        key: Any = None,
        scale: Real[ArrayLike, ""] | None = None,
        return_logits: bool = False,
    ) -> Int[Array, "T_new"] | tuple[Int[Array, "T_new"], Float[Array, "new V"]]:
        return _checked_generate(family, params, config, prompt_ids, max_new_tokens=max_new_tokens,
                                 attention_mask=attention_mask, head_mask=head_mask, temperature=temperature,
                                 key=key, scale=scale, return_logits=return_logits)

    fields = dict(title=title, formula=formula, config=config_name, max_name=family.max_name)
    for fn, doc in ((forward, _FORWARD_DOC), (log_prob, _LOG_PROB_DOC), (generate, _GENERATE_DOC)):
        fn.__doc__ = doc.format(**fields)
        fn.__module__ = family.name
        fn.__qualname__ = fn.__name__
    return forward, log_prob, generate
