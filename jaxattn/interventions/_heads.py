"""Every head's query-key weights and inputs, read from a bundled model, for the entropy bound.

:func:`qk_weights` asks a model (the protocol of :mod:`jaxattn.models`) for ``W_Q``, ``b_q``, ``W_K`` per
layer and head; :func:`entropy_bounds` runs the model once, rebuilds each layer's attention input (the
block's normalisation of ``resid_pre``, ``module.attention_input``) and compares :func:`jaxattn.probes.entropy_lower_bound` with
the entropy of the rows the model produced.

Axis alphabet: L layers, N query heads, K key/value heads, T tokens, D model width, H head dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.models import QKWeights, spec
from jaxattn.probes import entropy, entropy_floor, logit_spread_bound, qk_spectral_norm

Array = jax.Array


def qk_weights(module: Any, params: Any, config: Any) -> QKWeights:
    """``W_Q``, ``b_q``, ``W_K``, ``b_k`` of every head, as ``q = x W_Q + b_q`` on its input: the model's own
    ``module.qk_weights(params, config)`` (the model protocol, :mod:`jaxattn.models`)."""
    return _protocol(module, "qk_weights")(params, config)


def attention_inputs(module: Any, params: Any, config: Any, resid_pre: Any) -> Array:
    """``[L, T, D]``: each layer's attention input from its ``resid_pre [L, T, D]`` (``module.attention_input``)."""
    resid_pre = jnp.asarray(resid_pre, jnp.float32)
    attention_input = _protocol(module, "attention_input")
    return jnp.stack([attention_input(params, config, i, resid_pre[i]) for i in range(resid_pre.shape[0])])


def _protocol(module: Any, name: str) -> Any:
    """The declared protocol's ``name`` (:class:`jaxattn.models.ModelSpec`); ``TypeError`` when it is None."""
    declared = spec(module)
    fn = getattr(declared, name)
    if fn is None:
        raise TypeError(f"this needs the model protocol's {name}, which {declared.name} does not declare")
    return fn


def entropy_bounds(module: Any, params: Any, config: Any, input_ids: Any, *, causal: bool | None = None) -> dict[str, Array]:
    """The entropy floor and the measured entropy of every row of every head on one input.

    Args:
      module, params, config: a model module with the protocol of :mod:`jaxattn.models` (``jaxattn.gpt2``,
        ``jaxattn.bert``, ``jaxattn.llama``, or one of your own).
      input_ids: ``[T]`` token ids.
      causal: whether row i sees only keys ``j <= i``; ``None``: the module's ``CAUSAL``.

    Returns:
      ``{"bound", "entropy", "spread_bound", "spread"}`` each ``[L, N, T]``, and ``"sigma" [L, N]``: the
      floor of :func:`jaxattn.probes.entropy_lower_bound`, the entropy of the model's own rows (nats), the
      bound β on each row's logit spread that the floor comes from and the spread the model's logits
      actually have (largest minus smallest over the keys the row sees), and the spectral norm ``σ``
      behind β (:func:`jaxattn.probes.qk_spectral_norm`).
    """
    ids = np.asarray(input_ids)
    out = spec(module).forward(params, config, ids, capture=("resid_pre", "attn_logits"))
    x = attention_inputs(module, params, config, out.captured["resid_pre"])  # [L, T, D]
    qk = qk_weights(module, params, config)
    N = qk.w_q.shape[1]
    K = qk.w_k.shape[1]
    T = ids.shape[0]
    if qk.qk_norm:
        raise ValueError("the entropy bound needs q and k linear in the attention input; this model normalises "
                         "q and k per head (qk_norm), so the bound does not apply")
    causal = spec(module).causal if causal is None else causal
    keep = jnp.tril(jnp.ones((T, T), bool)) if causal else jnp.ones((T, T), bool)
    sizes = _protocol(module, "sizes")(config)
    t = jnp.arange(T)
    windows = sizes.layer_windows or (sizes.window,) * x.shape[0]  # each layer's sliding window (None: all keys)
    keep = jnp.stack([keep if w is None else keep & (t[:, None] - t[None, :] < w) for w in windows])  # [L, T, T]

    def one(x, w_q, b_q, w_k, b_k, mask):
        return logit_spread_bound(x, w_q, w_k, b_q=b_q, b_k=b_k, scale=qk.scale, mask=mask, rotary=qk.rotary)

    def sigma(w_q, b_q, w_k, b_k):
        return qk_spectral_norm(w_q, w_k, b_q, b_k=b_k, rotary=qk.rotary)

    w_k = jnp.repeat(qk.w_k, N // K, axis=1)  # [L, N, D, H]: query head n reads key head n // (N/K)
    b_k = None if qk.b_k is None else jnp.repeat(qk.b_k, N // K, axis=1)  # [L, N, H]
    per_head = jax.vmap(jax.vmap(one, in_axes=(None, 0, 0, 0, 0, None)))  # a None bias has no leaves to map
    beta = jax.jit(per_head)(x, qk.w_q, qk.b_q, w_k, b_k, keep)  # [L, N, T]
    sig = jax.vmap(jax.vmap(sigma))(qk.w_q, qk.b_q, w_k, b_k)  # [L, N]
    a = out.captured["attn_logits"].astype(jnp.float32)  # [L, N, T, T]
    rows = keep[:, None]  # [L, 1, T, T]
    spread = jnp.max(jnp.where(rows, a, -jnp.inf), -1) - jnp.min(jnp.where(rows, a, jnp.inf), -1)  # [L, N, T]
    return {"bound": entropy_floor(beta, jnp.sum(rows, axis=-1), max_keys=T), "entropy": entropy(out.attentions, rows),
            "sigma": sig, "spread_bound": beta, "spread": spread}
