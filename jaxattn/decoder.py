"""One causal decoder for every family, and the public contract a new family is written against.

A family (GPT-2, the Llama family with its Gemma and Qwen variants, or one of your own) is a
:class:`Family`: its sizes, embedding, the block's q/k/v (norms and rotation included), the attention
sublayer's output and the MLP's (their norms included), the final norm and the unembedding, the block's
wiring (sequential or parallel) and data indexed by the layer (a sliding window, a logit cap, a RoPE
base). Everything else is written here once: the residual stream, the named sites (``capture``,
``patch``), the head mask, causal attention through :func:`jaxattn.multi_head_attention` (each layer's
window and cap), padding, the key/value cache and sampling. :func:`forward`, :func:`log_prob`,
:func:`generate` and :func:`resume` take the family first; a model module defines its own ``forward``
etc. as plain functions that call them (:func:`document` gives them the shared docstrings).

Building blocks a family's functions use, config-free: :func:`rms_norm`, :func:`layer_norm`,
:func:`rope_frequencies`, :func:`rope_table` and :func:`rope` (rotate-halves RoPE), :func:`gated_mlp`,
:func:`embed_ids` (NaN rows for ids outside the table), :func:`soft_cap` (``c · tanh(x / c)`` with a
derivative that stays exact where ``tanh`` rounds to 1); and for params and loading:
:func:`check_stacked`, :func:`check_tree`, :func:`place_stacked`.

Every block's params are stacked ``[L, ...]`` (the in-memory layout; loaders convert Hugging Face's
per-layer layout with :func:`jaxattn.checkpoint.stack_layers`), and ONE block function serves the
forward, :func:`resume` and generation, with the attention as a strategy (the forward's causal
self-attention, or the key/value cache's read and write). The forward and generation run it as a
``lax.scan`` over the stacked blocks (one compiled block whatever the depth; derivatives in both modes
are the scan's own); :func:`resume` runs it in a ``lax.fori_loop`` from a traced start.

Axis alphabet: T tokens (queries; keys are the same tokens, S = T), N query heads, K key/value heads, H
head dim, D width, I MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _sharding
from jaxattn._attention import attention_logits, multi_head_attention
from jaxattn._checks import check_flag, check_int, check_scale
from jaxattn._inputs import check_span, sampling
from jaxattn._inputs import family_ids as _ids
from jaxattn._inputs import float32 as _float32
from jaxattn._inputs import head_mask as head_mask_
from jaxattn._inputs import keep_mask as _keep
from jaxattn._inputs import layer_index as _layer_index
from jaxattn._inputs import packed_keep as _packed_keep
from jaxattn._inputs import stream as _stream
from jaxattn._inputs import stream_dtype as _stream_dtype
from jaxattn._logits import soft_cap as _soft_cap
from jaxattn._nn import positions, span_log_prob
from jaxattn._nn import embed_ids as _embed_ids
from jaxattn._nn import layer_norm as _layer_norm
from jaxattn._sites import CAPTURE_NAMES, LayerSites, check_capture, check_patch, pad_site, site_shapes, sugar_names, with_sugar
from jaxattn.checkpoint import Fitting, check_shapes, flatten
from jaxattn.models import ModelOutput, Sizes, bucket_length

Array = jax.Array

__all__ = [
    "FORWARD_DOC", "Family", "GENERATE_DOC", "HOST_CUT_BYTES", "LOG_PROB_DOC", "PROMPT_ROWS", "RESUME_DOC", "check_config",
    "check_stacked", "check_tree", "document", "embed_ids", "forward", "gated_mlp", "generate", "layer_data",
    "layer_norm", "log_prob", "no_layer_data", "place_stacked", "resume", "rms_norm", "rope", "rope_frequencies",
    "rope_table", "soft_cap", "warn_if_params_closed_over",
]


def no_layer_data(config: Any) -> dict[str, Any]:
    """A family's :attr:`Family.layer_data` when every layer is alike: no per-layer data."""
    return {}


class Family(NamedTuple):
    """What a decoder family supplies: the extension contract of the shared decoder.

    Every field is a module-level function or a constant (the tuple is hashable: a static argument of
    the compiled programs). The decoder owns the residual stream, the named sites (capture, patch), the
    head mask, the causal attention (:func:`jaxattn.multi_head_attention`, with each layer's window and
    logit cap), padding, the key/value cache and sampling; a family owns what differs between models.

    Attributes:
      name: the family's module, for messages (``"jaxattn.llama"``).
      config_type: its config class (hashable, e.g. a ``NamedTuple``).
      sizes: ``config -> Sizes``.
      check_params: ``(params, config) -> None``, raising ``ValueError`` naming the key at fault.
      blocks: ``params -> p``: every block's params as ONE pytree whose leaves are stacked ``[L, ...]``
        (the in-memory layout): the layers run as a ``lax.scan`` over them, so a family's block
        functions get block ``l``'s own arrays ``p`` (leaves without the layer axis), to use as any array.
      embed: ``(params, config, ids [T], pos [T]) -> [T, D]``, NaN rows for ids outside ``[0, V)``.
      rotation: ``(config, pos [T], size) -> rot`` handed to ``qkv`` (``None`` without RoPE), made once for
        every layer (a family whose layers rotate differently returns what each needs and picks with ``d``).
      qkv: ``(p, config, x [T, D], rot, d) -> (q [T, N, H], k [T, K, H], v [T, K, H])``, the attention's
        input (its norm, q/k norms, the rotation included).
      attn_out: ``(p, config, z [T, N, H], d) -> [T, D]``, the attention sublayer's contribution to the
        stream (the output projection, and a post-attention norm where the family has one).
      mlp: ``(p, config, x [T, D], d) -> [T, D]``, the MLP sublayer's contribution (its norms included).
      final_norm, unembed: ``(params, config, x [..., D])``.
      max_name: the config field of the longest input, for messages.
      layer_data: ``config -> {name: [L, ...] array}``: data indexed by the layer (NumPy arrays). The
        block functions get block ``l``'s entries in ``d`` (a dict of arrays without the layer axis, with
        ``d["index"]``, the layer's index, always there). Two names are read by the decoder's attention:
        ``"window"`` (int: query ``t`` sees keys ``s`` with ``0 <= t - s < window``, positions counted
        over real tokens) and ``"logit_cap"`` (float: logits soft-capped ``c · tanh(x / c)`` before the
        softmax). Anything else (a RoPE base, a layer kind) is the family's own.
      parallel: the block's wiring: ``False`` (sequential) adds the MLP of the stream after attention,
        ``x + a + mlp(x + a)``; ``True`` (GPT-J, GPT-NeoX) adds the MLP of the stream entering the block,
        ``x + a + mlp(x)`` (``resid_mid`` is then ``x + a``, read by nothing else in the block).
    """

    name: str
    config_type: type
    sizes: Callable[[Any], Sizes]
    check_params: Callable[[Any, Any], None]
    blocks: Callable[[Any], Any]
    embed: Callable[..., Array]
    rotation: Callable[..., Any]
    qkv: Callable[..., tuple[Array, Array, Array]]
    attn_out: Callable[..., Array]
    mlp: Callable[..., Array]
    final_norm: Callable[..., Array]
    unembed: Callable[..., Array]
    max_name: str
    layer_data: Callable[[Any], Mapping[str, Any]] = no_layer_data
    parallel: bool = False


