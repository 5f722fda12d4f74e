"""Captured tensors and patches: the named sites every bundled model's forward passes its tensors through.

A forward calls ``sites(name, layer, x)`` where it makes a tensor. That returns ``x``, or the patched
value where a patch asks for one, and keeps ``x`` when the name was requested in ``capture``. There are
no hooks and no state that outlives one call: the patch is an argument of the (pure) forward, and the
captured tensors come back in its output, stacked over layers.

Axis alphabet: L layers, T queries, S keys (S = T for self-attention), N query heads, K key/value heads
(K = N without grouped-query attention), H head dim, D model width.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _sharding

Array = jax.Array

# Stable names, the per-layer shape (stacked over layers as [L, ...]) and what each holds.
CAPTURE_NAMES: dict[str, tuple[str, str]] = {
    "resid_pre": ("T D", "the residual stream entering the block"),
    "q": ("T N H", "queries after the projection (and after RoPE where the model has it)"),
    "k": ("T K H", "keys after the projection (and after RoPE where the model has it)"),
    "v": ("T K H", "values after the projection"),
    "attn_logits": ("N T S", "scale · q kᵀ (+ bias), soft-capped where the model caps: the softmax's input, before the masks"),
    "attn_weights": ("N T S", "the softmax weights (the same array as the output's attentions)"),
    "z": ("T N H", "each head's output, before head_mask and the output projection"),
    "attn_out": ("T D", "the attention sublayer's contribution to the residual stream"),
    "resid_mid": ("T D", "the residual stream after attention, before the MLP"),
    "mlp_out": ("T D", "the MLP's contribution to the residual stream"),
    "resid_post": ("T D", "the residual stream leaving the block"),
}

# attn_logits is read only: the weights are what the rest of the block consumes, so patch those.
PATCHABLE = tuple(name for name in CAPTURE_NAMES if name != "attn_logits")


def pad_site(name: str, a: Any, T: int, B: int, xp: Any = jnp) -> Any:
    """A patch value or ``where`` ``[L, ...]`` of ``name`` for ``T`` tokens, at length ``B``: each T and S axis
    of length ``T`` padded with zeros (False). A key (S) axis of 1 is broadcast to ``T`` first, so that no
    padded key is patched with a weight; a query (T) axis of 1 broadcasts as it did (over padded rows too,
    which no real row reads). ``xp``: ``jnp``, or ``np`` for a concrete array padded on the host."""
    axes = ["L", *CAPTURE_NAMES[name][0].split()]
    if "S" in axes and a.shape[axes.index("S")] == 1:
        a = xp.broadcast_to(a, tuple(T if x == "S" else n for x, n in zip(axes, a.shape)))
    return xp.pad(a, [(0, B - T) if x in "TS" and n == T else (0, 0) for x, n in zip(axes, a.shape)])


def site_shapes(*, T: int, S: int, N: int, K: int, H: int, D: int) -> dict[str, tuple[int, ...]]:
    """Each name's per-layer shape for a model with these sizes."""
    sizes = {"T": T, "S": S, "N": N, "K": K, "H": H, "D": D}
    return {name: tuple(sizes[a] for a in axes.split()) for name, (axes, _) in CAPTURE_NAMES.items()}


def check_capture(capture: Any) -> tuple[str, ...]:
    """``capture`` as a sorted tuple of known names (a static argument of the compiled forward)."""
    if isinstance(capture, str):
        capture = (capture,)
    try:
        names = tuple(capture)
    except TypeError:
        raise TypeError(f"capture must be a sequence of names, received {type(capture).__name__}") from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"capture must be a sequence of names (str), received an entry {name!r} of type "
                            f"{type(name).__name__}")
        if name not in CAPTURE_NAMES:
            raise ValueError(f"capture: unknown name {name!r}; the names are {', '.join(CAPTURE_NAMES)}")
    return tuple(sorted(set(names)))


