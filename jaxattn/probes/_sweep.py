"""Monte Carlo: the variance of ``q·k``, and the saturation sweep as one ``jit(vmap(...))`` program.

Sweep results carry ``P`` (one entry per head dimension swept) and ``R`` (random trials) axes; their
first axis, of size 2, is the scale mode: ``0`` = scaled by ``1/sqrt(d_k)``, ``1`` = unscaled. With a
logit soft cap ``c`` both modes run the core's capped attention (``c · tanh(x / c)`` of the logits ``x``
of that mode). With ``remedies`` the first axis is instead one entry per remedy (``_remedies``), every
remedy on the same draws. Axis alphabet as in the core (T queries, S keys, H = d_k, V = d_v, M remedies).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _exported
from jaxattn._attention import _masked_softmax, attention_logits
from jaxattn._checks import as_key, check_float_dtype, check_int, check_logit_cap, softmax_dtype
from jaxattn._logits import soft_cap
from jaxattn.probes._bound import logit_cap_bounds
from jaxattn.probes._grads import _attention_grads, _row_norm
from jaxattn.probes._jacobian import _cap_slope, _jacobian_norms
from jaxattn.probes._remedies import Remedy, parse_remedies, remedy_scale, rms_normalize, sigma_reparam_qk
from jaxattn.probes._rows import row_stats

Array = jax.Array

DEFAULT_HEAD_DIMS = tuple(2**i for i in range(3, 13))  # 8, 16, ..., 4096


def _check_head_dims(head_dims: Sequence[int]) -> tuple[int, ...]:
    if isinstance(head_dims, (int, np.integer, str, bool)) or not hasattr(head_dims, "__iter__"):
        raise TypeError(f"head_dims must be a sequence of positive ints (e.g. (8, 64)), received {head_dims!r}")
    dims = tuple(head_dims)
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"head_dims must be a non-empty sequence of positive ints, received {head_dims!r}")
    return tuple(int(d) for d in dims)


def dot_product_variance(key: Any, head_dims: Sequence[int] = DEFAULT_HEAD_DIMS, *, num_samples: int = 4096) -> dict:
    """Monte Carlo ``Var(q·k)`` for ``q, k ~ N(0, I_{d_k})``: the chapter's claim is ``Var = d_k``.

    One compiled program. Each sample is a row of ``Σ d_k`` independent N(0, 1) pairs, cut into disjoint
    blocks of ``d_k`` columns, one block per ``d_k`` (so every ``d_k`` has its own vectors). The rows
    are drawn a block of rows at a time inside a ``lax.map``, so memory does not grow with
    ``num_samples``: XLA's temporary buffers hold ``2 · max(2^18, Σ d_k)`` normals and their RNG state,
    plus the ``[P, num_samples]`` products.

    Args:
      key: a ``jax.random`` key or an int seed.
      head_dims: the ``d_k`` values, ``[P]``.
      num_samples: independent pairs per ``d_k``.

    Returns:
      dict of NumPy arrays ``[P]``: ``head_dims``, ``variance`` (unbiased sample variance, float64),
      ``ratio`` (``variance / d_k``) and ``std_error`` (standard error of ``ratio``).
    """
    dims = _check_head_dims(head_dims)
    n = check_int(num_samples, "num_samples", 2)
    dots = _dots(as_key(key), dims, n)  # [P, n]
    dots = np.asarray(dots, np.float64)
    var = dots.var(axis=1, ddof=1)
    d = np.asarray(dims, np.float64)
    # Var of the sample variance: (m4 - var²)/n, with m4 the fourth central moment.
    # Both moments biased (m4 >= m2² always), so the estimate is never the sqrt of a negative number.
    centred = dots - dots.mean(axis=1, keepdims=True)
    m2, m4 = (centred**2).mean(axis=1), (centred**4).mean(axis=1)
    return {"head_dims": np.asarray(dims), "variance": var, "ratio": var / d, "std_error": np.sqrt((m4 - m2**2) / n) / d}


_DOT_BLOCK = 2**18  # normals per operand (q or k) drawn per step of :func:`_dots`' loop, when Σ d_k fits


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dots(key, dims, n):
    # Rows of Σ d_k pairs, ``rows`` at a time (one RNG op to compile, memory bounded by the block), each
    # row cut into disjoint column blocks of width d_k.
    total = sum(dims)
    rows = max(1, min(n, _DOT_BLOCK // total))
    chunks = -(-n // rows)
    offsets = np.cumsum((0,) + dims)

    def block(chunk_key):
        z = jax.random.normal(chunk_key, (2, rows, total))  # q, k: [2, rows, ΣH]
        prod = z[0] * z[1]  # [rows, ΣH]
        return jnp.stack([jnp.sum(prod[:, a:b], axis=-1) for a, b in zip(offsets[:-1], offsets[1:])])  # [P, rows]

    dots = jax.lax.map(block, jax.random.split(key, chunks))  # [chunks, P, rows]
    return jnp.moveaxis(dots, 0, 1).reshape(len(dims), chunks * rows)[:, :n]  # [P, n]


def _draw(key, *, head_dim, T, S, V, dtype):
    """One trial's ``q [T, H]``, ``k [S, H]``, ``v [S, V]`` with N(0, 1) entries and read-out ``r [T, V]`` (N(0, 1/V))."""
    # One draw for everything (each separate draw costs XLA compile time, once per d_k in the sweep).
    z = jax.random.normal(key, ((T + S) * (head_dim + V),))  # [(T+S)·(H+V)]
    qk, vr = jnp.split(z.reshape(T + S, head_dim + V), [head_dim], axis=1)  # [T+S, H], [T+S, V]
    q = qk[:T].astype(dtype)  # [T, H]
    k = qk[T:].astype(dtype)  # [S, H]
    v = vr[T:].astype(dtype)  # [S, V]
    r = (vr[:T] / math.sqrt(V)).astype(dtype)  # [T, V], unit-variance read-out
    return q, k, v, r