# ----------------------------------------------------------------------------------------------------
# Building blocks of a family's functions (config-free)
# ----------------------------------------------------------------------------------------------------


def rms_norm(x: Array, weight: Array, *, eps: float, plus_one: bool = False, stream: Array | None = None) -> Array:
    """``w · x / sqrt(mean(s²) + eps)`` over the last axis of ``x [..., D]`` (``weight [D]``), the statistic in
    float32 from ``s = stream`` (``x`` itself when None: ``stream`` freezes it at another tensor's, as a
    linearised norm needs); ``plus_one`` scales by ``1 + w`` (Gemma's convention). As Hugging Face rounds
    them: Llama's normalised ``x`` is cast back to ``x``'s dtype before the scale; Gemma's is scaled by
    ``1 + w`` in float32 and then cast (the two differ in bfloat16, not in float32)."""
    x32, s32 = x.astype(jnp.float32), (x if stream is None else stream).astype(jnp.float32)
    var = jnp.mean(s32 * s32, axis=-1, keepdims=True)  # [..., 1]
    normed = x32 / jnp.sqrt(var + eps)  # [..., D] float32
    shape = (1,) * (x.ndim - 1) + weight.shape
    if plus_one:
        return (normed * (1 + weight.astype(jnp.float32)).reshape(shape)).astype(x.dtype)  # [..., D]
    return weight.reshape(shape) * normed.astype(x.dtype)  # [..., D]


def rope_frequencies(head_dim: int, base: float, *, factor: float = 1.0) -> np.ndarray:
    """RoPE's inverse frequencies ``base^(-2j/H) / factor``, ``j < H/2`` (float64 NumPy; ``factor``: linear
    scaling, positions divided by it)."""
    return 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / factor


def rope_table(pos: Array, size: int, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """``cos, sin [n, 1, H/2]`` of the angles ``pos · inv_freq`` at positions ``pos [n]`` in ``[0, size)``.

    Rows of ``[size, H/2]`` tables made in NumPy (float32 angles, as Hugging Face makes them) while
    tracing: XLA gathers them where a cos/sin computed in the graph would be fused into, and recomputed
    by, every layer's rotation. A position outside ``[0, size)`` (only a traced one can be: concrete
    ones are checked) gets NaN, never another position's row (a gather would wrap or clamp it).
    """
    angle = np.arange(size, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]  # [size, H/2]
    inside = ((pos >= 0) & (pos < size))[:, None, None]  # [n, 1, 1]
    at = jnp.where(inside[:, 0, 0], pos, 0)  # [n]
    return tuple(jnp.where(inside, jnp.asarray(table)[at][:, None, :], jnp.nan)
                 for table in (np.cos(angle), np.sin(angle)))  # 2 x [n, 1, H/2]


def rope(x: Array, rot: tuple[Array, Array]) -> Array:
    """Rotate halves (Hugging Face's and llama.cpp's NEOX convention): ``(x₁, x₂) -> (x₁ cos - x₂ sin,
    x₂ cos + x₁ sin)`` of ``x [T, heads, H]`` with ``rot = (cos, sin)``, each ``[T, 1, H/2]``, in float32."""
    cos, sin = rot
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # 2 x [T, heads, H/2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)  # [T, heads, H]


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis of ``x [..., D]`` (``scale``, ``bias`` ``[D]``), GPT-2's and GPT-J's."""
    return _layer_norm(x, scale, bias, eps)


def embed_ids(table: Array, ids: Array) -> Array:
    """``table[ids]`` (``[V, D]``, ``[T]`` -> ``[T, D]``) with a row of NaN for an id outside ``[0, V)``: what
    :attr:`Family.embed` returns for a traced id no check could refuse (a plain gather would clamp or wrap
    it to another token's row)."""
    return _embed_ids(table, ids)


def soft_cap(logits: Array, cap: Any) -> Array:
    """``cap · tanh(logits / cap)`` (``cap=None``: unchanged), NaN kept; its derivative ``sech²(logits / cap)`` is
    computed without cancellation, so it stays right where ``tanh`` rounds to ±1 in float32."""
    return _soft_cap(logits, cap)


def gated_mlp(x: Array, gate: Array, up: Array, down: Array, activation: Callable[[Array], Array]) -> Array:
    """``down(act(x @ gate) · (x @ up))``, ``x [T, D]``, kernels ``(in, out)``: ``gate, up [D, I]``, ``down [I, D]``
    (SwiGLU with ``jax.nn.silu``, GeGLU with ``gelu``)."""
    return (activation(x @ gate) * (x @ up)) @ down  # [T, D]


def check_tree(params: Any, shapes: dict[str, tuple[int, ...]], *, root: str, layout: str, kernel_layout: str) -> None:
    """``params`` a dict with a ``root`` entry whose flattened leaves have exactly ``shapes`` (``ValueError``
    naming the key otherwise); reads shapes and dtypes only, so traced params pass through."""
    if not isinstance(params, dict) or root not in params:
        raise ValueError(f"params must be a dict with a '{root}' entry ({layout})")
    check_shapes(flatten(params), shapes, "params", kernel_layout=kernel_layout)


def check_stacked(params: Any, prefix: str, layers: int, *, field: str, layout: str) -> None:
    """The blocks under ``prefix`` (``"model/layers"``) are stacked ``[L, ...]`` with ``L`` the config's
    ``field``; per-layer blocks (``{prefix}/0/...``, Hugging Face's Flax layout) are refused with the one
    call that converts them. Run before any table of the config's layers is made."""
    node = params
    for depth, key in enumerate(prefix.split("/")):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"params must hold the blocks under '{prefix}' ({layout}); "
                             f"'{'/'.join(prefix.split('/')[:depth + 1])}' is missing")
        node = node[key]
    if isinstance(node, Mapping) and "0" in node:
        raise ValueError(f"params hold one dict per block under '{prefix}' (Hugging Face's per-layer layout); "
                         f"the blocks are stacked [L, ...] in memory: convert once with "
                         f"jaxattn.checkpoint.stack_layers(params, {prefix!r})")
    for key, leaf in flatten(node).items() if isinstance(node, Mapping) else ():
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != layers:
            found = f"{shape[0]} blocks" if shape else "no layer axis"
            raise ValueError(f"config.{field}={layers} but params hold {found} under '{prefix}' ('{prefix}/{key}' has "
                             f"shape {shape}, the layers first): the config does not describe these params")


def place_stacked(keys: Sequence[str], convert: Callable[[str], Any], place: Callable[[str, Any], Array], prefix: str,
                  *, workers: int = 4) -> dict[str, Array]:
    """Params in the stacked layout from per-layer keys (``{prefix}/{i}/{name}``, Hugging Face's layout):
    ``convert(key)`` gives each key's checked NumPy array, and each block weight's ``L`` arrays are written
    into one ``[L, ...]`` buffer as they come and handed to ``place(stacked key, array)`` one weight at a
    time (a few tensors converted at once, off the GIL), so the host holds at most one stacked weight
    besides the file and the tensors in flight. A :class:`~jaxattn.checkpoint.Fitting` ``place`` checks each
    block's array under its own key, and the buffer is of its dtype (each layer cast as it is written, as
    ``place`` would cast the whole)."""
    head = prefix + "/"
    groups: dict[str, list[tuple[int, str]]] = {}
    for key in keys:
        layer, _, rest = key[len(head):].partition("/") if key.startswith(head) else ("", "", "")
        if layer.isdigit() and rest:
            groups.setdefault(head + rest, []).append((int(layer), key))
        else:
            groups[key] = [(-1, key)]
    out = {}
    fitting = isinstance(place, Fitting)
    with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, workers)) as pool:
        for name, members in groups.items():
            members.sort()
            if members[0][0] < 0:
                out[name] = place(name, convert(members[0][1]))
                continue
            stacked = None
            for i, a in enumerate(pool.map(convert, [key for _, key in members])):
                if fitting:
                    place.check(members[i][1], a)
                if stacked is None:
                    stacked = np.empty((len(members), *np.shape(a)), jnp.dtype(place.dtype) if fitting else a.dtype)
                stacked[i] = a
                del a
            out[name] = place.place(name, stacked) if fitting else place(name, stacked)
            del stacked
    return out


