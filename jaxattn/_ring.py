"""Attention over many devices: heads/batch split across devices, and ring attention over the sequence.

Two ways to spread attention over a device mesh, from the easy to the necessary:

1. **Batch and heads** (no communication at all: examples and heads are independent). Either place the
   inputs with a ``jax.sharding.NamedSharding`` and call the ordinary functions under ``jax.jit`` (XLA's
   partitioner propagates the sharding), or use :func:`sharded_attention`, a ``shard_map`` that runs the
   per-device function on each device's own examples and heads, so nothing is ever gathered::

     mesh = jax.make_mesh((2, 2), ("batch", "heads"))                       # Explicit axes
     spec = jax.sharding.PartitionSpec("batch", None, "heads", None)         # [B, T, N, H]
     q, k, v = (jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in (q, k, v))
     with jax.set_mesh(mesh):
         out = jax.jit(jax.vmap(lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v)[0]))(q, k, v)
     out, lse = jaxattn.sharded_attention(q, k, v, mesh=mesh, batch_axis="batch", head_axis="heads")

   With an Explicit mesh (``jax.make_mesh``'s default) call under ``jax.set_mesh``; the blockwise
   functions then see that the head axis is split and vmap the heads, so each device keeps its own. With
   an Auto mesh (``jax.sharding.Mesh(devices, names)``) XLA's partitioner decides, and may gather the
   heads. The ``shard_map`` functions here need their inputs already placed as their specs say
   (``jax.device_put`` with a ``NamedSharding``), as ``shard_map`` itself does on an Explicit mesh.

2. **The sequence** (:func:`ring_attention`), for one sequence too long for one device's memory
   (Liu, Zaharia & Abbeel 2023, "Ring attention with blockwise transformers"). Device ``d`` of the ring
   keeps its chunk of queries; the key/value chunks travel round the ring with ``lax.ppermute``, one hop
   per step, and after P steps every query chunk has met every key chunk. Each step is a
   :func:`jaxattn.blockwise_attention` (O(chunk) memory), and the partial results are merged exactly
   through their row log-sum-exps: ``lse = log Σ_t exp(lse_t)``, ``out = Σ_t exp(lse_t - lse) out_t``.
   With ``is_causal`` a step whose key chunk lies wholly after the query chunk is skipped, and with a
   sliding window (``local_window_size``) every step whose key chunk lies wholly outside every query's
   window; a chunk wholly inside runs without a mask, one across the window's edge with the window moved
   to its own coordinates (a static program per distance between the chunks). The gradient
   (a ``custom_vjp``) goes round the ring a second time: the key/value chunks travel again, now with their
   gradient accumulators ``dk, dv``, and each step is :func:`jaxattn.blockwise_attention`'s backward
   against the global ``out`` and ``lse``; nothing but each device's own chunks is saved between the two.
   :func:`ring_attention` is a ``shard_map`` of the per-device :func:`ring_attention_shard`, which runs
   inside the caller's own ``shard_map`` (a mesh with more axes, a larger per-device program).

Axis alphabet as in :mod:`jaxattn._attention` (B batch, T, S, N, K, H, V).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxattn._blockwise import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    _multi_head_blockwise,
    _multi_head_grads,
    multi_head_blockwise_attention,
)
from jaxattn._checks import (
    as_bool_array,
    as_float_array,
    check_flag,
    check_int,
    check_multi_head_inputs,
    check_rank,
    softmax_dtype,
)
from jaxattn._masks import check_window
from jaxattn._typing import ArrayLike, Bool, Float, Real

Array = jax.Array


def _mesh_axis_size(mesh: Any, axis: str | None, name: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, received {type(mesh).__name__}")
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"{name}={axis!r} is not an axis of the mesh, whose axes are {tuple(mesh.axis_names)}")
    return int(mesh.shape[axis])


def _merge(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Two partial attentions over disjoint key sets, merged exactly through their log-sum-exps.

    ``out [T, N, V]`` float32, ``lse [N, T]``. A side with ``lse = -inf`` (no kept key) has weight 0; if
    both have no kept key the result is a zero output with ``lse = -inf`` and finite gradients.
    """
    m = jnp.maximum(lse_a, lse_b)  # [N, T]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # [N, T]
    w_a = jnp.exp(lse_a - m)  # [N, T]
    w_b = jnp.exp(lse_b - m)  # [N, T]
    total = w_a + w_b  # [N, T]
    safe = jnp.where(total == 0.0, 1.0, total)  # [N, T]
    lse = jnp.where(total == 0.0, -jnp.inf, m + jnp.log(safe))  # [N, T]
    w_a = (w_a / safe).T[:, :, None]  # [T, N, 1]
    w_b = (w_b / safe).T[:, :, None]  # [T, N, 1]
    return out_a * w_a + out_b * w_b, lse  # [T, N, V], [N, T]


