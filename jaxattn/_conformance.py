"""Conformance: every attention implementation this machine runs, against a float64 oracle, on one grid.

For each case of the grid (mask, causal, grouped-query heads, dtype, lengths that are and are not
multiples of the blocks) and each implementation (:data:`jaxattn._backends.IMPLEMENTATIONS`), the
implementation's ``(out, lse)`` and the gradients ``dq, dk, dv`` of ``Σ out·w_out + Σ lse·w_lse`` are
compared with :func:`oracle`, NumPy in float64 written from the formulas. The inputs are drawn in
float64, rounded to the case's dtype, and the oracle gets the rounded values, so the error measured is
the implementation's own.

An implementation that cannot honour a case is reported as unsupported with its reason (the same
check that makes the public functions raise). Matmuls run at ``jax.default_matmul_precision("highest")``
in the float32 and float64 cases (on a GPU the default for float32 may be TF32, a 10-bit mantissa), so
that they measure the algorithms; a kernel that ignores that setting shows its own precision. The
bfloat16 and float16 cases run at the default precision. On CPU the Pallas GPU kernel runs in Pallas's interpret
mode (the kernel's own code, executed by XLA on the CPU); on a GPU it runs compiled. Nothing here
depends on the platform otherwise, so the same call runs on CPU, GPU and TPU.

Axis alphabet as in :mod:`jaxattn._attention`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._backends import IMPLEMENTATIONS, unsupported
from jaxattn._blockwise import _multi_head_blockwise

# Normwise relative tolerance per dtype of the computation: max|got - oracle| <= TOL · max|oracle|.
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of the grid: shapes ``q [T, N, H]``, ``k [S, K, H]``, ``v [S, K, V]``, a mask, a dtype."""

    T: int
    S: int
    N: int
    K: int
    H: int
    V: int
    mask: str  # "none", "causal", "padding" (keys [S], the last quarter dropped), "general" ([N, T, S], an empty row)
    dtype: str

    @property
    def label(self) -> str:
        heads = f"N={self.N}" if self.N == self.K else f"GQA {self.N}/{self.K}"
        return f"{self.dtype} · {self.mask} · {heads} · T={self.T} S={self.S}"


DTYPES = ("float32", "bfloat16", "float16", "float64")
MASKS = ("none", "causal", "padding", "general")
HEADS = ((2, 2), (4, 2))  # (N, K): multi-head, grouped-query
LENGTHS = ((32, 32), (13, 29), (29, 13))  # (T, S): multiples of the blocks, and not (T < S, T > S)


def grid(dtypes=DTYPES, masks=MASKS, heads=HEADS, lengths=LENGTHS, H: int = 16, V: int = 8) -> list[Case]:
    """The grid: every combination of dtype, mask, ``(N, K)`` heads and ``(T, S)`` lengths."""
    for name, values, allowed in (("dtypes", dtypes, DTYPES), ("masks", masks, MASKS)):
        bad = [x for x in values if x not in allowed]
        if bad:
            raise ValueError(f"{name} must be chosen from {list(allowed)}, received {bad}")
    return [Case(T, S, N, K, H, V, m, d) for d, m, (N, K), (T, S) in itertools.product(dtypes, masks, heads, lengths)]