def check_config(family: Family, config: Any) -> Sizes:
    """``family.sizes(config)``, after ``config`` is checked to be the family's config type (``TypeError``)."""
    if not isinstance(config, family.config_type):
        raise TypeError(f"config must be a {family.config_type.__name__}, received {type(config).__name__}")
    return family.sizes(config)


def _windowed(mask: Array, pos_q: Array, pos_k: Array, window: Array | None) -> Array:
    """The keep-mask ``mask`` (``[S]`` or ``[T, S]``) with a sliding window: query ``t`` keeps key ``s`` only if
    ``pos_q[t] - pos_k[s] < window`` (``[T, S]``); ``window=None`` returns ``mask`` as it is.

    The window counts positions (real tokens only), so a padded sequence sees the window of the
    sequence alone; causality itself comes from ``is_causal`` (slot order, which padding keeps).
    """
    if window is None:
        return mask
    near = pos_q[:, None] - pos_k[None, :] < window  # [T, S]
    return (mask if mask.ndim == 2 else mask[None, :]) & near


def layer_data(family: Family, config: Any) -> dict[str, Array]:
    """Every layer's data ``{name: [L, ...]}`` (:attr:`Family.layer_data`) with ``"index"``, the layers' indices."""
    L = family.sizes(config).layers
    data = {name: jnp.asarray(a) for name, a in family.layer_data(config).items()}
    for name, a in data.items():
        if a.ndim < 1 or a.shape[0] != L:
            raise ValueError(f"{family.name}: layer data {name!r} must be [L, ...] with L = {L}, received shape "
                             f"{tuple(a.shape)}")
    if "logit_cap" in data:
        data["logit_cap"] = data["logit_cap"].astype(jnp.float32)
    data["index"] = jnp.arange(L, dtype=jnp.int32)
    return data


# ----------------------------------------------------------------------------------------------------
# The pieces whose sharding a mesh with Explicit axes cannot type by itself (a lookup by token ids split
# over the data axis, a sum over heads or hidden units split over the model axis, the attention's
# bookkeeping): run through _sharding.auto, which is the plain call without such a mesh.
# ----------------------------------------------------------------------------------------------------


def _embed(family: Family, config: Any, params: Any, ids: Array, pos: Array, keep: Array) -> Array:
    """The family's embedding of ``ids [T]``; a padded (``keep`` False) position's id is never read: one
    outside ``[0, vocab)`` (which a traced id can be) embeds as id 0 there, not as the NaN a real position's
    gets, so it reaches neither a real position's output nor a gradient (``0 · NaN`` in a weight's)."""
    ids = jnp.where(keep | ((ids >= 0) & (ids < family.sizes(config).vocab)), ids, 0)  # [T]
    return _sharding.auto(lambda params, ids, pos: family.embed(params, config, ids, pos))(params, ids, pos)


def _rotation(family: Family, config: Any, pos: Array, size: int) -> Any:
    return _sharding.auto(lambda pos: family.rotation(config, pos, size))(pos)


def _attn_out(family: Family, config: Any, p: Any, z: Array, d: Any) -> Array:
    return _sharding.auto(lambda p, z, d: family.attn_out(p, config, z, d))(p, z, d)


def _mlp(family: Family, config: Any, p: Any, x: Array, d: Any) -> Array:
    return _sharding.auto(lambda p, x, d: family.mlp(p, config, x, d))(p, x, d)


def _attn_logits(q: Array, k: Array, scale: Array, group: int, cap: Array | None) -> Array:
    """``[N, T, S]``: each query head's logits against its key head (``group = N / K`` query heads each),
    soft-capped by ``cap``: the softmax's own input."""

    def logits(q, k, scale, cap):
        k_rep = jnp.repeat(k, group, axis=1)  # [T, N, H]
        out = jax.vmap(lambda qn, kn: attention_logits(qn, kn, scale=scale), in_axes=1)(q, k_rep)
        return _soft_cap(out, cap)

    return _sharding.auto(logits, _sharding.head_specs(q)[1])(q, k, scale, cap)


def _attend(q: Array, k: Array, v: Array, mask: Array, scale: Array, offset: int, cap: Array | None) -> tuple[Array, Array]:
    """``(z [R, N, H], weights [N, R, S])`` of :func:`jaxattn.multi_head_attention` of ``R`` queries that
    continue ``offset`` earlier keys (causal with ``causal_offset=offset``; ``mask`` keeps the real keys)."""
    def attend(q, k, v, mask, scale, cap):
        return multi_head_attention(q, k, v, mask=mask, scale=scale, is_causal=True, causal_offset=offset,
                                    logit_cap=cap)

    return _sharding.auto(attend, _sharding.head_specs(q))(q, k, v, mask, scale, cap)


def _unembed(family: Family, config: Any, params: Any, h: Array) -> Array:
    return _sharding.auto(lambda params, h: family.unembed(params, config, h))(params, h)


# ----------------------------------------------------------------------------------------------------
# One block, for the forward, resume and generation: the attention is a strategy (the forward's causal
# self-attention, or the cache's read and write).
# ----------------------------------------------------------------------------------------------------


class _Run(NamedTuple):
    """What every block of one forward shares besides the stream."""

    rot: Any  # the family's rotation of the positions (None without RoPE)
    mask: Array  # the keep-mask [S] or [T, S]; causality comes from the slot order
    pos: Array  # [T] each row's position (real tokens counted), for windows
    scale: Array  # the logit scale, float32


def _block(family: Family, config: Any, p: Any, d: Any, head: Array, x: Array, rot: Any, attend: Callable,
           sites: LayerSites) -> tuple[Array, Any]:
    """One block on the stream ``x [T, D]`` entering it: ``(x [T, D] leaving it, what attend returns besides z)``.

    ``p``: the block's params (leaves without the layer axis); ``d``: its layer data; ``head [N]``: its
    head gates; ``attend(q, k, v, d, sites) -> (z [T, N, H], extra)``: the attention; every named site
    passes ``sites``.
    """
    x = sites("resid_pre", x)  # [T, D]
    q, k, v = (sites(name, a) for name, a in zip("qkv", family.qkv(p, config, x, rot, d)))  # [T, N|K, H]
    z, extra = attend(q, k, v, d, sites)  # [T, N, H]
    z = sites("z", z) * head[None, :, None].astype(z.dtype)  # each head times its gate
    a = sites("attn_out", _attn_out(family, config, p, z, d))  # [T, D]
    mid = sites("resid_mid", x + a)  # [T, D]
    m = sites("mlp_out", _mlp(family, config, p, x if family.parallel else mid, d))  # [T, D]
    return sites("resid_post", mid + m), extra  # [T, D]