def _probe_rows(q, k, v, r, scale, cap=None):
    """Every per-row probe of one head for the read-out ``L = Σ r ⊙ attention(q, k, v; scale, logit_cap=cap)``."""
    return _row_probes(**_width_probes(q, k, v, r, scale, cap), cap=cap)


def _width_probes(q, k, v, r, scale, cap=None):
    """The part of :func:`_probe_rows` that sees ``d_k``: the core attention's gradients, reduced to rows.

    Returns ``[T, S]`` arrays (``logits``, the pre-cap logits; ``weights``; ``logit_grad``, ``∂L/∂`` those
    pre-cap logits), whose shapes do not depend on ``d_k``, and the ``‖∂L/∂q‖``, ``‖∂L/∂k‖`` and ``q·k``
    moments, already reduced.
    """
    T, S = q.shape[0], k.shape[0]
    acc = softmax_dtype(jnp.result_type(q, k, v))
    grads = _attention_grads(q, k, v, r, jnp.zeros((T, S), q.dtype), None, scale, False, cap)
    logits = attention_logits(q, k, scale=scale)  # [T, S], the (pre-cap) softmax input (f32 or wider)
    dots = logits / scale  # [T, S], q·k
    return {
        "logits": logits,
        # [T, S], the map the output was computed from, in its own dtype: row_stats reads a half-precision
        # map's saturated rows as probes.entropy does (cast to float32 first, they lost up to 12%)
        "weights": grads["weights"],
        "logit_grad": grads["logits"],  # [T, S], ∂L/∂logits in the input dtype
        "q_grad_norm": _row_norm(grads["q"].astype(acc)),  # [T]
        "k_grad_norm": _row_norm(grads["k"].astype(acc)),  # [S]
        "q_grad_zero": jnp.all(grads["q"] == 0, axis=-1),  # [T]
        "dot_sq": jnp.mean(dots * dots),  # E[(q·k)²] over this trial's T·S pairs (the mean is 0)
        "dot_mean": jnp.mean(dots),
    }


