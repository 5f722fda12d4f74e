"""Flax NNX attention whose core is jaxattn's: a drop-in ``MultiHeadAttention`` and an ``attention_fn``.

- :func:`dot_product_attention` has the signature of ``flax.nnx.dot_product_attention`` (Flax's
  ``attention_fn``) and computes with :func:`jaxattn.multi_head_attention`, so the maps a Flax model sows
  (``module.sow(nnx.Intermediate, "attention_weights", ...)``) are jaxattn's. Plug it into any Flax
  module that takes an ``attention_fn``.
- :class:`MultiHeadAttention` is ``flax.nnx.MultiHeadAttention`` with that ``attention_fn`` as its
  default: the same constructor (``num_heads`` first, ``in_features`` second, ``rngs`` keyword), the
  same parameters (``query.kernel [D, N, H]``, ``out.kernel [N, H, D]``, biases by default), the same
  call (leading batch dims, ``inputs_k``/``inputs_v``, ``mask``, dropout, ``decode`` with
  ``init_cache``, ``sow_weights``), so a state moves between the two unchanged.

Axis alphabet as in :mod:`jaxattn._attention`; ``batch...`` is any number of leading batch axes.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn._attention import multi_head_attention
from jaxattn._checks import as_float_array, check_broadcastable, check_flag
from jaxattn._extras import require

require("nnx", "jaxattn.nnx", "flax")

from flax import nnx  # noqa: E402  (after the check, so a missing flax names the extra)
from flax.nnx.nn import dtypes  # noqa: E402

Array = jax.Array

__all__ = ["MultiHeadAttention", "dot_product_attention"]


_PRECISION_HELP = ("precision must be None, a jax.lax.Precision, its name ('default', 'high', 'highest', "
                   "'bfloat16', 'tensorfloat32', 'float32') or a pair of two equal ones")


def _precision_name(precision: Any) -> str | None:
    """Flax's ``precision`` (None, a ``lax.Precision``, its name, or a pair of one) as the name
    ``jax.default_matmul_precision`` takes; anything else raises, naming ``precision``."""
    if precision is None:
        return None
    one = precision
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or precision[0] != precision[1]:
            raise ValueError(f"{_PRECISION_HELP}, received {precision!r}")
        one = precision[0]
    if isinstance(one, str):
        try:
            one = jax.lax.Precision(one)
        except ValueError:
            raise ValueError(f"{_PRECISION_HELP}, received {precision!r}") from None
    if isinstance(one, jax.lax.Precision):
        return one.name.lower()
    raise TypeError(f"{_PRECISION_HELP}, received {precision!r}")


def _matmul_precision(precision: Any) -> Any:
    """A context applying Flax's ``precision`` to the matmuls of jaxattn's core, which take no
    ``precision`` argument of their own."""
    name = _precision_name(precision)
    return contextlib.nullcontext() if name is None else jax.default_matmul_precision(name)


def _check_qkv(query: Array, key: Array, value: Array) -> None:
    """The shapes of ``query [batch..., T, N, H]``, ``key [batch..., S, K, H]``, ``value [batch..., S, K, V]``.

    Each message names the arguments and their shapes, and ends with the words of Flax's own check
    (``q, k, v must have same rank``, ``... batch dims must match``, ``k, v lengths must match``,
    ``q, k depths must match``, ``Query heads (N) must be multiple of Key heads (K)``), so code that
    matches Flax's errors matches these too.
    """
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if not len(q) == len(k) == len(v):
        raise ValueError(
            f"query, key and value must have the same rank: query has shape {q} [batch..., T, N, H], key {k} "
            f"[batch..., S, K, H], value {v} [batch..., S, K, V]; q, k, v must have same rank, but got "
            f"{len(q)}, {len(k)}, {len(v)}"
        )
    if len(q) < 3:
        raise ValueError(f"query must have shape [batch..., T, N, H] (3 or more dimensions), received {q}")
    for name, x, axes in (("key", k, "[batch..., S, K, H]"), ("value", v, "[batch..., S, K, V]")):
        if x[:-3] != q[:-3]:
            raise ValueError(
                f"{name} must have shape {axes} with the batch dims of query {q} [batch..., T, N, H], i.e. "
                f"{q[:-3]}, received {x}; q, k, v batch dims must match, but got shapes {q}, {k}, {v}"
            )
    if k[-3] != v[-3]:
        raise ValueError(
            f"key and value must have the same length S: key has shape {k}, value has shape {v}; "
            f"k, v lengths must match, but got {k[-3]} and {v[-3]}"
        )
    if q[-1] != k[-1]:
        raise ValueError(
            f"query and key must have the same head dimension H: query has shape {q} [batch..., T, N, H], key "
            f"{k} [batch..., S, K, H]; q, k depths must match, but got {q[-1]} and {k[-1]}"
        )
    if k[-2] and q[-2] % k[-2]:  # K = 0: the core names the empty axis
        raise ValueError(
            f"the number of query heads N must be a multiple of the number of key/value heads K (grouped-query "
            f"attention): query has shape {q}, N={q[-2]}, key {k}, K={k[-2]}; Query heads ({q[-2]}) must be "
            f"multiple of Key heads ({k[-2]})"
        )


def _check_dropout_rate(rate: Any) -> float:
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"dropout_rate must be a Python float in [0, 1), received {rate!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), received {rate}")
    return float(rate)


def _over_batch(attend: Any, q: Array, k: Array, v: Array, m: Array | None, b: Array | None, nb: int) -> Any:
    """``attend`` on each example: one ``jax.vmap`` per batch dim (no reshape, so a sharded batch stays so).

    ``m``, ``b``: None or of rank ``nb + 3``; a batch dim of size 1 is not mapped (the mask or bias is
    the same for every example along it), so a shared mask reaches the core in its compact shape.
    """
    if nb == 0:
        return attend(q, k, v, m, b)
    axis = lambda x: None if x is None or x.shape[0] == 1 else 0
    first = lambda x: x if x is None or axis(x) == 0 else x[0]
    inner = lambda q, k, v, m, b: _over_batch(attend, q, k, v, m, b, nb - 1)
    return jax.vmap(inner, in_axes=(0, 0, 0, axis(m), axis(b)))(q, k, v, first(m), first(b))


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Any = dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    scale: Any = None,
) -> Array:
    """``flax.nnx.dot_product_attention`` computed by :func:`jaxattn.multi_head_attention`.

    A Flax ``attention_fn``: pass it to ``flax.nnx.MultiHeadAttention(attention_fn=...)`` (or use
    :class:`MultiHeadAttention`, where it is the default). Each example is
    :func:`jaxattn.multi_head_attention` (``jax.vmap`` over the batch dims), so with ``module`` given the
    sown ``attention_weights [batch..., N, T, S]`` are exactly the maps jaxattn's functions and probes
    return, and the output is computed from them. Differences from Flax's function: the softmax runs in
    at least float32; a query row whose keys are all masked gives zero weights and a zero output (Flax
    gives the mean of the values); without dropout, masked positions never leak a NaN or Inf (see
    :func:`jaxattn.attention`).

    Args:
      query: ``[batch..., T, N, H]``.
      key: ``[batch..., S, K, H]``, ``N % K == 0`` (grouped-query heads: query head ``n`` reads ``n // G``).
      value: ``[batch..., S, K, V]``.
      bias: optional additive logit bias broadcastable to ``[batch..., N, T, S]``.
      mask: optional keep-mask broadcastable to ``[batch..., N, T, S]`` (True or nonzero = attend), as
        Flax's masks (``make_attention_mask``, ``make_causal_mask``, ``combine_masks``) are.
      broadcast_dropout: one dropout pattern ``[T, S]`` for every batch entry and head (Flax's default).
      dropout_rng: the key for dropout; required when ``dropout_rate > 0`` and not ``deterministic``.
      dropout_rate: probability of dropping an attention weight (weights kept are scaled by
        ``1 / (1 - rate)``); drawn as Flax draws it, so a given key drops the same weights.
      deterministic: no dropout.
      dtype: the dtype q, k, v are promoted to (None: their common dtype), as in Flax.
      precision: matmul precision of the attention core, as in Flax.
      module: the module that sows ``attention_weights`` (before dropout) into ``nnx.Intermediate``;
        None sows nothing.
      promote_dtype: Flax's dtype promotion function for ``(query, key, value)``.
      is_causal: also apply :func:`jaxattn.causal_mask` ``(T, S)``.
      scale: jaxattn's logit scale, keyword only; None means ``1/sqrt(H)`` (Flax's), ``1.0`` is unscaled
        (``functools.partial(dot_product_attention, scale=1.0)`` as an ``attention_fn``).

    Returns:
      ``[batch..., T, N, V]`` in the promoted dtype.
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    query, key, value = (as_float_array(x, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    _check_qkv(query, key, value)
    batch = tuple(query.shape[:-3])
    mask, bias = _mask_and_bias(mask, bias, batch + (query.shape[-2], query.shape[-3], key.shape[-3]))
    is_causal = check_flag(is_causal, "is_causal")
    dropout = not check_flag(deterministic, "deterministic") and _check_dropout_rate(dropout_rate) > 0.0
    if dropout and dropout_rng is None:
        raise ValueError(f"dropout_rng is required for dropout_rate={dropout_rate} when deterministic is False")

    attend = lambda q, k, v, m, b: multi_head_attention(q, k, v, mask=m, bias=b, scale=scale, is_causal=is_causal)
    nb = len(batch)
    as_rank = lambda x: None if x is None else x.reshape((1,) * (nb + 3 - x.ndim) + tuple(x.shape))
    with _matmul_precision(precision):
        out, weights = _over_batch(attend, query, key, value, as_rank(mask), as_rank(bias), nb)
        # out [batch..., T, N, V], weights [batch..., N, T, S]
        if module is not None:
            module.sow(nnx.Intermediate, "attention_weights", weights)
        if dropout:
            out = _dropped_out(weights, value, dropout_rng, dropout_rate, broadcast_dropout, precision)
            out = out.astype(query.dtype)  # [batch..., T, N, V]
    return out


def _mask_and_bias(mask: Any, bias: Any, target: tuple[int, ...]) -> tuple[Array | None, Array | None]:
    """The mask (bool: Flax's masks may be float, nonzero = attend) and the bias, checked to broadcast to
    ``target = [batch..., N, T, S]``."""
    axes = "[batch..., N, T, S]"
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
        check_broadcastable(mask, target, "mask", axes)
    if bias is not None:
        bias = as_float_array(bias, "bias")
        check_broadcastable(bias, target, "bias", axes)
    return mask, bias


def _dropped_out(weights: Array, value: Array, rng: Array, rate: float, broadcast: bool, precision: Any) -> Array:
    """``out [batch..., T, N, V]`` from ``weights [batch..., N, T, S]`` after dropout, drawn as Flax draws it:
    a keep pattern ``[T, S]`` shared by batch and heads (``broadcast``), or one per weight; the weights
    kept are scaled by ``1 / (1 - rate)``. ``value [batch..., S, K, V]``."""
    *batch, N, T, S = weights.shape
    batch = tuple(batch)
    K = value.shape[-2]
    keep_prob = 1.0 - rate
    shape = (1,) * (len(batch) + 1) + (T, S) if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, keep_prob, shape)  # [batch... or 1, N or 1, T, S]
    dropped = weights * (keep.astype(weights.dtype) / jnp.asarray(keep_prob, weights.dtype))
    dropped = dropped.reshape(batch + (K, N // K, T, S))  # [batch..., K, G, T, S]
    out = jnp.einsum("...KGTS,...SKV->...TKGV", dropped, value, precision=precision)
    return out.reshape(batch + (T, N, value.shape[-1]))  # [batch..., T, N, V]


class MultiHeadAttention(nnx.MultiHeadAttention):
    """``flax.nnx.MultiHeadAttention`` computing with jaxattn: the default ``attention_fn`` is
    :func:`dot_product_attention`.

    Everything else is Flax's: the constructor (``MultiHeadAttention(num_heads, in_features,
    qkv_features=None, out_features=None, ..., use_bias=True, rngs=...)``), the parameters and their
    initialisation (the same ``rngs`` give the same weights), ``__call__(inputs_q, inputs_k=None,
    inputs_v=None, *, mask=None, deterministic=None, rngs=None, sow_weights=False, decode=None,
    is_causal=False)`` returning ``[batch..., T, out_features]``, ``init_cache`` and decoding. With
    ``sow_weights=True`` the maps ``[batch..., N, T, S]`` are sown as ``attention_weights`` in
    ``nnx.Intermediate``, as Flax sows them. A state moves between this module and Flax's with
    ``nnx.update(other, nnx.state(module))`` or ``nnx.merge(nnx.graphdef(other), nnx.state(module))``.

    Unlike Flax's module, the arguments are checked before anything is computed: ``num_heads`` and
    ``num_kv_heads`` must be ints >= 1 and the feature sizes ints >= 1 (``TypeError``/``ValueError``
    naming them), ``precision`` as in :func:`dot_product_attention`; at call time ``inputs_k`` and
    ``inputs_v`` must end in ``in_kv_features`` (``inputs_k=None`` reads ``inputs_q``, so then
    ``in_kv_features`` must equal ``in_features``) and share ``inputs_q``'s batch dims, and ``inputs_v``
    must have ``inputs_k``'s length (``ValueError`` naming them). When decoding, a step past the cache
    (``cache_index >= max_length`` of ``init_cache``) raises a ``ValueError`` naming the cache length and
    the step index while the index is concrete (eager use); under ``jax.jit``/``nnx.jit`` the index is
    traced, so that step's output is NaN instead (the cache's last slot is overwritten, as in Flax,
    and every later step is NaN too).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("attention_fn", dot_product_attention)  # keyword-only in Flax's signature
        _check_init(inspect.signature(nnx.MultiHeadAttention.__init__).bind(self, *args, **kwargs).arguments)
        super().__init__(*args, **kwargs)

    def __call__(self, inputs_q: Any, inputs_k: Any = None, inputs_v: Any = None, **kwargs: Any) -> Array:
        """Flax's call, with its inputs checked first (see the class docstring)."""
        _check_inputs(self, inputs_q, inputs_k, inputs_v)
        decode = kwargs.get("decode")
        decode = self.decode if decode is None else decode
        step = _decode_step(self) if decode else None
        out = super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
        if step is not None:  # a traced step: a step past the cache gives NaN
            index, length = step
            out = jnp.where(index < length, out, jnp.asarray(jnp.nan, out.dtype))
        return out

    def params(self) -> dict[str, Array]:
        """The weights as the plain dict :func:`jaxattn.attention_layer` takes (``W_Q [D, N·H]``, ...).

        ``attention_layer(m.params(), x, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads)`` equals
        ``m(x)`` for one example ``x [T, D]`` without dropout; ``context=`` stands for ``inputs_k``.
        """
        if self.normalize_qk:
            raise ValueError(
                "params() has no place for the query/key LayerNorms of normalize_qk=True: "
                "jaxattn.attention_layer projects without them"
            )
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        params = {
            "W_Q": self.query.kernel[...].reshape(self.in_features, N * H),
            "W_K": self.key.kernel[...].reshape(self.in_kv_features, K * H),
            "W_V": self.value.kernel[...].reshape(self.in_kv_features, K * H),
            "W_O": self.out.kernel[...].reshape(N * H, -1),
        }
        if self.use_bias:
            params.update(
                b_Q=self.query.bias[...].reshape(N * H),
                b_K=self.key.bias[...].reshape(K * H),
                b_V=self.value.bias[...].reshape(K * H),
                b_O=self.out.bias[...].reshape(-1),
            )
        return params


def _check_count(value: Any, name: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1{' or None' if optional else ''}, received {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if optional else ''}, received {value}")


def _check_init(arguments: dict[str, Any]) -> None:
    """The constructor's arguments that Flax uses without checking (a zero head count divides by zero)."""
    _check_count(arguments.get("num_heads"), "num_heads")
    _check_count(arguments.get("in_features"), "in_features")
    for name in ("qkv_features", "out_features", "num_kv_heads", "in_kv_features"):
        _check_count(arguments.get(name), name, optional=True)
    _precision_name(arguments.get("precision"))


def _check_inputs(m: MultiHeadAttention, inputs_q: Any, inputs_k: Any, inputs_v: Any) -> None:
    q = jnp.shape(inputs_q)
    if len(q) < 2:
        raise ValueError(f"inputs_q must have shape [batch..., T, in_features={m.in_features}], received {q}")
    if inputs_k is None:
        if inputs_v is None and m.in_kv_features != m.in_features:
            raise ValueError(
                f"inputs_k is required: without it the keys are read from inputs_q, whose features "
                f"({m.in_features}, in_features) are not in_kv_features ({m.in_kv_features})"
            )
        return  # Flax refuses inputs_v without inputs_k
    k = jnp.shape(inputs_k)
    if len(k) != len(q) or k[:-2] != q[:-2] or k[-1] != m.in_kv_features:
        raise ValueError(
            f"inputs_k must have shape [batch..., S, in_kv_features] = [{', '.join(map(str, q[:-2] + ('S',)))}, "
            f"{m.in_kv_features}] (the batch dims of inputs_q {q}), received {k}"
        )
    if inputs_v is not None:
        v = jnp.shape(inputs_v)
        if v[:-1] != k[:-1] or v[-1] != m.in_kv_features:
            raise ValueError(
                f"inputs_v must have shape {k[:-1] + (m.in_kv_features,)} (inputs_k's batch dims and length, "
                f"in_kv_features), received {v}"
            )


def _decode_step(m: MultiHeadAttention) -> tuple[Array, int] | None:
    """Refuse a decoding step past the cache when its index is concrete; ``(index, max_length)`` when traced
    (the caller then marks the output), None when there is no cache (Flax's own error follows)."""
    cached_key, cache_index = getattr(m, "cached_key", None), getattr(m, "cache_index", None)
    if cached_key is None or cache_index is None:
        return None
    length = int(cached_key.shape[-3])  # [batch..., max_length, K, H]
    index = cache_index[...]
    if isinstance(index, jax.core.Tracer):
        return index, length
    if int(index) >= length:
        raise ValueError(
            f"decode: step index {int(index)} is past the cache's length {length} (init_cache gave room for "
            f"{length} steps, 0 to {length - 1}); call init_cache with a longer input_shape"
        )
    return None


def _with_default(init: Any, **defaults: Any) -> inspect.Signature:
    signature = inspect.signature(init)
    return signature.replace(
        parameters=[p.replace(default=defaults.get(p.name, p.default)) for p in signature.parameters.values()]
    )


# help() and IDEs show Flax's constructor, with jaxattn's attention_fn as the default
MultiHeadAttention.__init__.__signature__ = _with_default(
    nnx.MultiHeadAttention.__init__, attention_fn=dot_product_attention
)
MultiHeadAttention.__call__.__signature__ = inspect.signature(nnx.MultiHeadAttention.__call__)