def _self_attention(family: Family, config: Any, run: _Run, maps: bool) -> Callable:
    """The forward's attention strategy: causal self-attention of the block's own rows, its map through the
    ``attn_weights`` site (returned as ``extra`` with ``maps``, else None)."""
    s = family.sizes(config)

    def attend(q, k, v, d, sites):
        mask = _windowed(run.mask, run.pos, run.pos, d.get("window"))  # [S] or [T, S]
        cap = d.get("logit_cap")
        z, w = _attend(q, k, v, mask, run.scale, 0, cap)  # [T, N, H], [N, T, T]
        if "attn_logits" in sites.capture:  # per query head, against its key head: the softmax's own input
            sites("attn_logits", _attn_logits(q, k, run.scale, s.heads // s.kv_heads, cap))  # [N, T, T]
        w = sites("attn_weights", w)  # [N, T, T]
        z = sites.remix(w, v, z, mask, causal=True)  # the rows a patch takes, from its weights
        return z, (w if maps else None)

    return attend


def _split_patch(patch: Mapping[str, tuple[Array, Array]], L: int) -> tuple[dict, dict]:
    """``patch`` split into what the scan over the layers slices (arrays with a layer axis of ``L``) and what
    every layer reads whole (a layer axis of 1, dropped): two ``{(name, 0 | 1): array}`` dicts."""
    sliced, whole = {}, {}
    for name, pair in patch.items():
        for j, a in enumerate(pair):
            if a.shape[0] == L:
                sliced[(name, j)] = a
            else:
                whole[(name, j)] = a[0]
    return sliced, whole


def _patch_rows(rows: Mapping[tuple[str, int], Array]) -> dict[str, tuple[Array, Array]]:
    return {name: (rows[(name, 0)], rows[(name, 1)]) for name, _ in rows if _ == 0}


def _scan_blocks(family: Family, config: Any, params: Any, x: Array, run: _Run, heads: Array,
                 capture: tuple[str, ...], patch: Mapping[str, tuple[Array, Array]], maps: bool
                 ) -> tuple[Array, Array | None, dict[str, Array]]:
    """Every block on the stream ``x [T, D]`` entering block 0, as ONE ``lax.scan`` over the stacked blocks:
    ``(x [T, D] leaving the last, weights [L, N, T, T] (None without maps), captured {name: [L, ...]})``.

    Differentiable in both modes like any scan: each layer's params get their own cotangent."""
    L = family.sizes(config).layers
    sliced, whole = _split_patch(patch, L)
    attend = _self_attention(family, config, run, maps)

    def body(x, xs):
        p, d, head, rows = xs
        sites = LayerSites(capture, _patch_rows({**whole, **rows}))
        x, w = _block(family, config, p, d, head, x, run.rot, attend, sites)
        kept = dict(sites.kept)
        if maps and "attn_weights" not in kept:
            kept["attn_weights"] = w
        return x, kept

    x, kept = jax.lax.scan(body, x, (family.blocks(params), layer_data(family, config), heads, sliced))
    weights = kept["attn_weights"] if maps else None
    return x, weights, {name: kept[name] for name in capture}


def _run(family: Family, config: Any, keep: Array, pos: Array, T: int, scale: Array) -> _Run:
    window = family.sizes(config).window  # a window every layer shares (Mistral's); per-layer ones in layer_data
    return _Run(_rotation(family, config, pos, T), _windowed(keep, pos, pos, window), pos, scale)


def _head(family: Family, config: Any, params: Any, x: Array, weights: Array | None, captured: dict) -> ModelOutput:
    h = family.final_norm(params, config, x)  # [T, D]
    return ModelOutput(logits=_unembed(family, config, params, h), last_hidden_state=h, attentions=weights,
                       captured=captured)


@functools.partial(jax.jit, static_argnames=("family", "config", "capture", "maps"))
def _forward(params, ids, keep, heads, scale, patch, *, family: Family, config, capture, maps=True) -> ModelOutput:
    T = ids.shape[0]
    pos = positions(keep)  # [T], real tokens counted from 0 (as Hugging Face's generate does for padding)
    x = _embed(family, config, params, ids, pos, keep)  # [T, D]
    run = _run(family, config, keep, pos, T, scale)
    x, weights, captured = _scan_blocks(family, config, params, x, run, heads, capture, patch, maps)
    return _head(family, config, params, x, weights, captured)


def _at(tree: Any, i: Array) -> Any:
    """Row ``i`` (traced) of every ``[L, ...]`` leaf."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


@functools.partial(jax.jit, static_argnames=("family", "config", "rows"))
def _resume(params, resid, layer, keep, pos, heads, scale, patch, weights, *, family: Family, config,
            rows: int) -> ModelOutput:
    """Blocks ``layer..L-1`` from the stream ``resid [T, D]`` entering block ``layer`` (a traced int32 scalar):
    the forward's block in a ``lax.fori_loop`` from ``layer``, each block's params read at its index, so one
    compiled block serves every start layer. ``rows``: the positions the rotation covers, ``[0, rows)``."""
    L = family.sizes(config).layers
    run = _Run(_rotation(family, config, pos, rows), _windowed(keep, pos, pos, family.sizes(config).window), pos, scale)
    stacked, data = family.blocks(params), layer_data(family, config)
    attend = _self_attention(family, config, run, maps=True)
    q0 = jax.eval_shape(lambda x: family.qkv(_at(stacked, 0), config, x, run.rot, _at(data, 0))[0], resid)
    weights = _sharding.maps_like(weights, q0)  # under Explicit mesh axes: split like the maps written into it

    def body(i, carry):
        x, weights = carry
        sites = LayerSites((), {name: tuple(a[0] if a.shape[0] == 1 else a[i] for a in pair)
                                for name, pair in patch.items()})
        x, w = _block(family, config, _at(stacked, i), _at(data, i), heads[i], x, run.rot, attend, sites)
        return x, weights.at[i].set(w.astype(weights.dtype))

    x, weights = jax.lax.fori_loop(layer, L, body, (resid, weights))
    return _head(family, config, params, x, weights, {})


def resume(family: Family, params: Any, config: Any, resid_pre: Any, layer: Any, *,
                    attention_mask: Any = None, positions: Any = None, head_mask: Any = None, scale: Any = None,
                    patch: Any = None, attentions: Any = None) -> ModelOutput:
    """``family``'s forward resumed at block ``layer`` (:data:`RESUME_DOC`; each model module's ``resume``)."""
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
    scale = check_scale(scale, s.scale_dim or s.head_dim)
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
    return _resume(params, x, at, keep, pos, heads, _float32(scale), patch, weights.astype(x.dtype),
                   family=family, config=config, rows=rows)


_WARNED_CLOSED_OVER = []  # a warning once per process


def warn_if_params_closed_over(params: Any, input_ids: Any, fn: str, *, call: str | None = None,
                               stacklevel: int = 4) -> None:
    """Warn, once, when ``fn`` is traced by ``jax.jit`` with its ids traced but its params concrete arrays:
    the caller's ``jit`` closed over the weights, which makes every weight a constant of the compiled
    program for XLA to fold (tens of seconds on a 135M model). Nothing is changed; only ``jit`` tracing
    counts (``vmap`` or ``grad`` over a closure compile nothing of the weights). ``call`` is the call the
    message suggests, with ``p`` for the params (default ``fn(p, config, ids)``); ``stacklevel`` is
    :func:`warnings.warn`'s, counted from this function (4: the caller of a model module's function)."""
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
            f"jax.jit(lambda p, ids: {call or f'{fn}(p, config, ids)'})(params, ids). (Shown once.)",
            stacklevel=stacklevel,
        )


def forward(family: Family, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
            head_mask: Any = None, scale: Any = None, return_attention_logits: bool = False,
            return_qkv: bool = False, return_hidden_states: bool = False, capture: Any = (),
            patch: Any = None) -> ModelOutput:
    """``family``'s forward pass on one sequence (:data:`FORWARD_DOC`; each model module's ``forward``)."""
    warn_if_params_closed_over(params, input_ids, f"{family.name}.forward")
    s = check_config(family, config)
    family.check_params(params, config)
    # concrete ids run at their bucket's length (a patch padded alike), the outputs cut back to T below
    input_ids, attention_mask, real = _bucketed(input_ids, attention_mask, s.max_length, s.vocab)
    ids = _ids(family, config, input_ids)
    T = ids.shape[0]
    keep = _keep(attention_mask, T)
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.scale_dim or s.head_dim)
    shapes = site_shapes(T=real or T, S=real or T, N=s.heads, K=s.kv_heads, H=s.head_dim, D=s.width)
    asked = check_capture(capture)
    flags = dict(want_logits=check_flag(return_attention_logits, "return_attention_logits"),
                 want_qkv=check_flag(return_qkv, "return_qkv"),
                 want_hidden=check_flag(return_hidden_states, "return_hidden_states"))
    patch = check_patch(patch, shapes, s.layers)  # against the real length: its errors name the real shapes
    if real is not None and patch:
        patch = _pad_patch(patch, real, T)
    out = _forward(params, ids, keep, heads, _float32(scale), patch,
                   family=family, config=config, capture=sugar_names(asked, **flags))
    if real is None:
        return with_sugar(out, asked, **flags)
    if _in_host_memory(out.logits) and _nbytes(out) <= HOST_CUT_BYTES:
        return _host_cut(out, asked, flags, real)
    return _cut(out, asked, tuple(sorted(flags.items())), real)


def _bucketed(input_ids: Any, attention_mask: Any, longest: int, vocab: int, *,
              short: int = 0) -> tuple[Any, Any, int | None]:
    """``(ids, mask, T)``: concrete ids ``[T]`` (and their mask) right-padded, on the host, to
    :func:`jaxattn.models.bucket_length`, the padding masked, so every length of a bucket runs one compiled
    program; ``T`` None when they run as they are: ``T <= short``, traced ids (the caller's ``jit`` fixes
    the shape), ids split over several devices, or anything the checks will refuse (ids outside
    ``[0, vocab)``, a mask of other values than 0 and 1 or without a real token: the checks then name what
    the caller passed)."""
    if isinstance(input_ids, jax.core.Tracer) or isinstance(attention_mask, jax.core.Tracer):
        return input_ids, attention_mask, None
    if any(isinstance(a, jax.Array) and len(a.sharding.device_set) > 1 for a in (input_ids, attention_mask)):
        return input_ids, attention_mask, None
    ids = _as_array(input_ids)
    if ids is None or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or not short < ids.shape[0] <= longest:
        return input_ids, attention_mask, None
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        return input_ids, attention_mask, None
    T = ids.shape[0]
    mask = np.ones(T, bool) if attention_mask is None else _as_array(attention_mask)
    if mask is None or mask.shape != (T,) or not (np.issubdtype(mask.dtype, np.integer) or mask.dtype == np.bool_):
        return input_ids, attention_mask, None
    if not np.all((mask == 0) | (mask == 1)) or not np.any(mask):
        return input_ids, attention_mask, None
    B = bucket_length(T, longest)
    if B == T:
        return input_ids, attention_mask, None
    pad = (0, B - T)
    return np.pad(ids, pad), np.pad(mask, pad), T


def _as_array(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array, or None where NumPy cannot make one array of it (a ragged list: the checks
    then name the argument)."""
    try:
        return np.asarray(x)
    except ValueError:
        return None