def _row_probes(logits, weights, logit_grad, cap=None, **reduced):
    """The rest of :func:`_probe_rows`, on ``[..., T, S]`` rows: any leading axes (the sweep stacks all d_k).

    ``logits`` are the pre-cap logits; with a cap ``c`` the Jacobian is that of the capped softmax with
    respect to them, ``(diag(p) - p pᵀ) diag(1 - tanh²(logits / c))``."""
    stats = row_stats(weights)
    # The Jacobian of the softmax the core computed (in float32 or wider). When q, k, v are in that dtype
    # (logit_grad's dtype is theirs), the map is that softmax itself; otherwise it was rounded to their dtype.
    p = weights if logit_grad.dtype == logits.dtype else _masked_softmax(soft_cap(logits, cap), None)
    jac = _jacobian_norms(p, _cap_slope(logits, cap))["frobenius"]  # [..., T]
    return {
        "entropy": stats["entropy"],
        "normalized_entropy": stats["normalized_entropy"],
        "max_weight": stats["max_weight"],
        "jacobian_norm": jac,
        "logit_grad_norm": _row_norm(logit_grad),
        "logit_grad_zero": jnp.all(logit_grad == 0, axis=-1),
        "jacobian_zero": jac == 0,
        **reduced,
    }


def _trial_widths(key, scaled, cap=None, *, head_dim, T, S, V, dtype):
    """One random trial at one static ``d_k`` and one scale mode, up to the ``d_k``-independent row probes."""
    q, k, v, r = _draw(key, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype)
    acc = softmax_dtype(dtype)
    scale = jnp.where(scaled, jnp.asarray(1.0 / math.sqrt(head_dim), acc), jnp.ones((), acc))  # traced scale
    return _width_probes(q, k, v, r, scale, cap)


def _trial(key, scaled, cap=None, *, head_dim, T, S, V, dtype):
    """One random trial at one static ``d_k`` and one scale mode: per-row probes of ``T`` queries on ``S`` keys."""
    return _row_probes(**_trial_widths(key, scaled, cap, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype), cap=cap)


@functools.partial(jax.jit, static_argnames=("head_dims", "T", "S", "V", "dtype", "batch"))
def _sweep_program(keys, cap=None, *, head_dims, T, S, V, dtype, batch):
    """``[P, R]`` keys -> every probe ``[2, P, R, ...]`` in one compiled program.

    The trace unrolls over the static ``head_dims``: each ``d_k`` runs at its own width, vmapped over
    its R trials and over the two scale modes (which share each trial's draw), as far as the ``[T, S]``
    logits, weights and ``∂L/∂logits``; those are stacked over ``d_k`` and the row probes that do not see
    ``d_k`` run once on the stack. ``batch`` is ``None`` (all R trials of a ``d_k`` in one vmap) or a
    count: ``lax.map`` then runs the vmapped trial over chunks of that many trials, which bounds memory.
    ``cap``: ``None`` or the (traced) logit soft cap, the same for every trial: one program for any cap.
    """
    modes = jnp.array([True, False])
    per_dim = []
    for p, head_dim in enumerate(head_dims):
        trial = functools.partial(_trial_widths, cap=cap, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype)
        both = lambda key, trial=trial: jax.vmap(trial, in_axes=(None, 0))(key, modes)  # key -> [2, ...]
        if batch is None:
            per_dim.append(jax.vmap(both)(keys[p]))  # [R, 2, ...]
        else:
            per_dim.append(jax.lax.map(both, keys[p], batch_size=batch))  # [R, 2, ...]
    stacked = jax.tree.map(lambda *xs: jnp.moveaxis(jnp.stack(xs), 2, 0), *per_dim)  # [2, P, R, ...]
    return _row_probes(**stacked, cap=cap)


class _Group(NamedTuple):
    """Remedies that run the same computation on data (static): capped or not; ``members``: their indices in
    the sweep; ``sources``: for each member, where its q, k come from (an index into the plan's sources).
    Within a group only data differ (each member's q, k, scale and cap), so the group is one vmap."""

    capped: bool
    members: tuple[int, ...]
    sources: tuple[int, ...]


class _Plan(NamedTuple):
    """The sweep's static structure: ``sources``, the (σReparam, q/k RMS norm) pairs some remedy draws its
    q, k from, and the groups (uncapped first)."""

    sources: tuple[tuple[bool, bool], ...]
    groups: tuple[_Group, ...]


