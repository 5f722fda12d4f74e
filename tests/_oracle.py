"""An independent float64 NumPy reference for attention and its gradient, and the tolerances per dtype.

Written from the formulas, not from jaxattn: L = scale·q kᵀ + bias, soft-capped to c·tanh(L / c) when a
cap c is given, P = softmax over kept keys (rows with no kept key are zero), out = P v. Gradients by hand:
dV = Pᵀ dO, dP = dO vᵀ, dL = P ⊙ (dP − rowsum(dP ⊙ P)) (times 1 − tanh²(L / c) under a cap),
dq = scale·dL k, dk = scale·dLᵀ q.
"""

import numpy as np

# Tolerances, defined once, per dtype of the computation under test: (rtol, atol), where rtol is
# relative to the largest magnitude of the expected array (normwise: an entry near zero is held to the
# array's scale, not to its own, since a float32 gradient entry of 1e-3 next to one of 1e-1 carries the
# rounding error of the larger terms it was summed from) and atol is an absolute floor for all-zero arrays.
TOL = {
    "float64": (1e-12, 1e-15),
    "float32": (1e-5, 1e-7),
    "bfloat16": (2e-2, 1e-3),
    "float16": (3e-3, 1e-4),
}


def assert_close(actual, expected, dtype="float32", err_msg="", magnitude=0.0):
    """``max|actual - expected| <= rtol * max(max|expected|, magnitude) + atol``, with shapes equal.

    ``magnitude``: the scale of the terms ``expected`` was summed from, where it can be smaller than
    they are (one of several gradients, all normwise by the largest: dq is exactly zero when each query
    keeps one key, while its float32 value is the rounding of ``p · (dp - D)`` with dp of dv's size)."""
    rtol, atol = TOL[dtype if isinstance(dtype, str) else np.dtype(dtype).name]
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == b.shape, f"{err_msg}: shape {a.shape} != expected {b.shape}"
    if a.size == 0:
        return
    err = float(np.max(np.abs(a - b)))
    bound = rtol * max(float(np.max(np.abs(b))), magnitude) + atol
    assert err <= bound, f"{err_msg}: max abs error {err:.3e} > {bound:.3e} (rtol {rtol} x max|expected| + {atol})"


def window_keep(T, S, left, right, offset=0):
    """Query i sees key j iff i + offset - left <= j <= i + offset + right, written out entry by entry."""
    keep = np.zeros((T, S), bool)
    for i in range(T):
        for j in range(S):
            keep[i, j] = i + offset - left <= j <= i + offset + right
    return keep


def _logits(q, k, bias, scale, cap):
    T, S = q.shape[0], k.shape[0]
    logits = scale * (q @ k.T)
    if bias is not None:
        logits = logits + np.broadcast_to(np.asarray(bias, np.float64), (T, S))
    if cap is not None:
        logits = float(cap) * np.tanh(logits / float(cap))
    return logits


def reference_forward(q, k, v, mask=None, bias=None, scale=None, cap=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, H = q.shape
    S = k.shape[0]
    scale = 1.0 / np.sqrt(H) if scale is None else float(scale)
    logits = _logits(q, k, bias, scale, cap)
    keep = np.ones((T, S), bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), (T, S))
    p = np.zeros((T, S))
    for i in range(T):
        idx = np.flatnonzero(keep[i])
        if idx.size:
            row = logits[i, idx]
            e = np.exp(row - row.max())
            p[i, idx] = e / e.sum()
    return p @ v, p


def reference_vjp(q, k, v, d_out, mask=None, bias=None, scale=None, cap=None):
    """Gradients (dq, dk, dv) of <d_out, out> for the reference forward."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    H = q.shape[1]
    scale = 1.0 / np.sqrt(H) if scale is None else float(scale)
    _, p = reference_forward(q, k, v, mask, bias, scale, cap)
    dv = p.T @ d_out
    dp = d_out @ v.T
    dl = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    if cap is not None:
        dl = dl * (1.0 - np.tanh(_logits(q, k, bias, scale, None) / float(cap)) ** 2)
    return scale * dl @ k, scale * dl.T @ q, dv