@functools.partial(jax.jit, static_argnames=("T", "B"))
def _pad_patch(patch: dict[str, tuple[Array, Array]], T: int, B: int) -> dict[str, tuple[Array, Array]]:
    """A checked patch of a ``T``-token input for the forward at bucket length ``B`` (:func:`pad_site`: no
    padded row or key is patched); one small program for the whole patch."""
    return {name: tuple(pad_site(name, a, T, B) for a in pair) for name, pair in patch.items()}


def _cut_outputs(out: ModelOutput, T: int, take: Callable[[Array, tuple], Array]) -> ModelOutput:
    """``out`` with every T and S axis cut to ``[:T]`` by ``take(array, index)``."""
    def cut(name: str, a: Array) -> Array:
        axes = CAPTURE_NAMES[name][0].split()
        return take(a, (slice(None),) + tuple(slice(0, T) if x in "TS" else slice(None) for x in axes))

    return out._replace(logits=take(out.logits, (slice(0, T),)), last_hidden_state=take(out.last_hidden_state, (slice(0, T),)),
                        attentions=None if out.attentions is None else take(out.attentions, (..., slice(0, T), slice(0, T))),
                        captured={name: cut(name, a) for name, a in out.captured.items()})


@functools.partial(jax.jit, static_argnames=("asked", "flags", "T"))
def _cut(out: ModelOutput, asked: tuple[str, ...], flags: tuple[tuple[str, bool], ...], T: int) -> ModelOutput:
    """A bucketed forward's outputs at the real length ``T`` off the host, or large: every T and S axis cut to
    ``[:T]`` (one small program per ``T``), then the sugar fields filled."""
    return with_sugar(_cut_outputs(out, T, lambda a, index: a[index]), asked, **dict(flags))


HOST_CUT_BYTES = 64 << 20  # outputs up to this size are cut on the host (CPU): a copy, faster than compiling a cut


def _nbytes(out: ModelOutput) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(out))


def _in_host_memory(a: Array) -> bool:
    """Whether ``a`` is a concrete array on CPU devices, whose memory the host reads in place (not a value
    traced by a caller's transformation, e.g. ``jit`` over the params with the ids concrete)."""
    return not isinstance(a, jax.core.Tracer) and all(d.platform == "cpu" for d in a.devices())


def _host_cut(out: ModelOutput, asked: tuple[str, ...], flags: dict[str, bool], T: int) -> ModelOutput:
    """:func:`_cut` for outputs in CPU memory, where the host reads them in place: each cut is a NumPy view
    put on the output's device (a copy, as the compiled cut makes), so a new length compiles nothing."""
    def take(a: Array, index: tuple) -> Array:
        return jax.device_put(np.asarray(a)[index], a.sharding)  # one copy (or none, for a leading cut)

    out = _cut_outputs(out, T, take)
    hidden = None
    if flags["want_hidden"]:  # [L + 1, T, D], as with_sugar builds it
        c = out.captured["resid_pre"]
        hidden = jax.device_put(np.concatenate([np.asarray(c), np.asarray(out.last_hidden_state)[None]]), c.sharding)
    return with_sugar(out, asked, **{**flags, "want_hidden": False})._replace(hidden_states=hidden)