def _plan(remedies: Sequence[Remedy]) -> _Plan:
    """The remedies grouped by whether they are capped; each member's source of q, k."""
    sources = tuple(dict.fromkeys((r.sigma_reparam, r.qk_norm) for r in remedies))
    groups = []
    for capped in (False, True):
        members = tuple(i for i, r in enumerate(remedies) if (r.logit_cap is not None) == capped)
        if members:
            groups.append(_Group(capped, members, tuple(sources.index((remedies[i].sigma_reparam, remedies[i].qk_norm))
                                                        for i in members)))
    return _Plan(sources, tuple(groups))


def _remedy_trial(key, scales, caps, *, plan, head_dim, T, S, V, dtype):
    """One random trial at one static ``d_k`` under every remedy, up to the ``d_k``-independent row probes.

    ``scales [M]``, ``caps [M]``: each remedy's core ``scale`` at this ``d_k`` and its cap (unused where the
    remedy has none). Returns one dict per group of ``plan``, its fields ``[G, ...]`` (G = the group's size).
    """
    q, k, v, r = _draw(key, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype)
    acc = softmax_dtype(dtype)
    nan = jnp.full((), jnp.nan, acc)
    sources = []
    if any(sigma for sigma, _ in plan.sources):
        sigma_qk = sigma_reparam_qk(key, head_dim=head_dim, T=T, S=S, dtype=dtype)
    for sigma, norm in plan.sources:
        q_s, k_s, sigma_q, sigma_k = sigma_qk if sigma else (q, k, nan, nan)
        if norm:
            q_s, k_s = rms_normalize(q_s), rms_normalize(k_s)
        sources.append((q_s, k_s, sigma_q.astype(acc), sigma_k.astype(acc)))
    out = []
    for group in plan.groups:
        members = np.asarray(group.members)
        if len(set(group.sources)) == 1:  # one source: q, k shared by the members (not batched)
            q_g, k_g, sigma_q, sigma_k = sources[group.sources[0]]
            axes = None
        else:  # each member's q, k: [G, T, H], [G, S, H]
            pick = np.asarray(group.sources)
            q_g, k_g, sigma_q, sigma_k = (jnp.stack([s[i] for s in sources])[pick] for i in range(4))
            axes = 0
        width = lambda q_m, k_m, s, c: _width_probes(q_m, k_m, v, r, s, c)
        if group.capped:
            fields = jax.vmap(width, in_axes=(axes, axes, 0, 0))(q_g, k_g, scales[members], caps[members])
        else:
            fields = jax.vmap(lambda q_m, k_m, s: width(q_m, k_m, s, None), in_axes=(axes, axes, 0))(q_g, k_g, scales[members])
        G = len(members)
        fields["spectral_norm_q"] = jnp.broadcast_to(sigma_q, (G,))
        fields["spectral_norm_k"] = jnp.broadcast_to(sigma_k, (G,))
        out.append(fields)
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("plan", "head_dims", "T", "S", "V", "dtype", "batch"))
def _remedy_program(keys, scales, caps, *, plan, head_dims, T, S, V, dtype, batch):
    """``[P, R]`` keys, ``scales [P, M]``, ``caps [M]`` -> every probe ``[M, P, R, ...]`` in one program.

    As :func:`_sweep_program`, with the scale modes replaced by the remedies: each trial is drawn once,
    its sources of q, k (plain, RMS-normalised, σReparam) computed once, and every remedy runs on it, the
    uncapped remedies as one vmap over their q, k, scales, the capped ones as another over their caps too
    (data: other values run the same program). The row probes run once per group on its ``[G, P, R, ...]`` stack
    (vmapped over the caps of a capped group); the groups are put back in the remedies' order.
    """
    per_dim = []
    for p, head_dim in enumerate(head_dims):
        trial = functools.partial(_remedy_trial, scales=scales[p], caps=caps, plan=plan, head_dim=head_dim,
                                  T=T, S=S, V=V, dtype=dtype)
        if batch is None:
            per_dim.append(jax.vmap(trial)(keys[p]))  # per group [R, G, ...]
        else:
            per_dim.append(jax.lax.map(trial, keys[p], batch_size=batch))
    rows = []
    for g, group in enumerate(plan.groups):
        stacked = jax.tree.map(lambda *xs: jnp.moveaxis(jnp.stack(xs), 2, 0), *(d[g] for d in per_dim))  # [G, P, R, ...]
        if group.capped:
            rows.append(jax.vmap(lambda fields, c: _row_probes(**fields, cap=c))(stacked, caps[np.asarray(group.members)]))
        else:
            rows.append(_row_probes(**stacked))
    order = np.argsort(np.concatenate([g.members for g in plan.groups]))  # remedy i is row order[i] of the concatenation
    return {name: jnp.concatenate([r[name] for r in rows])[order] for name in rows[0]}


