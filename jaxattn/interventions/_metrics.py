"""Metrics: functions of a model's output to the scalar every effect table is measured on.

- :func:`span_log_prob`: ``Σ log p(ids[t] | ids[:t])`` over a span of a causal model's logits (padding
  under an attention mask left out, as the models' ``log_prob`` leaves it out);
- :func:`choice_metric`: the log-probability difference between two continuations (a causal LM);
- :func:`similarity_metric`: for an encoder with no language-model head, how much closer the last
  hidden state of one token is to one span's than to another's.

Axis alphabet: C choices, T tokens, V vocabulary, D model width.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _nn
from jaxattn._inputs import attention_mask as check_attention_mask

Array = jax.Array


class LogitMetric:
    """A metric that declares the rows of a causal model's logits it reads: ``LogitMetric(fn, rows)``.

    Calling it calls ``fn(output)``. ``rows`` (a sorted tuple of distinct positions, the same for every
    sequence of a batch) lets the effect tables unembed those rows only: the unembedding of every position
    can cost a fifth of a forward, and the resumed runs hand ``fn`` logits that are NaN elsewhere. The
    clean run checks once that ``fn`` gives the same value with those rows alone (``ValueError`` otherwise;
    under a caller's ``jax.vmap`` or ``jax.jit`` over prompts the run is traced and nothing is checked).
    A plain function is a metric that may read every row.
    """

    def __init__(self, fn: Callable[[Any], Array], rows: Any):
        if not callable(fn):
            raise TypeError(f"fn must be a function output -> scalar, received {type(fn).__name__}")
        self.fn, self.rows = fn, rows

    def __call__(self, output: Any) -> Array:
        return self.fn(output)

    def __repr__(self) -> str:
        return f"LogitMetric({getattr(self.fn, '__name__', self.fn)!r}, rows={self.rows!r})"


class RowMetric:
    """A metric of a causal model's logits at chosen REAL tokens, given those rows alone: ``RowMetric(fn, rows)``.

    ``fn(logits, next_ids) -> scalar`` receives ``logits [R, V]``, the logits at the real tokens ``rows``
    (``k >= 0``: the k-th real token, counted from 0; ``k < 0``: counted from the last, ``-1`` being the
    last real token), and ``next_ids [R]``, the id of the real token after each (the one that row predicts;
    ``-1`` after the last). A batched bound gives ``[B, R, V]`` and ``[B, R]``, each sequence's own rows. A
    row that a sequence does not have (``k`` past its real tokens) comes as NaN logits.

    Positions count real tokens only and ``fn`` never sees a length, so the metric's value does not depend
    on padding, and a table of it does not depend on the prompt's length: :func:`bind` of concrete ids
    (one sequence of a causal model) keeps them padded to their bucket too
    (:func:`jaxattn.models.bucket_length`), and :func:`ablation_effects`, :func:`patching_effects` (resumed;
    the patch value is padded with the prompt, its padded rows never patched), :func:`joint_patching_effect`,
    :func:`gate_gradients`,
    :func:`layer_gradients`, :func:`attention_gradient`, :func:`attribution_patching` (their arrays cut to
    the prompt's length on the host) and :func:`metric_value` of a ``RowMetric`` run there, so a new prompt
    whose length falls in a bucket already run compiles nothing new. The tables unembed the declared rows
    only.

    Two ``RowMetric`` of equal ``fn`` (the same function, or the same bound method) and ``rows`` are equal
    and share the tables' compiled programs; a new ``fn`` (a new lambda) is a new program. Position-site
    patching of all positions runs over the bucket's (without ``mesh=``); with ``positions=`` each number of selected positions
    is a program.

    Example: ``RowMetric(lambda lg, nxt: lg[0, paris] - lg[0, rome], rows=(-1,))``, the logit difference at
    the last token; ``RowMetric(lambda lg, nxt: jnp.sum(jax.nn.log_softmax(lg)[jnp.arange(3), nxt]),
    rows=(-4, -3, -2))``, the log-probability of the last three tokens.

    Raises:
      TypeError, ValueError: naming ``fn`` (not callable) or ``rows`` (not a non-empty sequence of ints).
    """

    def __init__(self, fn: Callable[[Array, Array], Array], rows: Any):
        if not callable(fn):
            raise TypeError(f"fn must be a function (logits [R, V], next_ids [R]) -> scalar, received "
                            f"{type(fn).__name__}")
        if isinstance(rows, (str, bytes)) or not isinstance(rows, (tuple, list, np.ndarray)) or np.ndim(rows) != 1 or len(rows) == 0 or \
                any(isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)) or not -2**31 <= r < 2**31
                    for r in rows):
            raise ValueError(f"rows must be a non-empty sequence of ints in [-2**31, 2**31) (real-token indices; "
                             f"negative counts from the last real token), received {rows!r}")
        self.fn, self.rows = fn, tuple(int(r) for r in rows)

    def __call__(self, logits: Any, next_ids: Any) -> Array:
        return self.fn(logits, next_ids)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, RowMetric) and other.fn == self.fn and other.rows == self.rows

    def __hash__(self) -> int:
        return hash((RowMetric, self.fn, self.rows))

    def __repr__(self) -> str:
        return f"RowMetric({getattr(self.fn, '__name__', self.fn)!r}, rows={self.rows!r})"


def span_log_prob(logits: Any, ids: Any, start: Any, end: Any, *, attention_mask: Any = None) -> Array:
    """``Σ_{start <= t < end} log p(ids[t] | the real tokens before t)``: a span's log-probability (nats).

    Token ``t`` is scored from the logits of the last real token before it. Without ``attention_mask``
    every token is real and that is row ``t - 1``: ``Σ log softmax(logits[t - 1])[ids[t]]``. With one,
    padding anywhere (left, right, inside) gives the score of the sequence alone: padded positions never
    count, and a real token is scored from the row of the last real token before it. A token with no real
    token before it (position 0, or the first real token) has no prediction and never counts. One
    implementation serves this function and the causal models' ``log_prob``: ``jaxattn.gpt2.log_prob(params,
    config, ids, attention_mask=m, start=s, end=e)`` is this function of ``forward``'s logits (in float32)
    with the same mask and span.

    Args:
      logits: ``[T, V]`` a causal model's next-token logits (row ``t`` predicts token ``t + 1``).
      ids: ``[T]`` the tokens.
      start, end: the span of positions ``[start, end)`` of the (padded) array, ``0 <= start <= end <= T``
        (may be traced; position 0 never counts).
      attention_mask: ``[T]``, 1 (or True) for a real token, 0 for padding, as the models take it;
        ``None``: every token is real.

    Returns:
      a scalar in the logits' dtype, at least float32 (float64 logits give float64).

    Raises:
      ValueError, TypeError: ``logits`` not ``[T, V]`` with the ``T`` of ``ids``, or an ``attention_mask``
        that is not an integer or boolean ``[T]`` of 0 and 1 (values checked when concrete).
    """
    logits = jnp.asarray(logits)
    ids = jnp.asarray(ids)
    if logits.ndim != 2 or ids.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V] and ids [T] with one T, received {logits.shape} and {ids.shape}")
    keep = None if attention_mask is None else check_attention_mask(attention_mask, ids.shape[0])
    return _nn.span_log_prob(logits, ids, start, end, keep)


def choice_metric(choices: Mapping[str, Any]) -> LogitMetric:
    """``output -> log p(choice 0) - log p(choice 1)`` for a bound built on :func:`encode_choices`' rows.

    Args:
      choices: the dict from :func:`jaxattn.interventions.encode_choices` with two choices
        (``input_ids [2, T]``, ``start [2]``, ``end [2]``); bind its ``input_ids`` and ``attention_mask``.

    Returns:
      a metric of a batched causal model's output (``logits [2, T, V]``): positive when the model prefers
      choice 0. It reads the logits rows that predict the choices' tokens only, and declares them (a
      :class:`LogitMetric`: the effect tables then unembed those rows alone).
    """
    ids = np.asarray(choices["input_ids"])
    start, end = np.asarray(choices["start"]), np.asarray(choices["end"])
    if ids.ndim != 2 or ids.shape[0] != 2 or start.shape != (2,) or end.shape != (2,):
        raise ValueError(f"choices must hold two rows: input_ids [2, T], start [2], end [2]; received "
                         f"{ids.shape}, {start.shape}, {end.shape}")
    if np.any(start < 1) or np.any(end <= start) or np.any(end > ids.shape[1]):
        raise ValueError(f"each choice must satisfy 1 <= start < end <= T, received start={start}, end={end}")
    ids_j = jnp.asarray(ids)

    def metric(output: Any) -> Array:
        lp = []
        for i in range(2):  # rows start-1 .. end-1 alone: the span's scores, without a softmax over every row
            a, b = int(start[i]) - 1, int(end[i])
            lp.append(span_log_prob(output.logits[i, a:b], ids_j[i, a:b], 1, b - a))
        return lp[0] - lp[1]

    return LogitMetric(metric, tuple(sorted({t for i in range(2) for t in range(int(start[i]) - 1, int(end[i]) - 1)})))


def _unit(x: Array) -> Array:
    return x / jnp.maximum(jnp.linalg.norm(x), 1e-12)


def _position(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int (a token position), received {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0 (a token position; no negative indexing), received {x}")
    return int(x)


def _span(span: Any, name: str) -> tuple[int, int]:
    if isinstance(span, (str, bytes)) or not isinstance(span, (tuple, list)) or len(span) != 2:
        raise ValueError(f"{name} must be (start, stop) with 0 <= start < stop, received {span!r}")
    start, stop = (_position(x, name) for x in span)
    if not start < stop:
        raise ValueError(f"{name} must be (start, stop) with 0 <= start < stop, received {span!r}")
    return start, stop


def similarity_metric(token: int, span_a: tuple[int, int], span_b: tuple[int, int]) -> Callable[[Any], Array]:
    """``output -> cos(h[token], h̄_a) - cos(h[token], h̄_b)`` on an encoder's ``last_hidden_state [T, D]``.

    ``h̄`` is the mean of a span's hidden states. Needs no language-model head: for the trophy sentence,
    positive when the pronoun's final state is closer to "trophy" than to "suitcase".

    Args:
      token: the position ``0 <= token < T`` of the token compared (no negative indexing).
      span_a, span_b: ``(start, stop)`` token positions, ``0 <= start < stop <= T``.

    Raises:
      TypeError, ValueError: at construction, for a position that is not an int >= 0 or a span that is
        not ``(start, stop)``; when the metric is called, for an output whose ``last_hidden_state`` is not
        ``[T, D]`` (a batched output: bind one input) or that has fewer tokens than ``token`` or a span
        needs (shapes are static, so this holds under ``jax.jit`` too).
    """
    token = _position(token, "token")
    span_a, span_b = _span(span_a, "span_a"), _span(span_b, "span_b")

    def metric(output: Any) -> Array:
        h = getattr(output, "last_hidden_state", None)
        if h is None:
            raise TypeError(f"similarity_metric: the output must have a last_hidden_state [T, D], received "
                            f"{type(output).__name__} without one")
        if jnp.ndim(h) != 2:
            raise ValueError(f"similarity_metric: the output's last_hidden_state must be [T, D] (bind one input, "
                             f"not a batch), received shape {tuple(jnp.shape(h))}")
        T = h.shape[0]
        if token >= T:
            raise ValueError(f"token must be a position < T = {T} (the output's tokens), received {token}")
        for name, span in (("span_a", span_a), ("span_b", span_b)):
            if span[1] > T:
                raise ValueError(f"{name} must end at or before T = {T} (the output's tokens), received {span!r}")
        h = h.astype(jnp.promote_types(h.dtype, jnp.float32))  # [T, D], at least float32
        p = _unit(h[token])  # [D]
        a = _unit(jnp.mean(h[span_a[0]:span_a[1]], axis=0))  # [D]
        b = _unit(jnp.mean(h[span_b[0]:span_b[1]], axis=0))  # [D]
        return jnp.dot(p, a) - jnp.dot(p, b)

    return metric