def log_prob(family: Family, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
             start: Any = 0, end: Any = None, scale: Any = None) -> Array:
    """``family``'s log-probability of a span (:data:`LOG_PROB_DOC`; each model module's ``log_prob``)."""
    warn_if_params_closed_over(params, input_ids, f"{family.name}.log_prob")
    s = check_config(family, config)
    family.check_params(params, config)
    input_ids, attention_mask, real = _bucketed(input_ids, attention_mask, s.max_length, s.vocab)  # one program a bucket
    ids = _ids(family, config, input_ids)
    end = check_span(start, end, ids.shape[0] if real is None else real)
    keep = _keep(attention_mask, ids.shape[0])
    scale = jnp.asarray(check_scale(scale, s.scale_dim or s.head_dim), jnp.float32)
    return _log_prob(params, ids, keep, scale, start, end, family=family, config=config)


@functools.partial(jax.jit, static_argnames=("family", "config"))
def _log_prob(params, ids, keep, scale, start, end, *, family: Family, config) -> Array:
    """The span score as one compiled program: the forward without its maps (nothing of ``[L, N, T, T]``
    is allocated), then :func:`span_log_prob` on its logits."""
    s = family.sizes(config)
    heads = jnp.ones((s.layers, s.heads), jnp.float32)  # no head masked
    out = _forward(params, ids, keep, heads, scale, {}, family=family, config=config, capture=(), maps=False)
    return _sharding.auto(span_log_prob)(out.logits.astype(jnp.float32), ids, start, end, keep)


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


class _Cache(NamedTuple):
    """The key/value cache of generation. Full layers keep every slot: ``full_k, full_v [Lf, slots, K, H]``.
    Sliding-window layers keep a ring of their last keys, indexed by POSITION (``position % Wr``), so padding
    takes no room: ``ring_k, ring_v [Lw, Wr, K, H]`` and ``ring_pos [Wr]``, the position each entry holds
    (``-1``: empty), the same for every windowed layer. Absent parts are None."""

    full_k: Array | None
    full_v: Array | None
    ring_k: Array | None
    ring_v: Array | None
    ring_pos: Array | None


