"""Remedies for softmax saturation that the sweep can apply instead of (or with) ``1/sqrt(d_k)``: the
:class:`Remedy` specs (whose docstring defines each transform), their parsing, and the traced transforms
the sweep's program runs (q/k RMS normalisation, σReparam's projections and their spectral norms).

Every remedy sees the same draws of a trial, so their rows differ only by what the remedy does. Axis
alphabet as in the core (T queries, S keys, H = d_k, D model width).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._checks import check_float32_normal, check_logit_cap

Array = jax.Array


class Remedy(NamedTuple):
    """One remedy of :func:`saturation_sweep`: a transform of a trial's draws before the core's attention.

    With the drawn ``q [T, d_k]``, ``k [S, d_k]`` (N(0, 1) entries) the logits are ``x = s · q' k'ᵀ``,
    ``s = (1/sqrt(d_k) if sqrt_dk else 1) / temperature``, and with ``logit_cap = c`` the softmax is the
    core's capped one, ``softmax(c · tanh(x / c))``. ``q', k'`` are:

    - the drawn q, k (default);
    - ``qk_norm``: each row divided by its root mean square over ``d_k``, ``q'_t = q_t / sqrt(mean_h q_th²)``
      (an RMSNorm with gain 1 and no epsilon, computed in float32 or wider and rounded to the sweep's dtype),
      so ``|q'_t| = |k'_s| = sqrt(d_k)`` and ``q'·k' = d_k cos(q, k)``;
    - ``sigma_reparam``: σReparam (Zhai et al. 2023, "Stabilizing Transformer Training by Preventing
      Attention Entropy Collapse", ICML), ``W ← (γ / σ(W)) W`` with ``σ(W)`` the spectral norm, on the query
      and key projections of one head: the trial draws tokens ``x [T + S, D]`` (a normalised layer input,
      ``|x| ≈ sqrt(D)``) and projections ``W_q, W_k [D, d_k]``, all N(0, 1), model width ``D = d_k``, and
      ``q' = x_{:T} W_q / σ(W_q)``, ``k' = x_{T:} W_k / σ(W_k)`` with γ = 1, the initial value in the
      reference JAX code (github.com/apple/ml-sigma-reparam, ``speech/layers.py``). Its PyTorch code
      (``vision/layers.py``) initialises γ to σ(W₀), which leaves W unchanged at initialisation: a probe of
      random weights would then be the remedy ``none``. With γ = 1 the scale of W's entries drops out; a
      γ ≠ 1 on both projections multiplies the logits by ``γ_q γ_k``, the ``temperature`` ``1 / (γ_q γ_k)``
      on top. σ(W) comes from 48 Golub–Kahan–Lanczos steps (within 2e-6 of LAPACK's in the tests).

    The short forms (:meth:`parse`): ``"none"``, ``"sqrt_dk"``, ``"qk_norm"``, ``"qk_norm_sqrt_dk"``,
    ``"sigma_reparam"``, ``"sigma_reparam_sqrt_dk"``; ``("cap", c)``, named ``cap_<c>`` (on the unscaled
    ``q·k``), and ``("temperature", τ)``, named ``temperature_<τ>`` (``x = q·k / τ``, the same τ at every
    ``d_k``).

    Fields:
      name: the label of the remedy in the sweep's results (unique within a sweep).
      sqrt_dk: multiply ``q'·k'`` by ``1/sqrt(d_k)``.
      temperature: τ > 0, divide the logits by it (1: none).
      qk_norm: RMS-normalise each q and k row over ``d_k`` (gain 1).
      sigma_reparam: queries and keys from σReparam projections, ``W / σ(W)`` (γ = 1).
      logit_cap: ``None`` or the soft cap ``c > 0``.
    """

    name: str
    sqrt_dk: bool = False
    temperature: float = 1.0
    qk_norm: bool = False
    sigma_reparam: bool = False
    logit_cap: float | None = None

    @classmethod
    def parse(cls, spec: Any) -> "Remedy":
        """A :class:`Remedy` from a spec: a Remedy (checked), one of the names ``none``, ``sqrt_dk``,
        ``qk_norm``, ``qk_norm_sqrt_dk``, ``sigma_reparam``, ``sigma_reparam_sqrt_dk``, or a pair
        ``("cap", c)`` / ``("temperature", τ)`` with a number."""
        return _parse(spec, "remedy")


NAMED = {
    "none": dict(),
    "sqrt_dk": dict(sqrt_dk=True),
    "qk_norm": dict(qk_norm=True),
    "qk_norm_sqrt_dk": dict(qk_norm=True, sqrt_dk=True),
    "sigma_reparam": dict(sigma_reparam=True),
    "sigma_reparam_sqrt_dk": dict(sigma_reparam=True, sqrt_dk=True),
}
PARAMETRISED = ("cap", "temperature")

DEFAULT_REMEDIES = (
    "none", "sqrt_dk", "qk_norm", "qk_norm_sqrt_dk", ("cap", 1.0), ("cap", 2.0), ("cap", 5.0),
    ("temperature", 2.0), ("temperature", 8.0), "sigma_reparam", "sigma_reparam_sqrt_dk",
)

_SPEC_HELP = (f"a Remedy, one of the names {', '.join(NAMED)}, or a pair ('cap', c) or ('temperature', tau) "
              "with a number > 0")


def _positive(value: Any, what: str) -> float:
    """A finite number > 0 as a float (``what`` names it in the error)."""
    if isinstance(value, (bool, np.bool_)) or np.ndim(value) != 0 or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a real number > 0, received {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be finite and > 0, received {value!r}")
    check_float32_normal(value, what)
    return value


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool, received {value!r}")
    return bool(value)


def _parse(spec: Any, where: str) -> Remedy:
    """``spec`` as a checked :class:`Remedy`; errors name ``where`` (e.g. ``remedies[3]``)."""
    if isinstance(spec, Remedy):
        if not isinstance(spec.name, str) or not spec.name:
            raise TypeError(f"{where}.name must be a non-empty str, received {spec.name!r}")
        cap = check_logit_cap(spec.logit_cap, f"{where}.logit_cap")
        if cap is not None and not isinstance(cap, float):
            raise TypeError(f"{where}.logit_cap must be a concrete number or None, received a traced value")
        return Remedy(spec.name, _flag(spec.sqrt_dk, f"{where}.sqrt_dk"), _positive(spec.temperature, f"{where}.temperature"),
                      _flag(spec.qk_norm, f"{where}.qk_norm"), _flag(spec.sigma_reparam, f"{where}.sigma_reparam"), cap)
    if isinstance(spec, str):
        if spec not in NAMED:
            hint = f" (it takes a value: ({spec!r}, number))" if spec in PARAMETRISED else ""
            raise ValueError(f"{where} must be {_SPEC_HELP}; received the name {spec!r}{hint}")
        return Remedy(spec, **NAMED[spec])
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        kind, value = spec
        if kind == "cap":
            c = _positive(value, f"{where} ('cap', c): c")
            return Remedy(f"cap_{c:g}", logit_cap=c)
        if kind == "temperature":
            t = _positive(value, f"{where} ('temperature', tau): tau")
            return Remedy(f"temperature_{t:g}", temperature=t)
        raise ValueError(f"{where} must be {_SPEC_HELP}; received the pair {spec!r} (its first entry is not "
                         f"one of {PARAMETRISED})")
    raise TypeError(f"{where} must be {_SPEC_HELP}; received {spec!r}")


def parse_remedies(remedies: Any) -> tuple[Remedy, ...]:
    """The checked remedies of a sweep: a non-empty sequence of specs (:meth:`Remedy.parse`), names unique."""
    if isinstance(remedies, (str, Remedy)) or not isinstance(remedies, (list, tuple)):
        raise TypeError(f"remedies must be a list or tuple of remedy specs ({_SPEC_HELP}), received {remedies!r}")
    if not remedies:
        raise ValueError("remedies must hold at least one remedy spec, received an empty sequence")
    parsed = tuple(_parse(spec, f"remedies[{i}]") for i, spec in enumerate(remedies))
    names = [r.name for r in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"remedies must have distinct names, received {repeated} more than once in {names}")
    return parsed


# ----------------------------------------------------------------------------------------------------
# The transforms (traced; used by the sweep's program).
# ----------------------------------------------------------------------------------------------------


def rms_normalize(x: Array) -> Array:
    """Each row of ``x [..., H]`` divided by its root mean square over H (gain 1, no epsilon), computed in
    float32 or wider and returned in ``x``'s dtype."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    return (xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True))).astype(x.dtype)


LANCZOS_STEPS = 48


def _spectral_norm(w: Array, key: Array) -> Array:
    """``σ(W)``, the largest singular value of ``w [D, H]``, by Golub–Kahan–Lanczos bidiagonalisation.

    ``K = min(48, D, H)`` steps from a random unit start vector, with full reorthogonalisation (twice, each
    step), then the largest singular value of the ``K × K`` bidiagonal ``B``, the square root of the largest
    eigenvalue of the tridiagonal ``BᵀB`` (:func:`_largest_eigenvalue_tridiagonal`). This is the Krylov refinement of
    the power iteration the σReparam code uses: on square N(0, 1) matrices (float64, 4 draws each) 64
    power-iteration steps stopped up to 1.4% short of σ at D = 1024, 48 Lanczos steps within 2.3e-8 at
    D = 1024 and 6.4e-7 at D = 2048; the tests check the float32 result against ``numpy.linalg.norm(w, 2)``.
    Never above σ (up to rounding): it is the norm of ``w`` on a subspace.
    """
    D, H = w.shape
    K = min(LANCZOS_STEPS, D, H)
    acc = w.dtype

    def orth(x, basis):  # x minus its projection on the rows of basis (unfilled rows are 0), twice
        for _ in range(2):
            x = x - basis.T @ (basis @ x)
        return x

    def unit(x):
        n = jnp.linalg.norm(x)
        return jnp.where(n > 0, x / jnp.where(n > 0, n, 1.0), 0.0), n

    v0, _ = unit(jax.random.normal(key, (H,), acc))
    U = jnp.zeros((K, D), acc)
    V = jnp.zeros((K + 1, H), acc).at[0].set(v0)
    alpha = jnp.zeros((K,), acc)
    beta = jnp.zeros((K,), acc)

    def step(j, state):
        U, V, alpha, beta = state
        u = w @ V[j] - jnp.where(j > 0, beta[j - 1], 0.0) * U[j - 1]
        u, a = unit(orth(u, U))
        v = w.T @ u - a * V[j]
        v, b = unit(orth(v, V))
        return U.at[j].set(u), V.at[j + 1].set(v), alpha.at[j].set(a), beta.at[j].set(b)

    U, V, alpha, beta = jax.lax.fori_loop(0, K, step, (U, V, alpha, beta))
    # B = diag(α) + superdiag(β[:-1]) is [K, K] upper bidiagonal; BᵀB is tridiagonal: diagonal α_j² + β_{j-1}²,
    # off-diagonal α_j β_j. Its largest eigenvalue is σ².
    b = beta[:-1]
    diag = alpha * alpha + jnp.concatenate([jnp.zeros((1,), acc), b * b])
    return jnp.sqrt(_largest_eigenvalue_tridiagonal(diag, alpha[:-1] * b))


def _largest_eigenvalue_tridiagonal(diag: Array, off: Array, steps: int = 64) -> Array:
    """The largest eigenvalue of the symmetric positive semi-definite tridiagonal matrix with ``diag [K]`` and
    ``off [K - 1]``, by bisection on Sturm counts (the number of negative pivots of ``T - x I`` is the number of
    eigenvalues below x) between 0 and Gershgorin's bound; ``steps`` halvings.

    Plain arithmetic in loops: no LAPACK call. (XLA's CPU runtime deadlocked, on 2 cores, on a program that
    ran a batched LAPACK SVD beside the sweep's many other computations.)
    """
    off2 = jnp.concatenate([jnp.zeros((1,), diag.dtype), off * off])  # [K], off2[i] couples rows i-1 and i
    radius = jnp.abs(jnp.concatenate([off, jnp.zeros((1,), diag.dtype)])) + jnp.abs(jnp.concatenate([jnp.zeros((1,), diag.dtype), off]))
    tiny = jnp.finfo(diag.dtype).tiny

    def all_below(x):  # every eigenvalue < x: every pivot of T - x I negative
        def pivot(q, row):
            d, o2 = row
            q = d - x - o2 / q
            q = jnp.where(q == 0, -tiny, q)
            return q, q < 0
        _, negative = jax.lax.scan(pivot, jnp.full((), jnp.inf, diag.dtype), (diag, off2))
        return jnp.all(negative)

    def halve(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        below = all_below(mid)
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    hi = jnp.max(diag + radius) * (1 + 4 * jnp.finfo(diag.dtype).eps) + tiny
    lo, hi = jax.lax.fori_loop(0, steps, halve, (jnp.zeros((), diag.dtype), hi))
    return hi


def _sigma_draw(key: Array, *, head_dim: int, T: int, S: int, acc: Any) -> tuple[Array, Array, Array]:
    """One trial's σReparam inputs: tokens ``x [T + S, D]`` and projections ``W_q, W_k [D, H]`` (N(0, 1),
    ``D = H``), in ``acc``, from a stream of the trial key independent of :func:`_draw`'s."""
    D = head_dim
    z = jax.random.normal(jax.random.fold_in(key, 1), ((T + S) * D + 2 * D * head_dim,), acc)
    x = z[: (T + S) * D].reshape(T + S, D)
    w = z[(T + S) * D:].reshape(2, D, head_dim)
    return x, w[0], w[1]


def sigma_reparam_qk(key: Array, *, head_dim: int, T: int, S: int, dtype: Any) -> tuple[Array, Array, Array, Array]:
    """σReparam queries and keys of one trial: ``(q' [T, H], k' [S, H], σ(W_q), σ(W_k))``, q' and k' in ``dtype``.

    ``q' = x_{:T} (W_q / σ(W_q))``, ``k' = x_{T:} (W_k / σ(W_k))`` (γ = 1), computed in float32 or wider.
    """
    acc = jnp.promote_types(dtype, jnp.float32)
    x, w_q, w_k = _sigma_draw(key, head_dim=head_dim, T=T, S=S, acc=acc)
    keys = jax.random.split(jax.random.fold_in(key, 2))
    sigma_q = _spectral_norm(w_q, keys[0])
    sigma_k = _spectral_norm(w_k, keys[1])
    q = (x[:T] @ w_q) / sigma_q  # [T, H], x (W_q / σ(W_q)) without a scaled copy of W_q
    k = (x[T:] @ w_k) / sigma_k  # [S, H]
    return q.astype(dtype), k.astype(dtype), sigma_q, sigma_k


def remedy_scale(remedy: Remedy, head_dim: int) -> float:
    """The core's ``scale`` for ``remedy`` at ``d_k = head_dim``: ``(1/sqrt(d_k) if sqrt_dk else 1) / temperature``."""
    base = 1.0 / math.sqrt(head_dim) if remedy.sqrt_dk else 1.0
    return base / remedy.temperature