def _inputs(case: Case, seed: int):
    """float64 arrays rounded through the case's dtype, the mask, is_causal, and the loss weights."""
    rng = np.random.default_rng(seed)
    T, S, N, K, H, V = case.T, case.S, case.N, case.K, case.H, case.V

    def round_trip(x):  # float64 values that the case's dtype represents exactly
        return x if case.dtype == "float64" else np.asarray(jnp.asarray(x, case.dtype).astype(jnp.float32), np.float64)

    q, k, v = (round_trip(rng.standard_normal(shape)) for shape in ((T, N, H), (S, K, H), (S, K, V)))
    mask = None
    if case.mask == "padding":
        mask = np.arange(S) < S - max(1, S // 4)  # [S]
    elif case.mask == "general":
        mask = rng.random((N, T, S)) < 0.7  # [N, T, S]
        mask[0, min(1, T - 1)] = False  # a row with no kept key
    w_out = round_trip(rng.standard_normal((T, N, V)))  # the cotangent of out, in out's dtype
    w_lse = rng.standard_normal((N, T))
    return q, k, v, mask, case.mask == "causal", w_out, w_lse


def oracle(q, k, v, mask, is_causal: bool, scale: float, w_out, w_lse):
    """float64 NumPy: ``(out [T, N, V], lse [N, T], dq, dk, dv)`` for ``L = Σ out·w_out + Σ lse·w_lse``.

    ``P = softmax(scale · q kᵀ)`` over the kept keys (query head ``n`` reads key/value head ``n // G``),
    ``out = P v``, ``lse`` the row log-sum-exp of the kept logits; a row with no kept key has ``P = 0``,
    ``out = 0``, ``lse = -inf`` and no ``lse`` term in L. With ``D = rowsum(out ⊙ w_out)``:
    ``dS = P ⊙ (w_out vᵀ - D + w_lse)``, ``dq = scale · dS k``, ``dk = scale · dSᵀ q``, ``dv = Pᵀ w_out``
    (summed over each group's query heads).
    """
    q, k, v, w_out, w_lse = (np.asarray(x, np.float64) for x in (q, k, v, w_out, w_lse))
    T, N, _ = q.shape
    S, K, V = v.shape
    G = N // K
    keep = np.ones((N, T, S), bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), (N, T, S))
    if is_causal:
        keep = keep & (np.arange(S)[None, :] <= np.arange(T)[:, None])[None]
    out = np.zeros((T, N, V))
    lse = np.full((N, T), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for n in range(N):
        kv = n // G
        logits = scale * q[:, n] @ k[:, kv].T  # [T, S]
        kept = keep[n]
        has = kept.any(axis=1)  # [T]
        row_max = np.where(has, np.max(np.where(kept, logits, -np.inf), axis=1, initial=-np.inf), 0.0)  # [T]
        e = np.where(kept, np.exp(np.where(kept, logits, 0.0) - row_max[:, None]), 0.0)  # [T, S]
        total = e.sum(axis=1)  # [T]
        p = e / np.where(has, total, 1.0)[:, None]  # [T, S]
        lse[n] = np.where(has, row_max + np.log(np.where(has, total, 1.0)), -np.inf)
        out[:, n] = p @ v[:, kv]
        D = np.sum(out[:, n] * w_out[:, n], axis=1)  # [T]
        ds = p * (w_out[:, n] @ v[:, kv].T - D[:, None] + np.where(has, w_lse[n], 0.0)[:, None])  # [T, S]
        dq[:, n] = scale * ds @ k[:, kv]
        dk[:, kv] += scale * ds.T @ q[:, n]
        dv[:, kv] += p.T @ w_out[:, n]
    return out, lse, dq, dk, dv


def _effective_dtype(implementation: str, dtype: str) -> str:
    """The precision an implementation computes a case in: ``"xla"`` (jax.nn.dot_product_attention) runs
    its softmax in float32, so its float64 results are held to float32's tolerance."""
    if implementation == "xla" and dtype == "float64":
        return "float32"
    return dtype


def _error(got, want) -> float:
    """Normwise relative error ``max|got - want| / max|want|``; lse's ``-inf`` entries must match exactly."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    if not np.array_equal(np.isneginf(got), np.isneginf(want)):
        return math.inf
    got, want = np.where(np.isneginf(want), 0.0, got), np.where(np.isneginf(want), 0.0, want)
    if not np.all(np.isfinite(got)):
        return math.inf
    scale = float(np.max(np.abs(want), initial=0.0))
    return float(np.max(np.abs(got - want), initial=0.0)) / (scale if scale > 0 else 1.0)


def _run_one(implementation: str, case: Case, q, k, v, mask, is_causal, w_out, w_lse, interpret: bool,
             block_q: int, block_k: int):
    acc = jnp.promote_types(case.dtype, jnp.float32)
    has = None if mask is None else np.broadcast_to(mask, (case.N, case.T, case.S)).any(axis=2)  # [N, T]
    lse_weight = jnp.asarray(w_lse if has is None else np.where(has, w_lse, 0.0), acc)
    w_out = jnp.asarray(w_out, acc)

    def loss(q, k, v):
        out, lse = _multi_head_blockwise(q, k, v, mask=mask, is_causal=is_causal, scale=None, block_q=block_q,
                                         block_k=block_k, implementation=implementation, interpret=interpret)
        finite_lse = jnp.where(jnp.isneginf(lse), 0.0, lse)  # rows with no kept key: no lse term
        value = jnp.sum(out.astype(acc) * w_out) + jnp.sum(finite_lse.astype(acc) * lse_weight)
        return value, (out, lse)

    args = [jnp.asarray(x, case.dtype) for x in (q, k, v)]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(*args)
    return (out, lse, *grads)


def check_conformance(
    implementations: Sequence[str] | None = None,
    *,
    dtypes: Sequence[str] = DTYPES,
    masks: Sequence[str] = MASKS,
    heads: Sequence[tuple[int, int]] = HEADS,
    lengths: Sequence[tuple[int, int]] = LENGTHS,
    interpret: bool | None = None,
    block_q: int = 16,
    block_k: int = 16,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every implementation against the float64 oracle on the grid; a record per (case, implementation).

    The grid is every combination of ``dtypes`` (``"float32"``, ``"bfloat16"``, ``"float16"``,
    ``"float64"``), ``masks`` (``"none"``, ``"causal"``, ``"padding"``: keys ``[S]`` with the last quarter
    dropped, ``"general"``: ``[N, T, S]`` with a row that keeps no key), ``heads`` (``(N, K)``, grouped-query
    when ``K < N``) and ``lengths`` (``(T, S)``); ``H = 16``, ``V = 8``. For each case and implementation,
    ``(out, lse)`` and the gradients ``dq, dk, dv`` of ``Σ out·w_out + Σ lse·w_lse`` are compared with a
    float64 NumPy oracle (module docstring).

    Args:
      implementations: names as in ``jax.nn.dot_product_attention``: ``"xla"``, ``"cudnn"``, ``"pallas"``,
        ``"blockwise"`` (default all four; those the platform cannot run come back as unsupported, with
        the reason).
      dtypes, masks, heads, lengths: the grid's axes (defaults: 4 × 4 × 2 × 3 = 96 cases).
      interpret: run the Pallas GPU kernel in Pallas's interpret mode; ``None`` means on CPU only.
      block_q, block_k: the tiles of ``"blockwise"`` (small, so that the cases span several tiles).
      seed: the inputs' random seed.
      progress: called with each record as it is made.

    Returns:
      One record per (case, implementation): ``case`` (shapes, mask, dtype), ``label``, ``implementation``,
      ``status`` (``"pass"``, ``"fail"`` or ``"unsupported"``), ``errors`` (normwise relative error of each
      of out, lse, dq, dk, dv), ``tolerance``, or ``reason`` (unsupported). :func:`conformance_table`
      renders them.
    """
    cases = grid(dtypes, masks, heads, lengths)
    return _check(cases, implementations, interpret=interpret, block_q=block_q, block_k=block_k, seed=seed,
                  progress=progress)


def _check(cases, implementations=None, *, interpret=None, block_q=16, block_k=16, seed=0, progress=None):
    implementations = list(IMPLEMENTATIONS) if implementations is None else list(implementations)
    for name in implementations:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"implementations must be names from {list(IMPLEMENTATIONS)}, received {name!r}")
    platform = jax.default_backend()
    interpret = platform == "cpu" if interpret is None else bool(interpret)
    records = []
    for case in cases:
        x64 = jax.enable_x64(True) if case.dtype == "float64" else contextlib.nullcontext()
        # float32 and float64 matmuls at full precision (a GPU's default for float32 may be TF32)
        full = contextlib.nullcontext()
        if case.dtype in ("float32", "float64"):
            full = jax.default_matmul_precision("highest")
        with x64, full:
            q, k, v, mask, is_causal, w_out, w_lse = _inputs(case, seed)
            scale = 1.0 / math.sqrt(case.H)
            want = oracle(q, k, v, mask, is_causal, scale, w_out, w_lse)
            shapes = [jax.ShapeDtypeStruct(x.shape, case.dtype) for x in (q, k, v)]
            m = None if mask is None else jnp.asarray(mask)
            for name in implementations:
                record = dict(case=dataclasses.asdict(case), label=case.label, implementation=name)
                reason = unsupported(name, *shapes, m, scale, is_causal, platform=platform,
                                     interpret=interpret and name == "pallas")
                if reason is None:
                    try:
                        got = _run_one(name, case, q, k, v, mask, is_causal, w_out, w_lse, interpret, block_q,
                                       block_k)
                    except NotImplementedError as refusal:
                        if name != "cudnn":
                            raise
                        # jax's cuDNN wrapper checks the call as it traces it (its backward takes a mask or
                        # bias only with even lengths, say): what it refuses, it refuses before XLA runs
                        reason = f"jax's cuDNN wrapper: {refusal}"
                if reason is not None:
                    record = dict(record, status="unsupported", reason=reason)
                else:
                    errors = {quantity: _error(g, w) for quantity, g, w in zip(QUANTITIES, got, want)}
                    tol = TOLERANCE[_effective_dtype(name, case.dtype)]
                    status = "pass" if all(e <= tol for e in errors.values()) else "fail"
                    record = dict(record, status=status, errors=errors, tolerance=tol)
                records.append(record)
                if progress is not None:
                    progress(record)
    return records