def _cache_plan(family: Family, config: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """``(windowed [L] bool, index [L] int32 into its part of the cache, Wr)``: which layers keep a ring (a
    layer-data window shorter than the longest input) and the ring's length, the longest such window
    (0 without one). Read from the family's NumPy layer data: concrete, so the plan is static."""
    L, longest = family.sizes(config).layers, family.sizes(config).max_length
    window = family.layer_data(config).get("window")
    windowed = np.zeros(L, bool) if window is None else np.asarray(window) < longest
    index = np.zeros(L, np.int32)
    for part in (windowed, ~windowed):
        index[part] = np.arange(int(part.sum()), dtype=np.int32)
    return windowed, index, int(np.max(np.asarray(window)[windowed])) if windowed.any() else 0


def _ring_write(ring_pos: Array, rows_pos: Array, write: Array) -> tuple[Array, Array]:
    """``(ring index [R] of each row, -1 for a row not written, ring_pos after the write)``: the rows ``write``
    marks go to ``position % Wr``; when two of them share an index (a prompt longer than the ring), only the
    later position is written, so no write's order matters."""
    Wr = ring_pos.shape[0]
    last = jnp.max(jnp.where(write, rows_pos, -1))
    keep = write & (rows_pos > last - Wr)  # [R]: the last Wr positions written
    at = jnp.where(keep, rows_pos % Wr, -1)  # [R]
    return at, ring_pos.at[jnp.where(keep, at, Wr)].set(rows_pos, mode="drop")


def _cache_blocks(family: Family, config: Any, params: Any, x: Array, rot: Any, rows_pos: Array, key_pos: Array,
                  seen: Array, own: Array, at: Array, write: Array, cache: _Cache, scale: Array, heads: Array
                  ) -> tuple[Array, _Cache]:
    """Every block on rows ``x [R, D]`` (positions ``rows_pos [R]``) that go to cache slots ``at..at+R-1``, as
    one ``lax.scan`` over the layers running the forward's block with the cache's attention: each layer
    attends, through :func:`jaxattn.multi_head_attention`, to its cached keys and values that ``seen [S]``
    keeps (key positions ``key_pos [S]``) or, for a windowed layer, to its ring's entries within the window,
    and, causally, to the rows' own (``own [R]`` keeps the real ones), each within the layer's window; then
    writes the rows' own into its part of the cache (a ring takes the rows ``write [R]`` marks)."""
    windowed, index, _ = _cache_plan(family, config)
    S = None if cache.full_k is None else cache.full_k.shape[1]
    Wr = None if cache.ring_k is None else cache.ring_k.shape[1]  # the window, or every slot when fewer

    def body(x, xs):
        p, d, head, is_ring, i = xs

        def attend(q, k, v, d, sites):
            window, cap = d.get("window"), d.get("logit_cap")
            own_w = _windowed(own, rows_pos, rows_pos, window)  # [R] or [R, R]

            def full(_):
                keys, values = (jnp.concatenate([a[i].astype(q.dtype), b]) for a, b in ((cache.full_k, k), (cache.full_v, v)))
                mask = _windowed(seen, rows_pos, key_pos, window)
                mask = jnp.concatenate([jnp.broadcast_to(mask, own_w.shape[:-1] + mask.shape[-1:]), own_w], axis=-1)
                return _attend(q, keys, values, mask, scale, S, cap)[0]  # [R, N, H]

            def ring(_):
                keys, values = (jnp.concatenate([a[i].astype(q.dtype), b]) for a, b in ((cache.ring_k, k), (cache.ring_v, v)))
                held = (cache.ring_pos >= 0)[None, :] & (rows_pos[:, None] - cache.ring_pos[None, :] < window)  # [R, Wr]
                mask = jnp.concatenate([held, jnp.broadcast_to(own_w, held.shape[:1] + own_w.shape[-1:])], axis=-1)
                return _attend(q, keys, values, mask, scale, Wr, cap)[0]  # [R, N, H]

            if cache.ring_k is None:
                z = full(None)
            elif cache.full_k is None:
                z = ring(None)
            else:
                z = jax.lax.cond(is_ring, ring, full, None)
            return z, (k, v)  # the rows' own keys and values, written after the scan

        return _block(family, config, p, d, head, x, rot, attend, LayerSites((), {}))

    xs = (family.blocks(params), layer_data(family, config), heads, jnp.asarray(windowed), jnp.asarray(index))
    # the layers only read the cache; their rows' keys and values go in after the scan, one update per cache
    # array (XLA copies a cache carried through the scan and updated in it whole, in every layer)
    x, (ks, vs) = jax.lax.scan(body, x, xs)  # [R, D], [L, R, K, H] twice
    kinds = {"full": np.flatnonzero(~windowed), "ring": np.flatnonzero(windowed)}  # each cache's layers
    new = {n: {kind: a if len(layers) == len(windowed) else a[layers] for kind, layers in kinds.items()}
           for n, a in (("k", ks), ("v", vs))}
    if cache.full_k is not None:  # every row into slots at..at+R-1
        cache = cache._replace(**{f"full_{n}": jax.lax.dynamic_update_slice(
            getattr(cache, f"full_{n}"), new[n]["full"].astype(cache.full_k.dtype), (0, at, 0, 0)) for n in "kv"})
    if cache.ring_pos is not None:  # the rows ``write`` marks, each at its position in the ring
        ring_at, ring_pos = _ring_write(cache.ring_pos, rows_pos, write)
        slot = jnp.where(ring_at >= 0, ring_at, Wr)
        cache = cache._replace(ring_pos=ring_pos, **{f"ring_{n}": getattr(cache, f"ring_{n}").at[:, slot].set(
            new[n]["ring"].astype(cache.ring_k.dtype), mode="drop") for n in "kv"})
    return x, cache


@functools.partial(jax.jit, static_argnames=("family", "config", "max_new_tokens", "greedy", "return_logits"))
def _generate(params, prompt, keep, heads, scale, temperature, key, *, family: Family, config, max_new_tokens,
              greedy, return_logits):
    """ONE compiled step of ``R`` rows reads each new token into the next cache slot (a ``lax.scan``), its
    ``R - 1`` other rows repeating it; its rows attend to the cache before the token's slot and causally
    to their own keys, so what a step writes after its token is never seen (the next token's step writes
    over it first). A sliding-window layer keeps only a ring of its last keys (:class:`_Cache`), written
    with the token's row alone. A prompt of at most ``PROMPT_ROWS`` tokens is read by that same step (``R = T``, the
    scan's first step), so generation compiles one block; a longer one in one pass of the forward's loop
    (``R = 1``), which costs a second compiled block and saves reading the prompt a few rows a step.
    Every step unembeds its rows and picks from one, the last real prompt token's or the new token's."""
    s = family.sizes(config)
    T, new = prompt.shape[0], max_new_tokens
    short = T <= PROMPT_ROWS
    R = T if short else 1  # rows a step reads
    slots = T + new + R - 2  # the prompt, new tokens but the last, the last step's other rows
    pos = positions(keep)  # [T]
    real = jnp.sum(keep).astype(jnp.int32)  # the first new token's position
    key_pos = jnp.concatenate([pos, real + jnp.arange(slots - T, dtype=jnp.int32)])  # [slots]
    key_keep = jnp.concatenate([keep, jnp.ones((slots - T,), bool)])  # [slots]: new tokens are real
    last = jnp.max(jnp.where(keep, jnp.arange(T), -1))  # the last real token: it predicts the first new one
    keys = None if greedy else jax.random.split(key, new)
    run = _run(family, config, keep, pos, T, scale)
    k0 = jax.eval_shape(lambda: family.qkv(_at(family.blocks(params), 0), config,
                                           _embed(family, config, params, prompt, pos, keep), run.rot,
                                           _at(layer_data(family, config), 0))[1])  # [T, K, H]
    windowed, _, Wr = _cache_plan(family, config)
    Wr = min(Wr, slots)
    full, ring = np.flatnonzero(~windowed), np.flatnonzero(windowed)  # which layers keep every slot, which a ring
    zeros = lambda n, length: None if n == 0 else _sharding.zeros((n, length, s.kv_heads, s.head_dim), k0.dtype, k0)  # noqa: E731
    cache = _Cache(zeros(len(full), slots), zeros(len(full), slots), zeros(len(ring), Wr), zeros(len(ring), Wr),
                   None if len(ring) == 0 else jnp.full((Wr,), -1, jnp.int32))  # split like k

    def step(carry, k):  # feeds new token k - 1 (or, when short, the prompt at k = 0) and picks token k
        cache, token = carry
        reading = (k == 0) if short else False  # the step that reads the prompt
        at = jnp.where(reading, 0, T + k - 1)  # the first slot the step writes
        ids = jnp.where(reading, prompt, token) if short else token[None]  # [R]
        rows_pos = jnp.where(reading, pos, real + k - 1) if short else (real + k - 1)[None]  # [R]
        seen = key_keep & (jnp.arange(slots) < at)  # [slots]: the real tokens before the step
        own = jnp.where(reading, keep, True) if short else jnp.ones((1,), bool)  # [R]
        write = jnp.where(reading, keep, jnp.arange(R) == 0) if short else own  # [R]: the real rows, into a ring
        seen = _windowed(seen, rows_pos, key_pos, s.window)  # [slots], or [R, slots] under a shared window
        own = _windowed(own, rows_pos, rows_pos, s.window)  # [R] or [R, R]
        h = _embed(family, config, params, ids, rows_pos, write)  # [R, D]
        rot = _rotation(family, config, rows_pos, slots)
        h, cache = _cache_blocks(family, config, params, h, rot, rows_pos, key_pos, seen, own, at, write, cache,
                                 scale, heads)  # [R, D]
        h = h[jnp.where(reading, last, 0)] if short else h[0]  # [D]: the row that predicts the next token
        logits = _unembed(family, config, params, family.final_norm(params, config, h[None]))[0]  # [V]
        picked = _pick(logits, None if greedy else keys[k], temperature, greedy)
        return (cache, picked), (picked, logits if return_logits else None)

    if short:  # the scan's first step reads the prompt
        first, steps = prompt[0], jnp.arange(new)  # prompt[0]: a placeholder, never read
    else:  # the prompt in one pass of the forward's loop: its keys and values fill the cache's first T slots
        x = _embed(family, config, params, prompt, pos, keep)  # [T, D]
        x, _, kept = _scan_blocks(family, config, params, x, run, heads, ("k", "v"), {}, maps=False)  # [T, D]
        if len(full):  # full layers: every prompt row in the first T slots
            cache = cache._replace(**{f"full_{n}": jax.lax.dynamic_update_slice(
                getattr(cache, f"full_{n}"), kept[n][full].astype(k0.dtype), (0, 0, 0, 0)) for n in "kv"})
        if len(ring):  # windowed layers: the last Wr real rows, each at its position in the ring
            at, ring_pos = _ring_write(cache.ring_pos, pos, keep)
            at = jnp.where(at >= 0, at, Wr)
            cache = cache._replace(ring_pos=ring_pos, **{f"ring_{n}": getattr(cache, f"ring_{n}").at[:, at].set(
                kept[n][ring].astype(k0.dtype), mode="drop") for n in "kv"})
        logits0 = _unembed(family, config, params, family.final_norm(params, config, x[last]))  # [V]
        first, steps = _pick(logits0, None if greedy else keys[0], temperature, greedy), jnp.arange(1, new)
    _, (picked, logits) = jax.lax.scan(step, (cache, first), steps)
    if not short:
        picked = jnp.concatenate([first[None], picked])  # [new]
        logits = jnp.concatenate([logits0[None], logits]) if return_logits else None  # [new, V]
    ids = jnp.concatenate([prompt, picked])  # [T + new]
    return (ids, logits) if return_logits else ids


def generate(family: Family, params: Any, config: Any, prompt_ids: Any, *, max_new_tokens: Any,
             attention_mask: Any = None, head_mask: Any = None, temperature: Any = 0.0, key: Any = None,
             scale: Any = None, return_logits: bool = False) -> Any:
    """``family``'s continuation of a prompt (:data:`GENERATE_DOC`; each model module's ``generate``)."""
    s = check_config(family, config)
    family.check_params(params, config)
    new = check_int(max_new_tokens, "max_new_tokens")
    return_logits = check_flag(return_logits, "return_logits")
    prompt = prompt_ids
    # a concrete prompt longer than PROMPT_ROWS runs at its bucket's length (padded on the right, masked), so
    # a new prompt length inside a bucket compiles nothing; the padding is taken out of the ids returned. A
    # shorter one runs as it is: every step carries its rows, so padding them would cost every step.
    prompt_ids, attention_mask, real = _bucketed(prompt_ids, attention_mask, s.max_length - new, s.vocab,
                                                 short=PROMPT_ROWS)
    ids = _ids(family, config, prompt_ids, "prompt_ids")
    if ids.shape[0] + new > s.max_length:  # a bucket never passes it: it is at most max_length - new
        raise ValueError(f"prompt_ids T={ids.shape[0]} plus max_new_tokens={new} exceeds "
                         f"{family.max_name}={s.max_length}")
    keep = _keep(attention_mask, ids.shape[0])
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.scale_dim or s.head_dim)
    greedy, key = sampling(temperature, key)
    out = _generate(params, ids, keep, heads, _float32(scale),
                    _float32(0.0 if greedy else temperature), None if greedy else key, family=family,
                    config=config, max_new_tokens=new, greedy=greedy, return_logits=return_logits)
    if real is None:
        return out
    padded = out[0] if return_logits else out  # [bucket + new]: the prompt, its padding, the new tokens
    if isinstance(padded, jax.core.Tracer):  # params traced by a caller's transformation: part of its program
        joined = jnp.concatenate([jnp.asarray(prompt, padded.dtype), padded[ids.shape[0]:]])
    else:  # a few ints, put together on the host (nothing compiled)
        picked = np.asarray(padded)[ids.shape[0]:]
        joined = jax.device_put(np.concatenate([np.asarray(prompt).astype(picked.dtype), picked]), padded.sharding)
    return (joined, out[1]) if return_logits else joined


