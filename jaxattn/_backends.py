"""Implementations of multi-head attention that return ``(out, lse)``: the ``implementation`` switch.

The functions that never need the ``[T, S]`` map (:func:`jaxattn.blockwise_attention`,
:func:`jaxattn.multi_head_blockwise_attention`, and :func:`jaxattn.attention_layer` with
``return_weights=False``) take ``implementation``, named as in ``jax.nn.dot_product_attention``:

- ``"blockwise"``: jaxattn's tiled online softmax (:mod:`jaxattn._blockwise`), any platform, any mask,
  O(T + S) memory; ``lse`` from its own accumulators.
- ``"xla"``: ``jax.nn.dot_product_attention(..., implementation="xla", return_residual=True)``: plain
  XLA ops that materialise ``[N, T, S]``; ``lse`` is the library's ``logsumexp`` of the masked logits.
- ``"cudnn"``: the same function with ``implementation="cudnn"`` (NVIDIA GPUs, bf16/fp16): cuDNN's fused
  flash attention; ``lse`` is the softmax statistic the cuDNN kernel saves for its backward, which
  ``jax.nn.dot_product_attention`` returns cast to the input dtype (so a bf16 call gives an ``lse``
  rounded to bf16, about 3 significant digits).
- ``"pallas"``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton, NVIDIA GPUs) with
  ``return_residuals=True``; ``lse`` is its saved base-2 log-sum-exp times ``ln 2``, float32. No mask
  (``is_causal`` only), a concrete scale. Its gradient is the kernel's own backward.
- ``None``: the fastest available on the platform, by a fixed rule on static facts (see :func:`choose_implementation`).

Every implementation returns ``out [T, N, V]`` in the promoted input dtype and ``lse [N, T]`` in the
accumulation dtype (float32, or float64 for float64 inputs), with jaxattn's conventions: a row with no
kept key gives a zero output and ``lse = -inf``. The library kernels stop the gradient of their ``lse``,
and so does :func:`attend`; :mod:`jaxattn._blockwise`, which calls it, gives ``lse`` its gradient: the
cotangent, when there is one, goes through the blockwise backward with zero-width values (one extra pass
over the tiles, skipped when nothing depends on ``lse``).

An implementation that cannot honour a call (the platform, a dtype, a mask, a traced scale) raises a
``ValueError`` naming ``implementation`` and the reason; nothing falls back to another implementation.

Axis alphabet as in :mod:`jaxattn._attention`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

IMPLEMENTATIONS = ("xla", "cudnn", "pallas", "blockwise")


def check_implementation(implementation: Any) -> str | None:
    """``implementation`` as given, if it is None or one of :data:`IMPLEMENTATIONS`; ``ValueError`` otherwise."""
    if implementation is None or (isinstance(implementation, str) and implementation in IMPLEMENTATIONS):
        return implementation
    raise ValueError(
        f"implementation must be None or one of {list(IMPLEMENTATIONS)} (as in jax.nn.dot_product_attention), "
        f"received {implementation!r}"
    )


def _platform() -> str:
    return jax.default_backend()


def _is_concrete(scale: Any) -> bool:
    return not isinstance(scale, jax.core.Tracer)


def unsupported(name: str, q: Array, k: Array, v: Array, mask: Array | None, scale: Any, is_causal: bool, *,
                platform: str | None = None, interpret: bool = False, window: Any = None,
                cap: Any = None, bias: Any = None) -> str | None:
    """Why implementation ``name`` cannot run this call, or None if it can.

    Validated inputs: q ``[T, N, H]``, k ``[S, K, H]``, v ``[S, K, V]``, mask None or broadcastable to
    ``[N, T, S]``, ``window`` ``(left, right)`` or None, ``cap`` the logit soft cap or None.
    ``interpret``: the Pallas kernel in interpret mode (any platform, for tests).
    """
    platform = platform or _platform()
    dtype = jnp.dtype(jnp.result_type(q, k, v))
    if name == "blockwise":
        return None
    if cap is not None:
        return "a logit soft cap (logit_cap) runs in the 'blockwise' kernel only"
    if bias is not None:
        return ("a bias runs in the 'blockwise' kernel here (jaxattn.dot_product_attention passes a bias to "
                "jax.nn's 'xla' and 'cudnn')")
    if name == "pallas" and window is not None:
        return "the Pallas kernel takes no sliding window (local_window_size); use 'blockwise', 'xla' or 'cudnn'"
    if name == "xla":
        if dtype == jnp.dtype(jnp.float16) and platform in ("cpu", "tpu"):
            return (f"jax.nn.dot_product_attention's xla path multiplies float16 with the F16_F16_F32 dot "
                    f"algorithm, which XLA on {platform} does not implement")
        return None
    if name == "cudnn":
        if platform != "gpu":
            return f"cuDNN attention needs an NVIDIA GPU; jax's default backend is {platform!r}"
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"cuDNN flash attention takes bfloat16 or float16 inputs, received {dtype.name}"
        if not _is_concrete(scale):
            return "cuDNN takes the scale as a Python number, received a traced scale"
        return None
    if name == "pallas":
        if platform != "gpu" and not interpret:
            return (f"the Pallas kernel (jax.experimental.pallas.ops.gpu.attention.mha) needs an NVIDIA GPU; "
                    f"jax's default backend is {platform!r}")
        if mask is not None:
            return "the Pallas kernel takes no mask (is_causal only); use 'blockwise' or 'xla' for masks"
        if not _is_concrete(scale):
            return "the Pallas kernel takes the scale as a Python number, received a traced scale"
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
            return (f"the Pallas kernel (float32 accumulators) takes bfloat16, float16 or float32 inputs, "
                    f"received {dtype.name}")
        if dtype == jnp.dtype(jnp.float16) and _pad_keys(q.shape[0], k.shape[0], is_causal)[1] and float(scale) < 1e-2:
            return ("padded keys are masked through an extra head column, which float16 cannot make negative "
                    f"enough at scale {float(scale)!r}")
        return None
    raise AssertionError(name)


def choose_implementation(implementation: str | None, q: Array, k: Array, v: Array, mask: Array | None, scale: Any,
            is_causal: bool, *, platform: str | None = None, interpret: bool = False, window: Any = None,
            cap: Any = None, bias: Any = None) -> str:
    """The implementation to run: the one asked for if it can run this call (else ``ValueError``), or
    None's choice.

    ``None``: on a GPU, ``"cudnn"`` for bfloat16/float16 inputs with no mask, ``H == V``, H a multiple of 8
    up to 128 and a concrete scale; else ``"pallas"`` for bfloat16/float16 inputs with no mask and a
    concrete scale; else ``"blockwise"``. On CPU and TPU, ``"blockwise"`` (on CPU it is the fastest:
    docs/blockwise.md). The rule reads only static facts (platform, dtypes, shapes, whether a mask is
    given), so one call always takes the same path.

    In float16, where ``scale·q`` passes 65504, Pallas's lse and gradient came out wrong on an H200 (lse
    twice the right one, dk inf; docs/gpu_h200.md); ``"blockwise"`` scales its float32 product instead.

    On an NVIDIA GPU the ``"blockwise"`` kernel is slow: 16-44x cuDNN's time on an H200 at T = 8k-32k with
    16 heads and 512-row blocks, 7-12x with blocks of 2048 (docs/gpu_h200.md). There, for float32 inputs
    or a mask, ``"xla"`` is the faster choice wherever its ``[N, T, S]`` logits fit in memory.
    """
    platform = platform or _platform()
    if implementation is not None:
        reason = unsupported(implementation, q, k, v, mask, scale, is_causal, platform=platform, interpret=interpret,
                             window=window, cap=cap, bias=bias)
        if reason is not None:
            raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
        return implementation
    if platform == "gpu" and mask is None and cap is None and bias is None:
        dtype = jnp.dtype(jnp.result_type(q, k, v))
        half = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        H, V = q.shape[-1], v.shape[-1]
        cudnn_shapes = H == V and H % 8 == 0 and H <= 128
        if half and cudnn_shapes and unsupported("cudnn", q, k, v, mask, scale, is_causal, platform=platform,
                                                 window=window) is None:
            return "cudnn"
        if half and unsupported("pallas", q, k, v, mask, scale, is_causal, platform=platform, window=window) is None:
            return "pallas"
    return "blockwise"


# ----------------------------------------------------------------------------------------------------
# The library kernels.
# ----------------------------------------------------------------------------------------------------


def _keep_rows(mask: Array | None, is_causal: bool, N: int, T: int, S: int, window: Any = None) -> Array | None:
    """``[N, T]`` bool: rows that keep at least one key (None: every row does)."""
    if S == 0:
        return jnp.zeros((N, T), bool)
    if mask is None and window is None:
        return None  # causal row i keeps key 0
    if mask is None:
        mask = jnp.ones((1, 1), bool)
    m = mask.reshape((1,) * (3 - mask.ndim) + tuple(mask.shape))  # [n, t, s]
    m = jnp.broadcast_to(m, (m.shape[0], T, S))  # [n, T, S]
    if is_causal:
        m = jnp.logical_and(m, jnp.arange(S)[None, None, :] <= jnp.arange(T)[None, :, None])
    if window is not None:
        d = jnp.arange(S)[None, None, :] - jnp.arange(T)[None, :, None]  # [1, T, S]
        m = jnp.logical_and(m, jnp.logical_and(d >= -window[0], d <= window[1]))
    return jnp.broadcast_to(jnp.any(m, axis=2), (N, T))  # [N, T]


def _same_width(q: Array, k: Array, v: Array, width: int) -> tuple[Array, Array, Array]:
    """q, k, v with their last axis padded by zeros to ``width`` (the kernels want H == V)."""
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    return pad(q), pad(k), pad(v)


def _jax_nn(q, k, v, mask, scale, is_causal, which, window=None):
    """``jax.nn.dot_product_attention(..., implementation=which, return_residual=True)`` -> out, lse [N, T]."""
    T, N, H = q.shape
    V = v.shape[-1]
    D = max(H, V)
    qd, kd, vd = _same_width(q, k, v, D)  # zero columns: the logits and the first V outputs are unchanged
    m4 = None
    if mask is not None:
        m = mask.reshape((1,) * (3 - mask.ndim) + tuple(mask.shape))  # [n, t, s]
        m4 = jnp.broadcast_to(m, (m.shape[0], T, k.shape[0]))[None]  # [1, n, T, S]
    out, lse = jax.nn.dot_product_attention(
        qd[None], kd[None], vd[None], mask=m4, scale=scale, is_causal=is_causal, implementation=which,
        return_residual=True, local_window_size=window,
    )  # [1, T, N, D], [1, T, N]
    return out[0, :, :, :V], lse[0].T  # [T, N, V], [N, T]


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _padded_length(n: int) -> int:
    """A length every block of the Pallas kernel divides: a power of two (>= 16) up to 128, else a multiple of 128."""
    return _pow2_at_least(n, 16) if n <= 128 else -(-n // 128) * 128


def _pad_keys(T: int, S: int, is_causal: bool) -> tuple[int, bool]:
    """``(Sp, masked)``: the padded key length, and whether padded keys must be masked (some row sees them).

    Causal, the kernel's loop over key blocks runs up to the query block's diagonal, so the keys are
    padded at least to the padded query length (else it reads past them when T > S).
    """
    Sp = _padded_length(S)
    if is_causal:
        Sp = max(Sp, _padded_length(T))
    return Sp, Sp > S and not (is_causal and T <= S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pallas_mha(q, k, v, sm_scale, causal, interpret):
    """The Pallas GPU kernel on ``[1, T, N, D]`` inputs -> ``(out [1, T, N, D], lse2 [1, N, T])``, base-2 lse."""
    return _pallas_forward(q, k, v, sm_scale, causal, interpret)


def _pallas_forward(q, k, v, sm_scale, causal, interpret):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    return pallas_attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal, interpret=interpret,
                                return_residuals=True)


def _pallas_mha_fwd(q, k, v, sm_scale, causal, interpret):
    out, lse2 = _pallas_forward(q, k, v, sm_scale, causal, interpret)
    return (out, lse2), (q, k, v, out, lse2)


def _pallas_mha_bwd(sm_scale, causal, interpret, residuals, cotangents):
    """The kernel's own backward (the one ``mha``'s custom_vjp runs), from the residuals the forward saved.

    ``mha`` refuses to differentiate a call with ``return_residuals=True``; its backward needs exactly
    the ``(q, k, v, segment_ids, out, lse)`` that call returns. The lse cotangent is not the kernel's
    business: :func:`jaxattn._blockwise._differentiable_lse` carries it.
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    q, k, v, out, lse2 = residuals
    d_out, _ = cotangents
    # Its fused backward wants as many query blocks as key blocks: both lengths padded to the longer, with
    # zero rows. A padded query row has d_out = 0, so it adds nothing whatever its lse; a padded key has
    # k = 0 and v = 0, so its dq term ds·k is 0 (its dk, dv are dropped).
    T, S = q.shape[1], k.shape[1]
    L = max(T, S)
    rows = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    lse2 = jnp.pad(lse2, [(0, 0), (0, 0), (0, L - T)])
    dq, dk, dv, _ = pallas_attention._mha_backward(
        sm_scale, causal, pallas_attention.BlockSizes.get_default(), "triton", None, 2, None, interpret, False,
        False, (rows(q, L), rows(k, L), rows(v, L), None, rows(out, L), lse2), rows(d_out, L),
    )
    return dq[:, :T], dk[:, :S], dv[:, :S]