@functools.lru_cache(maxsize=None)
def _trial_fn(head_dim, T, S, V, dtype):
    return jax.jit(functools.partial(_trial, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype))


@functools.lru_cache(maxsize=None)
def _capped_trial_fn(head_dim, T, S, V, dtype, cap):
    """``f(key, scaled)`` of :func:`_trial_fn` with the cap passed as a traced argument (one program for any cap)."""
    return functools.partial(_trial_fn(head_dim, T, S, V, dtype), cap=cap)


def sweep_trial_fn(
    head_dim: int,
    *,
    num_queries: int = 16,
    num_keys: int = 16,
    value_dim: int = 16,
    dtype: Any = jnp.float32,
    logit_cap: float | None = None,
) -> Callable[[Any, Any], dict[str, Array]]:
    """The jitted single-trial function the sweep vmaps: ``f(key, scaled) -> dict`` at ``d_k = head_dim``.

    ``f(key, scaled)`` draws one trial from ``key`` exactly as :func:`saturation_sweep` does and returns
    its per-row probes (the sweep's fields without the leading ``[2, P, R]`` axes); ``scaled`` is a
    (traced) bool. The sweep's trial ``r`` at ``head_dims[p]`` used the key
    ``jax.random.split(key, (P, R))[p, r]``. ``logit_cap`` as in :func:`saturation_sweep` (every cap
    runs the same compiled program). The same arguments return the same object. For benchmarks (a
    Python loop over it against :func:`saturation_sweep`) and for debugging one trial.
    """
    head_dim = check_int(head_dim, "head_dim", what="d_k")
    T = check_int(num_queries, "num_queries")
    S = check_int(num_keys, "num_keys", 2)
    V = check_int(value_dim, "value_dim")
    dtype = check_float_dtype(dtype)
    cap = check_logit_cap(logit_cap)
    if cap is None:
        return _trial_fn(head_dim, T, S, V, dtype)
    if isinstance(cap, float):
        return _capped_trial_fn(head_dim, T, S, V, dtype, cap)
    return functools.partial(_trial_fn(head_dim, T, S, V, dtype), cap=cap)  # a traced cap


