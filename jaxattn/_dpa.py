"""``jax.nn.dot_product_attention``'s contract, with jaxattn's kernels behind the same switch.

:func:`dot_product_attention` takes exactly what ``jax.nn.dot_product_attention`` takes (batched
``[B, T, N, H]`` or unbatched ``[T, N, H]`` inputs, a bias and a boolean mask broadcastable to
``[B, N, T, S]``, ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size``,
``return_residual``) and adds jaxattn's own implementations and the logit soft cap. A program written
against jax.nn switches over by changing the module it calls.

Axis alphabet as in :mod:`jaxattn._attention`; B is the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._attention import _diagonal, _keep, _multi_head
from jaxattn._backends import IMPLEMENTATIONS
from jaxattn._blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, _multi_head_blockwise
from jaxattn._checks import as_bool_array, as_float_array, check_broadcastable, check_flag, check_logit_cap, check_scale
from jaxattn._logits import group_query_heads, scaled_logits
from jaxattn._masks import check_window
from jaxattn._typing import ArrayLike, Bool, Float, Int, Real

Array = jax.Array

DPA_IMPLEMENTATIONS = IMPLEMENTATIONS + ("dense",)


def _as_4d(x: Array, name: str, axes: str) -> Array:
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions {axes}, received shape {tuple(x.shape)}")
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def _lengths(x: Any, B: int, name: str) -> Array | None:
    if x is None:
        return None
    if not isinstance(x, jax.Array):  # NumPy or a list keeps its own dtype until clipped (see below)
        x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array [B] (int32 in jax.nn), received dtype {x.dtype.name}")
    if x.shape != (B,):
        raise ValueError(f"{name} must have shape [B] = ({B},), received {tuple(x.shape)}")
    # any integer dtype: clipped in its own dtype first, so that a length past int32 keeps every position
    # (as jax.nn's lengths longer than the sequence do) instead of wrapping round
    clip = np.clip if isinstance(x, np.ndarray) else jnp.clip
    return jnp.asarray(clip(x, 0, np.iinfo(np.int32).max)).astype(jnp.int32)


def _check(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths):
    """Checked 4-D ``(q [B, T, N, H], k [B, S, K, H], v [B, S, K, V], bias, mask, q_len, kv_len)``."""
    q = as_float_array(query, "query")
    k = as_float_array(key, "key")
    v = as_float_array(value, "value")
    if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)):
        raise ValueError(
            f"query, key and value must all be [B, T, N, H] / [B, S, K, H] / [B, S, K, V] or all unbatched "
            f"[T, N, H] / [S, K, H] / [S, K, V]; received shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    B, T, N, H = q4.shape
    _, S, K, _ = k4.shape
    if k4.shape[0] != B or v4.shape[0] != B:
        raise ValueError(f"query, key and value must have the same batch B, received {q4.shape[0]}, {k4.shape[0]}, {v4.shape[0]}")
    if k4.shape[3] != H:
        raise ValueError(f"query and key must have the same head dimension H: query {tuple(q.shape)}, key {tuple(k.shape)}")
    if v4.shape[1:3] != (S, K):
        raise ValueError(f"key and value must agree on [S, K]: key {tuple(k.shape)}, value {tuple(v.shape)}")
    if K == 0 or N % K:
        raise ValueError(f"the number of query heads must be a multiple of key/value heads, but got {N} vs {K}")
    target = (B, N, T, S)
    if bias is not None:
        bias = _as_4d(as_float_array(bias, "bias"), "bias", "[B, N, T, S]")
        check_broadcastable(bias, target, "bias", "[B, N, T, S]")
    if mask is not None:
        mask = _as_4d(as_bool_array(mask, "mask"), "mask", "[B, N, T, S]")
        check_broadcastable(mask, target, "mask", "[B, N, T, S]")
    q_len = _lengths(query_seq_lengths, B, "query_seq_lengths")
    kv_len = _lengths(key_value_seq_lengths, B, "key_value_seq_lengths")
    return q4, k4, v4, bias, mask, q_len, kv_len


def _choose(implementation: Any, bias: Any, cap: Any) -> str | None:
    if implementation is not None and implementation not in DPA_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {list(DPA_IMPLEMENTATIONS)}, received {implementation!r}")
    if implementation in ("xla", "cudnn") and cap is not None:
        raise ValueError(f"implementation={implementation!r} (jax.nn's) takes no logit_cap; use 'blockwise' or 'dense'")
    if implementation == "pallas" and bias is not None:
        raise ValueError("implementation='pallas' takes no bias (its kernel adds none); use 'blockwise', 'dense', "
                         "'xla' or 'cudnn' for a bias")
    return implementation


def _batch_mask(mask, q_len, kv_len, B, T, S):
    """The keep-mask of the batch, broadcastable to ``[B, N, T, S]`` in its compact shape, or None."""
    m = mask
    if q_len is not None:
        rows = (jnp.arange(T)[None, :] < q_len[:, None])[:, None, :, None]  # [B, 1, T, 1]
        m = rows if m is None else jnp.logical_and(m, rows)
    if kv_len is not None:
        cols = (jnp.arange(S)[None, :] < kv_len[:, None])[:, None, None, :]  # [B, 1, 1, S]
        m = cols if m is None else jnp.logical_and(m, cols)
    return m


def dot_product_attention(
    query: Float[ArrayLike, "*B T N H"],
    key: Float[ArrayLike, "*B S K H"],
    value: Float[ArrayLike, "*B S K V"],
    bias: Float[ArrayLike, "#B #N #T #S"] | None = None,
    mask: Bool[ArrayLike, "#B #N #T #S"] | None = None,
    *,
    scale: Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[ArrayLike, "B"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, "B"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    logit_cap: float | None = None,
) -> Float[Array, "*B T N V"] | tuple[Float[Array, "*B T N V"], Float[Array, "*B T N"]]:
    """``jax.nn.dot_product_attention`` with jaxattn's kernels behind its ``implementation`` switch.

    Same arguments, shapes and meaning as ``jax.nn.dot_product_attention`` (``[B, T, N, H]`` or
    ``[T, N, H]``; bias and mask broadcastable to ``[B, N, T, S]``, up to 4-D; lengths ``[B]``; the window
    ``(left, right)``: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``, an int ``w`` is
    ``(w, w)``; a causal window of W keys is ``is_causal=True, local_window_size=(W - 1, 0)``). The scale
    exists for the reason :func:`jaxattn.attention` gives; ``None`` is ``1/sqrt(H)``.

    Implementations:

    - ``"xla"``, ``"cudnn"``: ``jax.nn.dot_product_attention`` itself, every argument passed through, so
      its results, dtypes and refusals are jax.nn's (``"xla"`` in float16 on a CPU runs eagerly and is
      refused under ``jit``, as there).
    - ``"dense"``: :func:`jaxattn.multi_head_attention` (the core the probes measure), any bias, mask,
      window and ``logit_cap``; O(T·S) memory.
    - ``"blockwise"``: :func:`jaxattn.multi_head_blockwise_attention`'s tiled kernel, O(T + S) memory
      with no mask or bias given (a mask or bias keeps its broadcast shape), key blocks outside the
      window skipped.
    - ``"pallas"``: the Pallas GPU kernel (``is_causal`` only).
    - ``None``: :func:`jaxattn.multi_head_blockwise_attention`'s choice (``"blockwise"`` on CPU and TPU,
      cuDNN or Pallas on a GPU where they can run the call).

    Where jaxattn's kernels (``"dense"``, ``"blockwise"``, ``"pallas"``) deliberately differ from jax.nn:
    a query row with no kept key (outside ``query_seq_lengths``, or masked everywhere) gives a zero output
    and, with ``return_residual``, ``lse = -inf``; jax.nn gives zeros for the rows past
    ``query_seq_lengths`` but the mean of the values for any other fully masked row. Non-finite inputs
    follow :func:`jaxattn.attention` (a masked position never matters). Derivatives: the tiled kernels
    (``"blockwise"``, ``"pallas"``, and so ``None`` on CPU and TPU) are ``jax.custom_vjp`` functions, as
    jax.nn's cuDNN one is: reverse mode (``jax.grad``, ``jax.vjp``, and reverse over reverse) only;
    first-order forward mode (``jax.jvp``, ``jax.jacfwd`` of the attention itself) needs ``"dense"`` (or
    ``"xla"``).

    Args:
      query, key, value, bias, mask, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
        local_window_size: as in ``jax.nn.dot_product_attention``.
      implementation: see above.
      return_residual: also return the row log-sum-exp ``[B, T, N]`` (``[T, N]``): as in jax.nn, in the
        input dtype and without a gradient (``stop_gradient``). :func:`jaxattn.multi_head_blockwise_attention`
        returns a differentiable float32 one.
      logit_cap: ``None``, or ``c`` for ``c · tanh(logits / c)`` before the mask (``"dense"`` and
        ``"blockwise"``).

    Returns:
      ``out`` shaped like ``query`` with V for H, in the inputs' dtype; with ``return_residual``,
      ``(out, lse)``.
    """
    q, k, v, bias, mask, q_len, kv_len = _check(query, key, value, bias, mask, query_seq_lengths,
                                                key_value_seq_lengths)
    batched = jnp.ndim(query) == 4  # after the checks, which name a query that is not an array
    is_causal = check_flag(is_causal, "is_causal")
    return_residual = check_flag(return_residual, "return_residual")
    window = check_window(local_window_size)
    cap = check_logit_cap(logit_cap)
    name = _choose(implementation, bias, cap)
    B, T, N, H = q.shape
    S = k.shape[1]
    if name in ("xla", "cudnn"):
        result = jax.nn.dot_product_attention(
            q, k, v, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len, local_window_size=window, implementation=name,
            return_residual=return_residual,
        )
        out, lse = result if return_residual else (result, None)
    else:
        dtype = jnp.result_type(q, k, v)
        scale = check_scale(scale, H, dtype)
        m = _batch_mask(mask, q_len, kv_len, B, T, S)  # [b, n, t, s] or None
        m_axis = None if m is None or m.shape[0] == 1 else 0
        m = m[0] if m_axis is None and m is not None else m
        b_axis = None if bias is None or bias.shape[0] == 1 else 0
        bias = bias[0] if b_axis is None and bias is not None else bias

        def one(q1, k1, v1, m1, b1):  # one example: [T, N, H], [S, K, H], [S, K, V], [n, t, s], [n, t, s]
            if name == "dense":
                causal, win = _diagonal(is_causal, 0, window)
                m1 = None if m1 is None else jnp.broadcast_to(m1, (m1.shape[0], T, S))
                o, _ = _multi_head(q1, k1, v1, m1, b1, scale, causal, win, cap)
                lse1 = _dense_lse(q1, k1, m1, b1, scale, causal, win, cap) if return_residual else None
                return o, lse1
            o, lse1 = _multi_head_blockwise(
                q1, k1, v1, mask=m1, is_causal=is_causal, scale=scale, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                implementation=name, interpret=False, local_window_size=window, logit_cap=cap, bias=b1,
            )
            return o, lse1.T  # [T, N, V], [T, N]

        out, lse = jax.vmap(one, in_axes=(0, 0, 0, m_axis, b_axis))(q, k, v, m, bias)
        if return_residual:
            lse = jax.lax.stop_gradient(lse).astype(dtype)  # [B, T, N], jax.nn's residual
        out = out.astype(dtype)
    if not batched:
        out = out[0]
        lse = None if lse is None else lse[0]
    return (out, lse) if return_residual else out


def _dense_lse(q, k, m, bias, scale, causal, window, cap):
    """The row log-sum-exp ``[T, N]`` of the dense core's kept logits (-inf for a row with none)."""
    T, N, H = q.shape
    S, K, _ = k.shape
    qh = group_query_heads(q, K).reshape(N, T, H)  # [N, T, H]
    kh = jnp.repeat(k.transpose(1, 0, 2), N // K, axis=0)  # [N, S, H]
    b = None if bias is None else jnp.broadcast_to(bias, (N, T, S))
    logits = jax.vmap(lambda qq, kk, bb: scaled_logits(qq, kk, bb, scale, cap), in_axes=(0, 0, None if b is None else 0))(qh, kh, b)
    keep = _keep(None if m is None else jnp.broadcast_to(m, (N, T, S)), causal, T, S, window)
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.scipy.special.logsumexp(logits, axis=-1).T  # [T, N]