# ----------------------------------------------------------------------------------------------------
# The docstrings every family's forward, log_prob, generate and resume share (:func:`document`).
# ----------------------------------------------------------------------------------------------------

FORWARD_DOC = """{title} forward pass on one sequence, with every layer's attention map (jit-compiled).

    {formula} The maps returned are the weights that produced the output.

    A pure function of its array arguments: ``jax.grad`` with respect to ``params`` (or ``head_mask``,
    ``scale``, a patch value), ``jax.jit`` with params as an argument, and ``jax.vmap`` over stacked
    params or over a batch of sequences all work. Only static shapes are checked here; :func:`load` and
    :func:`check_params` check a checkpoint's structure.

    The blocks run as ONE compiled block in a ``lax.scan`` over the blocks' params, stacked ``[L, ...]``,
    so the first call compiles one block whatever the depth; derivatives (``jax.grad``, ``jax.jvp``) are
    the scan's own, each layer's params getting their own cotangent.

    Concrete ids (NumPy, a list, a one-device array) run at their bucket's length,
    :func:`jaxattn.models.bucket_length` (T right-padded under the mask, at most 7 tokens or an eighth of
    T), and the outputs come back cut to the T real rows: a new prompt length inside a bucket compiles no
    new forward (on CPU, outputs up to ``HOST_CUT_BYTES`` are cut on the host and compile nothing; larger
    ones, or on an accelerator, a small program per length cuts them). The rows are those of the prompt alone (the
    pads come after them, masked as keys). Ids traced by a caller's ``jit`` or ``vmap`` run at their own
    length (the caller's program fixes the shape).

    Args:
      params: the params pytree (the module docstring's layout), e.g. from :func:`load`.
      config: the model's :class:`{config}`.
      input_ids: integer token ids ``[T]``, ``1 <= T <= {max_name}``. A batch is ``jax.vmap`` of this.
        An id outside ``[0, vocab_size)`` raises ``ValueError`` when the ids are concrete; under
        ``jit``/``vmap`` (traced ids) a real position's embedding is NaN, so its logits and those of every
        later position are NaN (never another token's); at a padded position it is never read (id 0 is
        embedded there), so a pad id out of range keeps the real positions and every gradient finite.
      attention_mask: ``[T]``, 1 (or True) for a real token, 0 for padding; ``None``: all real; a concrete
        mask with no real token is refused. Padded keys get weight 0 and positions count real tokens
        only (as Hugging Face's ``generate``), so a left- or right-padded sequence gives at its real
        positions the logits and maps of the sequence alone. Rows at padded positions mean nothing.
      head_mask: ``[L, N]`` (query heads), Hugging Face's meaning: each head's output ``z`` is multiplied
        by its entry before the output projection (0 ablates the head, 1 keeps it; any float,
        differentiable). ``None``: ones.
      scale: the attention logit scale; ``None`` is the value the model was trained with: ``1/sqrt(H)``,
        or ``query_pre_attn_scalar ** -0.5`` where the config has one (Gemma 2 and 3).
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

LOG_PROB_DOC = """``Σ_{{start <= t < end}} log p(ids[t] | ids[:t])`` over real tokens: the log-probability of a span.

    Token ``t`` is scored from the logits of the last real token before it, so a padded sequence scores
    as the sequence alone: the first real token has no prediction and never counts, nor do padded
    positions. ``start`` and ``end`` index the PADDED array (under left padding by ``p`` tokens, position
    ``t`` of the sequence alone is ``t + p``; :func:`jaxattn.models.left_pad` pads a batch) and may be
    traced (``jit``/``vmap`` over spans and batches); concrete values must satisfy
    ``0 <= start <= end <= T``. Concrete ids run at their bucket's length as in :func:`forward`; the
    score is a scalar, so a new length inside a bucket compiles nothing.

    Args:
      input_ids: ``[T]``, e.g. a prefix followed by the continuation that starts at token ``start``.
      attention_mask: ``[T]``, as in :func:`forward`.
      start, end: the span ``[start, end)`` of positions scored; ``end=None`` is ``T``.
      scale: as in :func:`forward`.

    Returns:
      a float32 scalar (nats).
    """

GENERATE_DOC = """Continue ``prompt_ids`` by ``max_new_tokens`` tokens with a key/value cache; returns ``[T + new]``.

    The cache (every layer's keys, after any rotation, and values: ``[L, slots, K, H]``) is preallocated,
    and ONE compiled step (a ``lax.scan``) reads each new token, attending to the cache and to itself
    through :func:`jaxattn.multi_head_attention`, the layers run by the forward's own block (one compiled
    block in a scan over the layers, the attention reading and writing the cache). A prompt of at most 8 tokens is read by that same step, so generation compiles one
    block whatever the depth; a longer one in one pass of the forward's loop (a second compiled block).
    Greedy (``temperature=0``) output is the argmax of the full :func:`forward` at every step. The first
    new token is predicted from the last REAL prompt token, so a left- or right-padded prompt continues
    as the prompt alone (the new tokens come after the whole padded array); a batch of prompts is
    ``jax.vmap`` of this over padded prompts with their ``attention_mask``.

    A concrete prompt of more than 8 tokens runs at its bucket's length, :func:`jaxattn.models.bucket_length`
    (right-padded under the mask, as in :func:`forward`; the padding taken out of the ids returned, on the
    host): a new prompt length inside a bucket compiles nothing new. A prompt of at most 8 tokens, and ids
    traced by a caller's ``jit``, run at their own length (every step carries a short prompt's rows, so
    padding them would cost every step).

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


RESUME_DOC = """{title} forward resumed at block ``layer`` from the residual stream entering it (jit-compiled).

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
        in the dtype :func:`forward` carries it (the params'); another dtype is refused (``TypeError``),
        after JAX's own conversion of the input (without 64-bit JAX a NumPy float64 array is float32).
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


def document(fn: Callable, doc: str, family: Family, **fields: str) -> Callable:
    """``fn`` (a model module's own ``forward``, ``log_prob``, ``generate`` or ``resume``) with ``doc`` (one of
    :data:`FORWARD_DOC`, ...) filled in with ``fields`` and the family's ``max_name``, as its docstring."""
    fn.__doc__ = doc.format(max_name=family.max_name, **fields)
    return fn