def _broadcastable(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    return len(shape) == len(full) and all(a in (1, b) for a, b in zip(shape, full))


def check_patch(patch: Any, shapes: Mapping[str, tuple[int, ...]], L: int) -> dict[str, tuple[Array, Array]]:
    """``patch`` as ``{name: (value, where)}``, each checked against ``[L, *shapes[name]]``.

    ``value`` and ``where`` may have size 1 along any axis (broadcast), but not fewer axes: the layer
    axis always comes first. ``where`` is boolean: True takes ``value``, False keeps the computed tensor.
    """
    if patch is None:
        return {}
    if not isinstance(patch, Mapping):
        raise TypeError(f"patch must be a dict {{name: (value, where)}}, received {type(patch).__name__}")
    out = {}
    for name, entry in patch.items():
        if name not in PATCHABLE:
            hint = " (patch attn_weights instead)" if name == "attn_logits" else ""
            raise ValueError(f"patch: {name!r} cannot be patched{hint}; the names are {', '.join(PATCHABLE)}")
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(f"patch[{name!r}] must be a pair (value, where), received {type(entry).__name__}")
        value, where = entry
        full = (L,) + tuple(shapes[name])
        value_dtype = getattr(value, "dtype", None) or np.asarray(value).dtype
        if not jnp.issubdtype(value_dtype, jnp.floating):
            raise TypeError(f"patch[{name!r}] value must be a float array, received dtype {np.dtype(value_dtype).name}")
        if not _broadcastable(tuple(jnp.shape(value)), full):
            raise ValueError(f"patch[{name!r}] value must have shape {full} (or 1 along an axis), received {tuple(jnp.shape(value))}")
        where_dtype = getattr(where, "dtype", None) or np.asarray(where).dtype
        if where_dtype != np.bool_:
            raise TypeError(f"patch[{name!r}] where must be boolean (True = use the value), received dtype {np.dtype(where_dtype).name}")
        if not _broadcastable(tuple(jnp.shape(where)), full):
            raise ValueError(f"patch[{name!r}] where must have shape {full} (or 1 along an axis), received {tuple(jnp.shape(where))}")
        out[name] = (jnp.asarray(value), jnp.asarray(where))
    return out


class Sites:
    """One forward's sites: applies ``patch`` and keeps the ``capture``d tensors (used inside one trace).

    Each captured tensor is written into row ``layer`` of an ``[L, ...]`` buffer (``kept``; zeros made at
    its first write, shaped and split like the tensor), so a block run inside a loop over the layers, with
    ``layer`` a traced index, captures and patches as an unrolled one does: the loop carries ``kept``.
    A patch ``(value, where)`` is read at row ``layer`` (row 0 when its layer axis has size 1).
    """

    def __init__(self, capture: tuple[str, ...], patch: Mapping[str, tuple[Array, Array]], layers: int,
                 kept: Mapping[str, Array] | None = None):
        self.capture = capture
        self.patch = dict(patch)
        self.layers = layers
        self.kept: dict[str, Array] = dict(kept or {})

    def __call__(self, name: str, layer: Any, x: Array) -> Array:
        if name in self.patch:
            value, where = self.patch[name]
            x = jnp.where(_row(where, layer), _row(value, layer).astype(x.dtype), x)
        if name in self.capture:
            kept = self.kept.get(name)
            if kept is None:
                kept = _sharding.zeros((self.layers, *x.shape), x.dtype, x)  # [L, ...]
            self.kept[name] = kept.at[layer].set(x)
        return x

    def patches(self, name: str) -> bool:
        """Whether ``name`` is patched (the forward recomputes what depends on it only then)."""
        return name in self.patch

    def remix(self, layer: Any, weights: Array, v: Array, z: Array, mask: Array, *, causal: bool) -> Array:
        """:func:`remix` with this layer's row of the ``attn_weights`` patch (``z`` itself without one)."""
        if "attn_weights" not in self.patch:
            return z
        return remix(_row(self.patch["attn_weights"][1], layer), weights, v, z, mask, causal=causal)

    def captured(self) -> dict[str, Array]:
        """The requested tensors, each ``[L, ...]`` over layers."""
        return {name: self.kept[name] for name in self.capture}


class LayerSites:
    """One block's sites inside a loop over the layers: this layer's rows of the patch, and the captured
    tensors of this layer (``kept``), which the loop stacks into ``[L, ...]`` (a ``lax.scan``'s outputs).

    ``patch`` is ``{name: (value, where)}`` with this layer's rows (no layer axis).
    """

    def __init__(self, capture: tuple[str, ...], patch: Mapping[str, tuple[Array, Array]]):
        self.capture = capture
        self.patch = dict(patch)
        self.kept: dict[str, Array] = {}

    def __call__(self, name: str, x: Array) -> Array:
        if name in self.patch:
            value, where = self.patch[name]
            x = jnp.where(where, value.astype(x.dtype), x)
        if name in self.capture:
            self.kept[name] = x
        return x

    def remix(self, weights: Array, v: Array, z: Array, mask: Array, *, causal: bool) -> Array:
        """:func:`remix` with this layer's ``attn_weights`` patch (``z`` itself without one)."""
        if "attn_weights" not in self.patch:
            return z
        return remix(self.patch["attn_weights"][1], weights, v, z, mask, causal=causal)


def remix(where: Array, weights: Array, v: Array, z: Array, mask: Array, *, causal: bool) -> Array:
    """``z [T, N, H]`` after a patched ``attn_weights`` site: each (query, head) row whose weights the patch
    takes (``where``, broadcastable to ``[N, T, S]``, True at any key of the row) remade from ``weights
    [N, T, S]`` and ``v [S, K, H]`` (:func:`mix`); every other row is ``z``, attention's own output,
    untouched, so a layer or a row the patch leaves alone computes exactly as without it.

    ``mask`` (broadcastable to ``[T, S]``) and ``causal`` say which keys each query attends: as in
    attention itself, a key it does not attend contributes nothing whatever its value (unless the
    patch gives it a nonzero weight).
    """
    N, T, S = weights.shape
    where = jnp.broadcast_to(where, (N, T, S))  # [N, T, S]
    kept = jnp.broadcast_to(mask, (T, S))  # [T, S]
    if causal:
        kept = kept & jnp.tril(jnp.ones((T, S), bool))  # query t sees keys s <= t (S = T)
    remade = mix(weights, v, kept)  # [T, N, H]
    rows = jnp.any(where, axis=-1).T[:, :, None]  # [T, N, 1]
    return jnp.where(rows, remade.astype(z.dtype), z)  # [T, N, H]


def _row(a: Array, layer: Any) -> Array:
    """Row ``layer`` of a patch's ``[L or 1, ...]`` value or where (an int or a traced index)."""
    return a[0] if a.shape[0] == 1 else a[layer]


def mix(weights: Array, v: Array, kept: Array) -> Array:
    """``z[t, n] = Σ_s weights[n, t, s] v[s, n // (N/K)]``: ``[N, T, S]``, ``[S, K, H]`` -> ``[T, N, H]``.

    Used only when the attention weights are patched, to apply the patched weights to the values.
    ``kept [T, S]`` says which keys each query attends. As in attention itself
    (``jaxattn._attention._weighted_sum``), a key contributes nothing when the query does not attend it
    and its weight is 0, whatever its value: ``0 · NaN`` at a padded key is not NaN. An attended key (or
    one given a nonzero weight) whose value is NaN or Inf makes the row's entry NaN; so do NaN weights.
    """
    N, T, S = weights.shape
    K, H = v.shape[1], v.shape[-1]
    w = weights.reshape(K, N // K, T, S).astype(jnp.float32)  # [K, G, T, S]
    v32 = v.astype(jnp.float32)  # [S, K, H]
    bad = ~jnp.isfinite(v32)  # [S, K, H]
    counts = (kept[None, None] | (w != 0)).astype(jnp.float32)  # [K, G, T, S]: the keys that contribute
    z = jnp.einsum("kgts,skh->tkgh", w, jnp.where(bad, 0.0, v32))  # [T, K, G, H]
    hit = jnp.einsum("kgts,skh->tkgh", counts, bad.astype(jnp.float32)) > 0  # [T, K, G, H]
    z = jnp.where(hit, jnp.nan, z)  # [T, K, G, H]
    return z.reshape(T, N, H).astype(v.dtype)  # [T, N, H]


def with_sugar(out: Any, asked: tuple[str, ...], *, want_logits: bool, want_qkv: bool,
               want_hidden: bool) -> Any:
    """Fill the sugar fields of ``out`` from its captured tensors, keeping in ``captured`` only ``asked``."""
    c = out.captured
    hidden = None
    if want_hidden:
        hidden = jnp.concatenate([c["resid_pre"], out.last_hidden_state[None]])  # [L + 1, T, D]
    return out._replace(
        captured={name: c[name] for name in asked},
        attention_logits=c["attn_logits"] if want_logits else None,
        q=c["q"] if want_qkv else None,
        k=c["k"] if want_qkv else None,
        v=c["v"] if want_qkv else None,
        hidden_states=hidden,
    )


def sugar_names(capture: tuple[str, ...], *, want_logits: bool, want_qkv: bool, want_hidden: bool) -> tuple[str, ...]:
    """The names a forward must capture for ``capture`` plus the sugar flags (sorted, a static argument)."""
    names = set(capture)
    if want_logits:
        names.add("attn_logits")
    if want_qkv:
        names.update(("q", "k", "v"))
    if want_hidden:
        names.add("resid_pre")
    return tuple(sorted(names))