def saturation_sweep(
    key: Any,
    *,
    head_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    num_trials: int = 64,
    num_queries: int = 16,
    num_keys: int = 16,
    value_dim: int = 16,
    dtype: Any = jnp.float32,
    trials_per_batch: int | None = None,
    logit_cap: float | None = None,
    remedies: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Saturation sweep: ``d_k`` × {scaled, unscaled} (or × remedies) × random trials, as ONE ``jit(vmap(...))`` program.

    Each trial draws ``q [T, d_k]``, ``k [S, d_k]``, ``v [S, V]`` with N(0, 1) entries and a read-out
    ``r [T, V]`` with N(0, 1/V) entries, runs the core :func:`jaxattn.attention` with
    ``scale=1/sqrt(d_k)`` and ``scale=1`` on the same draws, and records per query row: entropy,
    normalised entropy, max weight, the Frobenius norm of the softmax Jacobian, ``‖∂L/∂logits‖`` and
    ``‖∂L/∂q‖`` for ``L = Σ r ⊙ out`` (by ``jax.grad``), and whether those are exactly zero in ``dtype``;
    per key ``‖∂L/∂k‖``; per trial the moments of ``q·k``.

    With ``logit_cap=c`` both modes run the core's capped attention, ``softmax(c · tanh(x / c))`` of the
    logits ``x`` of that mode (``x = q kᵀ / sqrt(d_k)`` or ``q kᵀ``), and the same statistics are recorded
    for it: the entropy and max weight of the capped map, the Frobenius norm of its Jacobian and
    ``‖∂L/∂logits‖`` with respect to the pre-cap logits ``x`` (both include the cap's derivative
    ``1 - tanh²(x / c)``), ``‖∂L/∂q‖`` and ``‖∂L/∂k‖`` of the capped attention; ``dot_sq`` and ``dot_mean``
    are still the moments of ``q·k``. Over ``S`` keys every row then has max weight at most
    ``e^{2c} / (e^{2c} + S - 1)``, whatever ``d_k`` and the mode. The cap is an argument of the compiled
    program (every cap runs the same program; ``None`` runs the uncapped one). ``‖∂L/∂logits‖`` comes
    from ``jax.grad`` through the core, whose derivative of the cap is ``sech²(x / c)`` computed without
    cancellation (:func:`jaxattn._logits.soft_cap`), as the Jacobian norm's is: tiny where ``tanh(x / c)``
    rounds to ±1, not 0.

    Args:
      key: a ``jax.random`` key or an int seed.
      head_dims: the ``d_k`` values, ``[P]`` (default powers of two 8 … 4096).
      num_trials: R, random trials per ``d_k``.
      num_queries, num_keys, value_dim: T, S, V of each trial.
      dtype: dtype of q, k, v (the softmax still runs in at least float32, as in the core; gradients
        come back in ``dtype``). float64 needs ``jax.enable_x64``.
      trials_per_batch: ``None`` (default) vmaps all trials of a ``d_k`` at once; an int runs them in
        chunks of that many (a ``lax.map`` step inside the same program), which bounds memory. Results
        are the same up to rounding (each chunk size compiles its own kernels).
      logit_cap: ``None`` (default, no cap) or the soft cap ``c > 0``, a concrete number (the results
        are NumPy arrays, so the sweep itself does not run under ``jit``).
      remedies: ``None`` (default: the two scale modes above) or a sequence of M remedy specs, each a
        :class:`Remedy` or its short form (:meth:`Remedy.parse`): ``"none"`` (``x = q·k``), ``"sqrt_dk"``
        (``q·k / sqrt(d_k)``), ``"qk_norm"`` (q, k rows divided by their RMS over ``d_k``, then ``q·k``),
        ``"qk_norm_sqrt_dk"`` (the same ``/ sqrt(d_k)``), ``("cap", c)`` (``c · tanh(q·k / c)``),
        ``("temperature", τ)`` (``q·k / τ``), ``"sigma_reparam"`` and ``"sigma_reparam_sqrt_dk"``
        (σReparam, Zhai et al. 2023: q, k projected from drawn tokens by ``W / σ(W)``; each defined
        exactly in :class:`Remedy`). The first axis of every probe is then the remedy; every remedy runs
        on the same draws (σReparam's tokens and projections come from a stream of the same trial key),
        all in one compiled program, the caps and scales as data. ``logit_cap`` must then be None (give a
        cap as a remedy). ``("sqrt_dk", "none")`` gives the default sweep's numbers.

    Returns:
      dict: ``head_dims [P]``, ``scaled [2]`` (True, False), config entries (``logit_cap`` among them
      only when a cap is given), and NumPy arrays
      ``[2, P, R, T]`` (``entropy``, ``normalized_entropy``, ``max_weight``, ``jacobian_norm``,
      ``logit_grad_norm``, ``q_grad_norm``, ``logit_grad_zero``, ``q_grad_zero``, ``jacobian_zero``),
      ``k_grad_norm [2, P, R, S]`` and ``dot_sq``, ``dot_mean [2, P, R]``.

      With ``remedies``: the same fields with a first axis of M (one entry per remedy, in the order given)
      instead of 2, and no ``scaled``; ``dot_sq``/``dot_mean`` are the moments of the remedy's ``q'·k'``
      (its logits before the scale, the temperature and the cap); ``∂L/∂q`` and ``∂L/∂k`` are taken with
      respect to the q', k' the core attends with; also ``spectral_norm_q``, ``spectral_norm_k [M, P, R]``
      (``σ(W_q)``, ``σ(W_k)`` of each trial under σReparam, NaN for the other remedies), ``remedies``
      (the M :class:`Remedy`), ``remedy_names [M]``, ``logit_scale [M, P]`` (the core's scale: ``1/τ``,
      times ``1/sqrt(d_k)`` under ``sqrt_dk``), ``remedy_caps [M]`` (NaN: no cap), and the bounds a cap
      puts on every row over S keys (:func:`logit_cap_bounds`): ``max_weight_bound [M]``
      (``e^{2c} / (e^{2c} + S - 1)``; 1 without a cap) and ``entropy_floor [M]`` (0 without a cap).
    """
    dims = _check_head_dims(head_dims)
    R = check_int(num_trials, "num_trials")
    T = check_int(num_queries, "num_queries")
    S = check_int(num_keys, "num_keys", 2)
    V = check_int(value_dim, "value_dim")
    dtype = check_float_dtype(dtype)
    batch = None if trials_per_batch is None else check_int(trials_per_batch, "trials_per_batch")
    batch = None if batch is None or batch >= R else batch
    cap = check_logit_cap(logit_cap)
    if cap is not None and not isinstance(cap, float):
        raise TypeError("logit_cap of saturation_sweep must be a concrete number or None (the sweep returns NumPy "
                        "arrays); received a traced value: vmap sweep_trial_fn(..., logit_cap=...) instead")
    if remedies is not None:
        specs = parse_remedies(remedies)
        if cap is not None:
            raise ValueError(f"logit_cap must be None when remedies are given, received logit_cap={cap!r}: give the cap "
                             "as a remedy, ('cap', c), or as Remedy(..., logit_cap=c)")
        return _remedy_sweep(as_key(key), specs, dims, R=R, T=T, S=S, V=V, dtype=dtype, batch=batch)
    keys = jax.random.split(as_key(key), (len(dims), R))  # [P, R]
    out = _exported.call(_sweep_program, "saturation_sweep", keys, cap, head_dims=dims, T=T, S=S, V=V, dtype=dtype,
                         batch=batch)
    result = {name: np.asarray(x) for name, x in out.items()}
    result.update(
        head_dims=np.asarray(dims),
        scaled=np.array([True, False]),
        num_trials=R,
        num_queries=T,
        num_keys=S,
        value_dim=V,
        dtype=dtype.name,
    )
    if cap is not None:
        result["logit_cap"] = cap
    return result


def _remedy_sweep(key, specs, dims, *, R, T, S, V, dtype, batch) -> dict[str, Any]:
    """:func:`saturation_sweep` with remedies, its inputs checked."""
    acc = softmax_dtype(dtype)
    scales = np.array([[remedy_scale(r, d) for r in specs] for d in dims])  # [P, M], float64
    caps = np.array([np.nan if r.logit_cap is None else r.logit_cap for r in specs])  # [M]
    keys = jax.random.split(key, (len(dims), R))  # [P, R]
    out = _exported.call(_remedy_program, "remedy_sweep", keys, jnp.asarray(scales, acc),
                         jnp.asarray(np.nan_to_num(caps, nan=1.0), acc), plan=_plan(specs), head_dims=dims, T=T, S=S,
                         V=V, dtype=dtype, batch=batch)
    result = {name: np.asarray(x) for name, x in out.items()}
    bounds = [logit_cap_bounds(r.logit_cap, S) if r.logit_cap is not None else {"max_weight": 1.0, "entropy": 0.0}
              for r in specs]
    result.update(
        head_dims=np.asarray(dims),
        remedies=specs,
        remedy_names=np.array([r.name for r in specs]),
        logit_scale=scales.T.copy(),
        remedy_caps=caps,
        max_weight_bound=np.array([b["max_weight"] for b in bounds]),
        entropy_floor=np.array([b["entropy"] for b in bounds]),
        num_trials=R,
        num_queries=T,
        num_keys=S,
        value_dim=V,
        dtype=dtype.name,
    )
    return result


_SUMMARY_FIELDS = ("entropy", "normalized_entropy", "max_weight", "jacobian_norm", "logit_grad_norm", "q_grad_norm", "k_grad_norm")


def summarize_sweep(result: dict[str, Any], quantiles: Sequence[float] = (0.1, 0.5, 0.9)) -> dict[str, Any]:
    """Distributions of a :func:`saturation_sweep`, per scale mode (or remedy) and ``d_k`` (float64 NumPy);
    a capped sweep's ``logit_cap`` is copied with the config entries.

    Returns:
      dict: ``head_dims [P]``, ``quantiles [Q]``, ``var_qk [P]`` (Monte Carlo Var(q·k) over every pair),
      ``var_ratio [P]`` (``/ d_k``), and for each probe ``name`` in entropy, normalized_entropy,
      max_weight, jacobian_norm, logit_grad_norm, q_grad_norm, k_grad_norm: ``name`` → dict with
      ``mean [2, P]``, ``std [2, P]``, ``quantiles [2, P, Q]`` (``median`` = the 0.5 one if requested);
      ``zero_fraction`` → dict with ``logit_grad``, ``q_grad``, ``jacobian``: ``[2, P]`` fractions of rows
      that are exactly zero. Axis 0 is (scaled, unscaled).

      For a sweep with remedies, axis 0 is the remedy (M instead of 2), ``var_qk`` and ``var_ratio`` are
      ``[M, P]`` (of each remedy's ``q'·k'``), the remedy entries (``remedies``, ``remedy_names``,
      ``logit_scale``, ``remedy_caps``, ``max_weight_bound``, ``entropy_floor``) are copied, and
      ``spectral_norm_q``, ``spectral_norm_k`` are their means over trials ``[M, P]`` (NaN but σReparam).
    """
    qs = np.asarray(quantiles, np.float64)
    if qs.ndim != 1 or not np.all((qs >= 0) & (qs <= 1)):
        raise ValueError(f"quantiles must be a sequence of levels in [0, 1], received {quantiles!r}")
    summary: dict[str, Any] = {"head_dims": np.asarray(result["head_dims"]), "quantiles": qs}
    summary.update({k: result[k] for k in ("num_trials", "num_queries", "num_keys", "value_dim", "dtype", "logit_cap") if k in result})
    with_remedies = "remedies" in result
    dot_sq = np.asarray(result["dot_sq"], np.float64)  # [2 or M, P, R]
    dot_mean = np.asarray(result["dot_mean"], np.float64)
    if not with_remedies:
        dot_sq, dot_mean = dot_sq[1], dot_mean[1]  # [P, R], unscaled mode: logits are q·k
    var = dot_sq.mean(axis=-1) - dot_mean.mean(axis=-1) ** 2
    summary["var_qk"] = var
    summary["var_ratio"] = var / summary["head_dims"]
    for name in _SUMMARY_FIELDS:
        x = np.asarray(result[name], np.float64)
        x = x.reshape(x.shape[0], x.shape[1], -1)  # [2 or M, P, rows]
        stats = {"mean": x.mean(axis=-1), "std": x.std(axis=-1), "quantiles": np.quantile(x, qs, axis=-1).transpose(1, 2, 0)}
        if 0.5 in qs:
            stats["median"] = stats["quantiles"][..., list(qs).index(0.5)]
        summary[name] = stats
    modes = np.asarray(result["entropy"]).shape[0]
    summary["zero_fraction"] = {
        field: np.asarray(result[f"{field}_zero"], np.float64).reshape(modes, len(summary["head_dims"]), -1).mean(axis=-1)
        for field in ("logit_grad", "q_grad", "jacobian")
    }
    if with_remedies:
        summary.update({k: result[k] for k in ("remedies", "remedy_names", "logit_scale", "remedy_caps",
                                               "max_weight_bound", "entropy_floor")})
        for name in ("spectral_norm_q", "spectral_norm_k"):
            summary[name] = np.asarray(result[name], np.float64).mean(axis=-1)  # [M, P]
    return summary