_pallas_mha.defvjp(_pallas_mha_fwd, _pallas_mha_bwd)


def _pallas(q, k, v, scale, is_causal, interpret):
    """q ``[T, N, H]``, k ``[S, K, H]``, v ``[S, K, V]`` through the Pallas kernel -> ``out [T, N, V]``, ``lse [N, T]``.

    The kernel wants one head count (grouped-query k, v are repeated to N heads, so their gradient sums
    over each group), one head width (zero columns up to ``max(H, V)``), and lengths its blocks divide
    (zero rows: padded queries are dropped; padded keys, where some row would see them, get one extra
    head column holding a large negative logit, ``q`` column 1 against ``k`` column ``finfo.min / 2``).
    Its backward pads both lengths to the longer (:func:`_pallas_mha_bwd`).
    """
    T, N, H = q.shape
    S, K, V = v.shape
    k = jnp.repeat(k, N // K, axis=1)  # [S, N, H]
    v = jnp.repeat(v, N // K, axis=1)  # [S, N, V]
    Tp = _padded_length(T)
    Sp, mask_keys = _pad_keys(T, S, is_causal)
    D = max(H, V)
    q, k, v = _same_width(q, k, v, D)  # [T, N, D], [S, N, D], [S, N, D]
    if mask_keys:
        big = jnp.finfo(q.dtype).min / 2
        q = jnp.concatenate([q, jnp.ones((T, N, 1), q.dtype)], axis=2)  # [T, N, D+1]
        k = jnp.concatenate([k, jnp.zeros((S, N, 1), k.dtype)], axis=2)  # [S, N, D+1]
        v = jnp.concatenate([v, jnp.zeros((S, N, 1), v.dtype)], axis=2)  # [S, N, D+1]
        pad_k = jnp.zeros((Sp - S, N, D + 1), k.dtype).at[:, :, D].set(big)  # [Sp-S, N, D+1]
        k = jnp.concatenate([k, pad_k], axis=0)  # [Sp, N, D+1]
    else:
        k = jnp.pad(k, [(0, Sp - S), (0, 0), (0, 0)])  # [Sp, N, D]
    v = jnp.pad(v, [(0, Sp - S), (0, 0), (0, 0)])  # [Sp, N, D']
    q = jnp.pad(q, [(0, Tp - T), (0, 0), (0, 0)])  # [Tp, N, D']
    out, lse2 = _pallas_mha(q[None], k[None], v[None], float(scale), bool(is_causal), bool(interpret))
    lse = jax.lax.stop_gradient(lse2[0, :, :T]) * math.log(2.0)  # [N, T], natural log
    return out[0, :T, :, :V], lse


def attend(name: str, q: Array, k: Array, v: Array, mask: Array | None, scale: Any, is_causal: bool, *,
           interpret: bool = False, window: Any = None) -> tuple[Array, Array]:
    """Multi-head attention through implementation ``name`` (not ``"blockwise"``, which the caller runs).

    Validated inputs as in :func:`unsupported`; ``scale`` a Python number or a traced scalar. Returns
    ``(out [T, N, V], lse [N, T])``: out in the promoted input dtype, lse in the accumulation dtype,
    without a gradient (the caller gives it one); rows with no kept key give 0 and ``-inf``.
    """
    T, N, _ = q.shape
    S = k.shape[0]
    out_dtype = jnp.result_type(q, k, v)
    acc = jnp.promote_types(out_dtype, jnp.float32)
    q, k, v = (x.astype(out_dtype) for x in (q, k, v))
    if T == 0 or S == 0:
        return jnp.zeros((T, N, v.shape[-1]), out_dtype), jnp.full((N, T), -jnp.inf, acc)
    scale_arr = jnp.asarray(scale, acc)
    if name in ("xla", "cudnn"):  # a concrete scale as a Python float (cuDNN's is a static argument)
        out, lse = _jax_nn(q, k, v, mask, float(scale) if _is_concrete(scale) else scale_arr, is_causal, name, window)
    elif name == "pallas":
        out, lse = _pallas(q, k, v, scale, is_causal, interpret)
    else:
        raise AssertionError(name)
    lse = jax.lax.stop_gradient(lse.astype(acc))  # [N, T]
    rows = _keep_rows(mask, is_causal, N, T, S, window)  # [N, T] or None
    if rows is not None:  # the kernels give such rows the mean of v and a finite lse: jaxattn's are 0, -inf
        out = jnp.where(rows.T[:, :, None], out, 0).astype(out_dtype)  # [T, N, V]
        lse = jnp.where(rows, lse, -jnp.inf)  # [N, T]
    return out.astype(out_dtype), lse