def _axis_size(axis_name: Any) -> int:
    """The number of devices on the bound mesh axis ``axis_name``; a ``ValueError`` if none is bound."""
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be the name (a str) of a mesh axis, received {axis_name!r}")
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: call ring_attention_shard inside a jax.shard_map "
            f"over a mesh that has the axis {axis_name!r}, or call ring_attention(..., mesh=mesh) outside one"
        ) from None


def _check_kv_mask(kv_mask: Any, S: int) -> Array | None:
    if kv_mask is None:
        return None
    kv_mask = as_bool_array(kv_mask, "kv_mask")
    check_rank(kv_mask, 1, "kv_mask", "[S]")
    if kv_mask.shape[0] != S:
        raise ValueError(f"kv_mask must have shape [S] = ({S},), received {tuple(kv_mask.shape)}")
    return kv_mask


def ring_attention_shard(
    q: Float[ArrayLike, "Tc N H"],
    k: Float[ArrayLike, "Sc K H"],
    v: Float[ArrayLike, "Sc K V"],
    *,
    axis_name: str,
    kv_mask: Bool[ArrayLike, "Sc"] | None = None,
    is_causal: bool = False,
    scale: Real[ArrayLike, ""] | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    local_window_size: int | tuple[int, int] | None = None,
) -> tuple[Float[Array, "Tc N V"], Float[Array, "N Tc"]]:
    """The per-device body of :func:`ring_attention`, to call inside your own ``jax.shard_map``.

    Takes this device's chunks (``Tc = T / P`` queries, ``Sc = S / P`` keys, P the size of the mesh axis
    ``axis_name``, chunk ``d`` on the device whose ``jax.lax.axis_index(axis_name)`` is ``d``) and returns
    this device's rows of the attention over the whole sequence: the key/value chunks go round the ring
    with ``lax.ppermute`` as in :func:`ring_attention`, which is a ``shard_map`` of this function. Use it
    where the ring is one step of a larger per-device program (a transformer block, a training step)
    that already runs in a ``shard_map``, whose mesh may have other axes (batch, heads) as well::

      def block(q, k, v):                      # [Tc, N, H], [Sc, K, H], [Sc, K, V] on each device
          out, lse = jaxattn.ring_attention_shard(q, k, v, axis_name="seq", is_causal=True)
          return out

      spec = jax.P("seq")
      out = jax.shard_map(block, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)

    The enclosing ``shard_map`` must pass ``check_vma=False`` (``NotImplementedError`` otherwise): the
    blockwise kernel's loops do not carry ``shard_map``'s varying-axis types. The gradient is the ring's
    own (see :func:`ring_attention`): ``dq`` of this device's queries, and ``dk, dv`` of its key/value
    chunk summed over every device's queries (what differentiating the ``shard_map`` means); the
    gradient of a replicated ``scale`` (``in_specs`` ``P()``) is summed over the devices by
    ``shard_map``'s transpose.

    Args:
      q: this device's queries ``[Tc, N, H]``.
      k: this device's keys ``[Sc, K, H]``.
      v: this device's values ``[Sc, K, V]``.
      axis_name: the mesh axis the sequence is split over, bound by the enclosing ``shard_map``.
      kv_mask: optional boolean key-padding keep-mask of this device's keys ``[Sc]`` (True = attend).
      is_causal: causal self-attention over the whole sequence (requires ``Tc == Sc``); a key chunk that
        lies wholly after this device's queries is skipped.
      scale, block_q, block_k: as in :func:`jaxattn.blockwise_attention` (blocks apply inside a step).
      local_window_size: ``None`` or ``(left, right)`` over the whole sequence's positions, as in
        :func:`jaxattn.blockwise_attention` (requires ``Tc == Sc``); key chunks outside every query's
        window are skipped.

    Returns:
      ``(out [Tc, N, V], lse [N, Tc])``: this device's rows of the output and of the row log-sum-exp.
    """
    q, k, v, _, _, scale = check_multi_head_inputs(q, k, v, None, None, scale)
    is_causal = check_flag(is_causal, "is_causal")
    block_q = check_int(block_q, "block_q", what="rows per tile")
    block_k = check_int(block_k, "block_k", what="rows per tile")
    P = _axis_size(axis_name)
    window = check_window(local_window_size)
    if (is_causal or window is not None) and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"is_causal or windowed ring attention is self-attention and needs chunks of equal length, received "
            f"q {tuple(q.shape)} [Tc, N, H] and k {tuple(k.shape)} [Sc, K, H]"
        )
    kv_mask = _check_kv_mask(kv_mask, k.shape[0])
    if _varying_axes(jax.lax.axis_index(axis_name)):  # the enclosing shard_map tracks varying axes
        raise NotImplementedError(
            "ring_attention_shard needs the enclosing jax.shard_map to pass check_vma=False: the blockwise "
            "kernel it runs at each step starts its loops from carries that vary over no mesh axis, which "
            "check_vma=True refuses once the loop body mixes in this device's chunks"
        )
    acc_dtype = softmax_dtype(jnp.result_type(q, k, v))
    ring = _Ring(axis_name, P, bool(is_causal), block_q, block_k, window, q.shape[0])
    return _ring_shard(q, k, v, kv_mask, jnp.asarray(scale, acc_dtype), ring)