def conformance_table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown: what the cells mean, the totals, one table (a row per case, a column per implementation:
    the worst normwise error over out, lse, dq, dk, dv and which, ✓ within the tolerance, ✗ beyond it, "–"
    unsupported), and the reasons for each unsupported implementation."""
    implementations = list(dict.fromkeys(r["implementation"] for r in records))
    labels = list(dict.fromkeys(r["label"] for r in records))
    cell = {(r["label"], r["implementation"]): r for r in records}
    counts = {s: sum(r["status"] == s for r in records) for s in ("pass", "fail", "unsupported")}
    tolerances = ", ".join(f"{d} {t:g}" for d, t in TOLERANCE.items())
    lines = [
        "Each cell: the worst normwise relative error `max|got - oracle| / max|oracle|` over out, lse, dq, dk, dv "
        "(the gradients of `Σ out·w_out + Σ lse·w_lse`), and which; ✓ within the case's tolerance "
        f"({tolerances}; `xla` computes its softmax in float32, so its float64 cases are held to float32's), "
        "✗ beyond it, – the implementation cannot run the case (reasons below). Inputs are rounded to the "
        "case's dtype before the oracle sees them; lse must be -inf exactly where the oracle's is.",
        "",
        f"Totals: {counts['pass']} pass, {counts['fail']} fail, {counts['unsupported']} unsupported.",
        "",
        "| case | " + " | ".join(implementations) + " |",
        "|---" * (len(implementations) + 1) + "|",
    ]
    for label in labels:
        cells = []
        for name in implementations:
            r = cell.get((label, name))
            if r is None:
                cells.append("")
            elif r["status"] == "unsupported":
                cells.append("–")
            else:
                worst = max(r["errors"], key=lambda q: r["errors"][q])
                mark = "✓" if r["status"] == "pass" else "✗"
                cells.append(f"{mark} {r['errors'][worst]:.1e} ({worst})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    reasons = _unsupported_reasons(records)
    if reasons:
        lines += ["", "Unsupported:", ""] + [f"- `{name}`: " + "; ".join(rs) for name, rs in reasons.items()]
    return "\n".join(lines) + "\n"


def _unsupported_reasons(records: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """For each implementation, the distinct reasons it was unsupported."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r["status"] == "unsupported" and r["reason"] not in out.setdefault(r["implementation"], []):
            out[r["implementation"]].append(r["reason"])
    return {name: reasons for name, reasons in out.items() if reasons}