def ring_attention(
    q: Float[ArrayLike, "T N H"],
    k: Float[ArrayLike, "S K H"],
    v: Float[ArrayLike, "S K V"],
    *,
    mesh: Mesh,
    axis_name: str,
    kv_mask: Bool[ArrayLike, "S"] | None = None,
    is_causal: bool = False,
    scale: Real[ArrayLike, ""] | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    local_window_size: int | tuple[int, int] | None = None,
) -> tuple[Float[Array, "T N V"], Float[Array, "N T"]]:
    """Sequence-parallel multi-head attention: queries stay, key/value chunks travel round a ring.

    The same function as :func:`jaxattn.multi_head_blockwise_attention` (equal within float32 rounding),
    with the sequence axes of q, k, v (and ``kv_mask``) split into P equal chunks over the mesh axis
    ``axis_name``. Device ``d`` holds queries ``[d·T/P, (d+1)·T/P)`` for the whole computation and sees
    each key/value chunk once, so its memory is O((T + S) / P). This is a ``jax.shard_map`` of
    :func:`ring_attention_shard`; inside your own ``shard_map``, call that one.

    The gradient is a ``jax.custom_vjp`` that runs the ring again (Ring Attention with FlashAttention-2's
    backward), so it too is O((T + S) / P) per device. The forward saves only each device's own chunks
    of q, k, v, ``kv_mask``, and of the final ``out`` and ``lse``. The backward sends every key/value
    chunk round the ring once more, together with its gradient accumulators ``dk, dv``; at each step a
    device adds its queries' contribution to the visiting chunk's ``dk, dv`` and to its own ``dq``,
    recomputing the tile weights from the GLOBAL ``lse`` (``p = exp(s - lse)``,
    ``D = rowsum(d_out · out) - d_lse``), and one more hop brings ``dk, dv`` home. Cotangents of both
    outputs, ``out`` and ``lse``, and of ``scale`` are exact; causal steps wholly above the diagonal
    are skipped in the backward too. Non-finite inputs behave as in :func:`jaxattn.blockwise_attention`
    (each step is one): masked keys never matter, kept ones make their outputs NaN, and the merge keeps
    a NaN from any step.

    Args:
      q: queries ``[T, N, H]``.
      k: keys ``[S, K, H]``.
      v: values ``[S, K, V]``.
      mesh: the device mesh.
      axis_name: the mesh axis the sequence is split over (P devices); P must divide T and S.
      kv_mask: optional boolean key-padding keep-mask ``[S]`` (True = attend), split with the keys.
      is_causal: causal self-attention (requires T == S); steps whose key chunk lies wholly after the
        query chunk are skipped.
      scale, block_q, block_k: as in :func:`jaxattn.blockwise_attention` (blocks apply inside a step).
      local_window_size: ``None`` or ``(left, right)`` (an int ``w`` is ``(w, w)``), as in
        :func:`jaxattn.blockwise_attention` (requires T == S): steps whose key chunk lies outside every
        query's window are skipped, forward and backward.

    Returns:
      ``(out [T, N, V], lse [N, T])``, sharded like q over ``axis_name``.
    """
    q, k, v, _, _, scale = check_multi_head_inputs(q, k, v, None, None, scale)
    is_causal = check_flag(is_causal, "is_causal")
    block_q = check_int(block_q, "block_q", what="rows per tile")
    block_k = check_int(block_k, "block_k", what="rows per tile")
    if not isinstance(axis_name, str):  # None means "not split" for sharded_attention's axes, not here
        raise TypeError(f"axis_name must be the name (a str) of the mesh axis the sequence is split over, "
                        f"received {axis_name!r}")
    P = _mesh_axis_size(mesh, axis_name, "axis_name")
    T, S = q.shape[0], k.shape[0]
    if T % P or S % P:
        raise ValueError(
            f"the mesh axis {axis_name!r} has {P} devices, which must divide both sequence lengths: "
            f"q has T={T} (shape {tuple(q.shape)}), k has S={S} (shape {tuple(k.shape)})"
        )
    window = check_window(local_window_size)
    if (is_causal or window is not None) and T != S:
        raise ValueError(f"is_causal or windowed ring attention is self-attention and needs T == S, received T={T}, S={S}")
    kv_mask = _check_kv_mask(kv_mask, S)
    acc_dtype = softmax_dtype(jnp.result_type(q, k, v))
    ring = _Ring(axis_name, P, bool(is_causal), block_q, block_k, window, T // P)
    seq = PartitionSpec(axis_name)
    fn = jax.shard_map(
        lambda q, k, v, m, scale: _ring_shard(q, k, v, m, scale, ring),
        mesh=mesh,
        in_specs=(seq, seq, seq, seq if kv_mask is not None else None, PartitionSpec()),
        out_specs=(seq, PartitionSpec(None, axis_name)),
        check_vma=False,
    )
    return fn(q, k, v, kv_mask, jnp.asarray(scale, acc_dtype))


# ----------------------------------------------------------------------------------------------------
# The ring itself, per device: a custom_vjp whose forward and backward each go once round the ring.
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of a ring (hashable: the ``custom_vjp``'s static argument)."""

    axis_name: str
    P: int  # devices on the ring
    causal: bool
    block_q: int
    block_k: int
    window: tuple[int, int] | None = None  # (left, right) over the whole sequence's positions
    C: int = 0  # the chunk length (with a window)

    @property
    def perm(self) -> list[tuple[int, int]]:
        return [(i, (i + 1) % self.P) for i in range(self.P)]  # device i sends its chunk to device i + 1

    def hop(self, x: Any) -> Any:
        """One step round the ring (None stays None)."""
        return None if x is None else jax.lax.ppermute(x, self.axis_name, self.perm)

    def kind(self, m: int) -> tuple:
        """How the query chunk meets the key chunk ``m`` chunks before it (``m < 0``: after it): ``("full",)``
        (no mask), ``("skip",)`` (nothing seen), ``("causal",)`` (the own chunk, causal within) or
        ``("window", left, right)``: the window in the step's own coordinates (key ``c'`` seen by query ``r'``
        iff ``r' - left <= c' <= r' + right``; with ``is_causal`` the right edge is at most the diagonal)."""
        if self.window is None:
            if not self.causal or m > 0:
                return ("full",)
            return ("causal",) if m == 0 else ("skip",)
        left, right = self.window
        if self.causal:
            right = min(right, 0)
        shift = m * self.C  # global key - query = local key - query - shift
        lo, hi = shift - left, shift + right  # the window of c' - r', which spans [-(C-1), C-1] in a step
        if lo > self.C - 1 or hi < -(self.C - 1):
            return ("skip",)
        if lo <= -(self.C - 1) and hi >= self.C - 1:
            return ("full",)
        return ("window", -lo, hi)

    def step(self, src: Array, run: Any) -> Any:
        """``run(kind)()`` for the step where device ``d`` meets the key chunk of device ``src``: one static
        program per kind of :meth:`kind`, chosen by a ``lax.switch`` on ``d - src`` (the ring wraps, so
        ``d - src`` and ``d - src - P`` are the same chunk: only the one in ``(-P, P)`` that exists counts)."""
        ms = range(-(self.P - 1), self.P)
        kinds = sorted({self.kind(m) for m in ms})
        if len(kinds) == 1:
            return run(kinds[0])()
        d = jax.lax.axis_index(self.axis_name)
        table = jnp.asarray([kinds.index(self.kind(m)) for m in ms], jnp.int32)  # by m + P - 1
        branch = table[d - src + self.P - 1]
        return jax.lax.switch(branch, [run(kind) for kind in kinds])


def _window_of(kind: tuple) -> tuple[int, int] | None:
    """The blockwise kernel's window of a step's kind (see :meth:`_Ring.kind`)."""
    return (kind[1], kind[2]) if kind[0] == "window" else None


def _varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over in ``shard_map``'s type system (``check_vma=True``); empty otherwise."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _ring_shard(q, k, v, m, scale, ring: _Ring):
    """:func:`_ring` on inputs made to vary over the same mesh axes, as its scans and branches need.

    Under ``check_vma=False`` (:func:`ring_attention`, and what :func:`ring_attention_shard` accepts)
    nothing is tracked and nothing is cast; ``shard_map``'s own transpose sums the gradient of an input
    it replicates. Under ``check_vma=True`` each input varies over the axes it was split over and the ring
    mixes them all (and ``axis_index``), so each input is cast to vary over their union; autodiff of the
    cast is a ``psum`` over the axes the input did not vary over (a replicated ``scale``'s gradient). That
    path also needs the blockwise kernel's loop carries to follow their inputs' types, which they do not,
    so :func:`ring_attention_shard` refuses ``check_vma=True`` before reaching here.
    """
    xs = (q, k, v, m, scale)
    union = frozenset().union(*(_varying_axes(x) for x in xs if x is not None))
    union = union | _varying_axes(jax.lax.axis_index(ring.axis_name))
    cast = lambda x: x if x is None or not union - _varying_axes(x) else jax.lax.pcast(
        x, tuple(sorted(union - _varying_axes(x))), to="varying")
    out, lse = _ring(*(cast(x) for x in xs), ring)  # [Tc, N, V] accumulation dtype, [N, Tc]
    return out.astype(jnp.result_type(q, k, v)), lse


def _ring_forward(q, k, v, m, scale, ring: _Ring):
    """``(out [Tc, N, V], lse [N, Tc])`` of one device, in the accumulation dtype.

    q ``[Tc, N, H]``, k ``[Sc, K, H]``, v ``[Sc, K, V]``, m ``[Sc]`` or None: this device's chunks. The
    partial results of the P steps are merged through their lse.
    """
    d = jax.lax.axis_index(ring.axis_name)
    Tc, N, V = q.shape[0], q.shape[1], v.shape[2]

    def step_result(t, k, v, m):
        def attend(kind):
            if kind[0] == "skip":
                return lambda: (  # zeros_like keeps q's type (the mesh axes it varies over)
                    jnp.zeros_like(q, shape=(Tc, N, V), dtype=scale.dtype),
                    jnp.full_like(q, -jnp.inf, shape=(N, Tc), dtype=scale.dtype),
                )

            def run():
                out, lse = _multi_head_blockwise(  # blockwise: the backward's tiles recompute from this lse
                    q, k, v, mask=m, is_causal=kind[0] == "causal", scale=scale, block_q=ring.block_q,
                    block_k=ring.block_k, implementation="blockwise", interpret=False, window=_window_of(kind),
                )
                return out.astype(scale.dtype), lse  # [Tc, N, V], [N, Tc]

            return run

        src = (d - t) % ring.P  # after t hops device d holds the chunk that started on device d - t
        return ring.step(src, attend)

    out, lse = step_result(0, k, v, m)

    def hop(carry, t):
        out, lse, k, v, m = carry
        k, v, m = ring.hop(k), ring.hop(v), ring.hop(m)
        out_t, lse_t = step_result(t, k, v, m)
        out, lse = _merge(out, lse, out_t, lse_t)
        return (out, lse, k, v, m), None

    (out, lse, _, _, _), _ = jax.lax.scan(hop, (out, lse, k, v, m), jnp.arange(1, ring.P))
    return out, lse


def _ring_backward(q, k, v, m, scale, out, lse, d_out, d_lse, ring: _Ring):
    """``(dq, dk, dv, dscale)`` of one device: the ring again, the key/value gradients travelling along.

    Device ``d`` keeps its queries, the global ``out`` and ``lse`` of its rows and their cotangents, and
    accumulates ``dq`` locally. The key/value chunk and its accumulators ``dk, dv`` travel together; at
    each step :func:`jaxattn._blockwise._multi_head_grads` gives the tile gradients of the visiting chunk
    from the GLOBAL ``out`` and ``lse`` (``p = exp(s - lse)``, ``D = rowsum(d_out · out) - d_lse``), which
    are exactly the gradient of the whole attention restricted to that chunk. After P steps one more hop
    brings every ``dk, dv`` home to the device that owns the chunk. ``dscale`` is this device's share
    (its own queries' logits); summing the shares is the transpose of however ``scale`` reached the
    devices (see :func:`_ring_shard`).
    """
    d = jax.lax.axis_index(ring.axis_name)

    def step_grads(t, k, v, m):
        def grads(kind):
            if kind[0] == "skip":
                return lambda: tuple(jnp.zeros_like(x, dtype=scale.dtype) for x in (q, k, v, scale))
            return lambda: _multi_head_grads(
                q, k, v, m, scale, out, lse, d_out, d_lse, is_causal=kind[0] == "causal", block_q=ring.block_q,
                block_k=ring.block_k, window=_window_of(kind),
            )  # dq [Tc, N, H], dk [Sc, K, H], dv [Sc, K, V], dscale, in the accumulation dtype

        src = (d - t) % ring.P
        return ring.step(src, grads)

    dq, dk, dv, d_scale = step_grads(0, k, v, m)

    def hop(carry, t):
        dq, dk, dv, d_scale, k, v, m = carry
        k, v, m, dk, dv = ring.hop(k), ring.hop(v), ring.hop(m), ring.hop(dk), ring.hop(dv)
        g = step_grads(t, k, v, m)
        dq, dk, dv, d_scale = dq + g[0], dk + g[1], dv + g[2], d_scale + g[3]
        return (dq, dk, dv, d_scale, k, v, m), None

    carry = (dq, dk, dv, d_scale, k, v, m)
    (dq, dk, dv, d_scale, _, _, _), _ = jax.lax.scan(hop, carry, jnp.arange(1, ring.P))
    dk, dv = ring.hop(dk), ring.hop(dv)  # the P-th hop: each chunk's gradient arrives at its owner
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_scale.astype(scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, m, scale, ring):
    return _ring_forward(q, k, v, m, scale, ring)


def _ring_fwd(q, k, v, m, scale, ring):
    out, lse = _ring_forward(q, k, v, m, scale, ring)
    return (out, lse), (q, k, v, m, scale, out, lse)  # this device's own chunks: O((T + S) / P)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, m, scale, out, lse = residuals
    dq, dk, dv, d_scale = _ring_backward(q, k, v, m, scale, out, lse, *cotangents, ring)
    return dq, dk, dv, None, d_scale


_ring.defvjp(_ring_fwd, _ring_bwd)


def sharded_attention(
    q: Float[ArrayLike, "B T N H"],
    k: Float[ArrayLike, "B S K H"],
    v: Float[ArrayLike, "B S K V"],
    *,
    mesh: Mesh,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    is_causal: bool = False,
    scale: Real[ArrayLike, ""] | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[Float[Array, "B T N V"], Float[Array, "B N T"]]:
    """Batched multi-head :func:`jaxattn.multi_head_blockwise_attention`, examples and heads split over devices.

    A ``shard_map``: each device runs the per-example function (vmapped over its examples) on its own
    examples and heads, with no communication. Splitting the heads keeps grouped-query groups whole:
    device ``p`` of ``head_axis`` gets query heads ``[p·N/P, (p+1)·N/P)`` and key/value heads
    ``[p·K/P, (p+1)·K/P)``, exactly the ones those query heads read (head ``n`` reads ``n // G``).

    Args:
      q: queries ``[B, T, N, H]``.
      k: keys ``[B, S, K, H]``.
      v: values ``[B, S, K, V]``.
      mesh: the device mesh.
      batch_axis: mesh axis to split the batch over (must divide B), or None.
      head_axis: mesh axis to split the heads over (must divide K), or None.
      is_causal, scale, block_q, block_k: as in :func:`jaxattn.blockwise_attention`.

    Returns:
      ``(out [B, T, N, V], lse [B, N, T])``, sharded like the inputs.
    """
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x, axes in (("q", q, "[B, T, N, H]"), ("k", k, "[B, S, K, H]"), ("v", v, "[B, S, K, V]")):
        check_rank(x, 4, name, axes)
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"q, k and v must have the same batch size B, received shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    # the per-example checks of multi_head_attention, on shapes only (indexing a sharded array would move data)
    jax.eval_shape(
        lambda q, k, v: check_multi_head_inputs(q, k, v, None, None, scale)[:3],
        *(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (q, k, v)),
    )
    Pb = _mesh_axis_size(mesh, batch_axis, "batch_axis")
    Ph = _mesh_axis_size(mesh, head_axis, "head_axis")
    B, K = q.shape[0], k.shape[2]
    if B % Pb:
        raise ValueError(f"the mesh axis {batch_axis!r} has {Pb} devices, which must divide the batch B={B}")
    if K % Ph:
        raise ValueError(
            f"the mesh axis {head_axis!r} has {Ph} devices, which must divide the key/value heads K={K} "
            f"(k has shape {tuple(k.shape)}), so that grouped-query groups stay on one device"
        )

    def per_device(q, k, v):
        fn = lambda q, k, v: multi_head_blockwise_attention(
            q, k, v, is_causal=is_causal, scale=scale, block_q=block_q, block_k=block_k
        )
        return jax.vmap(fn)(q, k, v)

    spec = PartitionSpec(batch_axis, None, head_axis, None)
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=(spec, PartitionSpec(batch_axis, head_axis, None)),
        check_vma=False,
    )
    return fn(q, k, v)
