"""Does it train without √d_k? A small decoder-only Transformer, a task that needs attention, and the
probes logged at every training step.

The model is GPT-2's pre-LayerNorm block (``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, tied embeddings)
written as plain functions over a params pytree, picoGPT style. Its attention is the core's
:func:`jaxattn.multi_head_attention` with ``is_causal=True``; the query-key ``scale`` is an argument
(``None`` = ``1/sqrt(d_k)``, ``1.0`` = unscaled, or any float, also a traced one so that scaled and
unscaled runs are one compiled program), and ``qk_layernorm`` optionally normalises q and k per head
before the dot product (Wortsman et al. 2023). The probes (:mod:`jaxattn.probes`) read the maps, the
logits and the gradient at the logits that this one forward pass produces.

The task, :func:`recall_batch`, is multi-query associative recall: ``P`` key-value pairs, then ``Q`` of
the keys again, each followed by its value. The value after a query key can only be found by looking back
at the pair holding that key, so a model that cannot attend stays at chance (``log n_values`` nats).
Every batch is drawn from ``(seed, step)`` inside the compiled step: no data files, and a run is a pure
function of its seed.

Training (:func:`train`) is AdamW with linear warm-up, cosine decay, global-norm clipping and decoupled
weight decay on matrices (:class:`OptConfig`). Many runs with the same shapes (seeds × learning rates ×
scales) are one ``jax.vmap`` of the step, scanned over steps with ``jax.lax.scan``.

Axis alphabet as in the core (:mod:`jaxattn`) (T positions, S = T keys, N heads, H = d_k, D model
width), plus L layers, B batch, C vmapped runs; ``n_vocab`` is written out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._attention import attention_logits, init_attention_params, merge_heads, multi_head_attention, split_heads
from jaxattn._checks import as_key, check_int, check_scale
from jaxattn._extras import require
from jaxattn._masks import causal_mask
from jaxattn._nn import layer_norm
from jaxattn.probes import head_entropy, softmax_jacobian_norms

require("train", "jaxattn.train", "optax")

import optax  # noqa: E402  (after the check, so a missing optax names the extra)

Array = jax.Array
_LN_EPS = 1e-5  # LayerNorm epsilon (GPT-2's)

__all__ = [
    "METRICS",
    "ModelConfig",
    "OptConfig",
    "RecallTask",
    "forward",
    "init_params",
    "init_state",
    "loss_fn",
    "lr_schedule",
    "optimizer",
    "recall_batch",
    "resolve_scale",
    "summarize",
    "train",
    "train_step",
]

# ----------------------------------------------------------------------------------------------------
# Configurations (frozen dataclasses: hashable, so they are static arguments of the compiled step).
# ----------------------------------------------------------------------------------------------------


def _non_negative_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, received {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall, one token per key-value pair.

    A sequence is ``(k_1,v_1) … (k_P,v_P)  q_1 a_1 … q_Q a_Q``: ``P`` pair tokens with distinct keys
    drawn from ``n_keys`` and values drawn uniformly from ``n_values`` (pair ``(k, v)`` is token id
    ``k·n_values + v``), then ``Q`` distinct keys among the ``P`` as query tokens (id
    ``n_keys·n_values + k``), each followed by its value as an answer token (id
    ``n_keys·n_values + n_keys + v``). The model reads ``seq[:-1]`` and is scored only at the query
    positions, on predicting the answer. The answer is in the pair token whose key matches the query:
    one attention head whose query-key product matches keys, and whose value path reads out the value
    half, solves it; without attention the best is chance over the values.
    """

    num_pairs: int = 8
    num_queries: int = 4
    n_keys: int = 8
    n_values: int = 8

    def __post_init__(self):
        for name in ("num_pairs", "num_queries", "n_keys", "n_values"):
            check_int(getattr(self, name), name)
        if self.num_pairs > self.n_keys:
            raise ValueError(f"num_pairs ({self.num_pairs}) must be <= n_keys ({self.n_keys}): keys are distinct")
        if self.num_queries > self.num_pairs:
            raise ValueError(f"num_queries ({self.num_queries}) must be <= num_pairs ({self.num_pairs})")

    @property
    def n_vocab(self) -> int:
        return self.n_keys * self.n_values + self.n_keys + self.n_values

    @property
    def length(self) -> int:
        """T, the number of input positions (the sequence minus its last token)."""
        return self.num_pairs + 2 * self.num_queries - 1

    @property
    def chance_loss(self) -> float:
        """``log n_values``: the loss of a model that knows the answer is a value but not which one."""
        return math.log(self.n_values)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of the decoder. ``head_dim`` is the paper's d_k (H); it need not be ``d_model / num_heads``."""

    n_vocab: int = 80
    n_ctx: int = 15
    d_model: int = 64
    num_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    mlp_ratio: int = 4
    qk_layernorm: bool = False

    def __post_init__(self):
        for name in ("n_vocab", "n_ctx", "d_model", "num_heads", "head_dim", "num_layers", "mlp_ratio"):
            check_int(getattr(self, name), name)
        if not isinstance(self.qk_layernorm, bool):
            raise TypeError(f"qk_layernorm must be a bool, received {self.qk_layernorm!r}")

    @classmethod
    def for_task(cls, task: RecallTask, **kwargs: Any) -> "ModelConfig":
        """A config whose vocabulary and context fit ``task``."""
        return cls(n_vocab=task.n_vocab, n_ctx=task.length, **kwargs)


@dataclasses.dataclass(frozen=True)
class OptConfig:
    """The optimizer recipe (AdamW, as in GPT-style training; the defaults are those of docs/training.md).

    ``lr(t) = peak · w(t)``, ``w`` rising linearly from 0 to 1 over ``warmup_steps``, then a cosine to
    ``final_lr_fraction`` at ``total_steps``. Gradients are clipped to global norm ``clip_norm`` before
    Adam (``b1``, ``b2``, ``eps``); decoupled weight decay ``weight_decay · lr(t) · θ`` on matrices and
    embeddings (arrays with 2+ axes), none on LayerNorm gains and biases. ``batch_size`` sequences per step.
    """

    total_steps: int = 300
    warmup_steps: int = 30
    batch_size: int = 32
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    final_lr_fraction: float = 0.1

    def __post_init__(self):
        check_int(self.total_steps, "total_steps")
        check_int(self.batch_size, "batch_size")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"warmup_steps must be an int in [0, total_steps={self.total_steps}), received {self.warmup_steps!r}"
            )
        for name in ("b1", "b2", "eps", "weight_decay", "clip_norm", "final_lr_fraction"):
            _non_negative_float(getattr(self, name), name)
        if not (self.b1 < 1 and self.b2 < 1):
            raise ValueError(f"b1 and b2 must be < 1, received b1={self.b1}, b2={self.b2}")
        if self.clip_norm <= 0:
            raise ValueError(f"clip_norm must be > 0, received {self.clip_norm}")


# ----------------------------------------------------------------------------------------------------
# The task.
# ----------------------------------------------------------------------------------------------------


def _recall_example(key: Array, task: RecallTask) -> tuple[Array, Array, Array]:
    P, Q, nk, nv = task.num_pairs, task.num_queries, task.n_keys, task.n_values
    k_keys, k_vals, k_query = jax.random.split(key, 3)
    keys = jax.random.permutation(k_keys, nk)[:P]  # [P], distinct keys
    vals = jax.random.randint(k_vals, (P,), 0, nv)  # [P]
    which = jax.random.permutation(k_query, P)[:Q]  # [Q], distinct pairs to ask for
    pairs = keys * nv + vals  # [P], pair tokens
    asked = nk * nv + keys[which]  # [Q], query tokens
    answers = nk * nv + nk + vals[which]  # [Q], answer tokens
    queries = jnp.stack([asked, answers], axis=1).reshape(2 * Q)  # [2Q]
    seq = jnp.concatenate([pairs, queries]).astype(jnp.int32)  # [P + 2Q]
    t = jnp.arange(P + 2 * Q - 1)  # [T]
    answer_at = jnp.logical_and(t >= P, (t - P) % 2 == 0)  # [T], the query positions
    return seq[:-1], seq[1:], answer_at


def recall_batch(key: Any, task: RecallTask, batch_size: int) -> dict[str, Array]:
    """A batch of :class:`RecallTask` sequences drawn from ``key``.

    Returns:
      dict: ``tokens [B, T]`` int32 (the model's input), ``targets [B, T]`` int32 (the next token),
      ``loss_mask [B, T]`` bool (True at the ``Q`` query positions, where the answer is scored).
    """
    if not isinstance(task, RecallTask):
        raise TypeError(f"task must be a RecallTask, received {type(task).__name__}")
    return _recall_batch(as_key(key), task, check_int(batch_size, "batch_size"))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _recall_batch(key: Array, task: RecallTask, batch_size: int) -> dict[str, Array]:
    keys = jax.random.split(key, batch_size)
    tokens, targets, mask = jax.vmap(_recall_example, in_axes=(0, None))(keys, task)  # [B, T] each
    return {"tokens": tokens, "targets": targets, "loss_mask": mask}


# ----------------------------------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------------------------------


def _normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def _ln_params(width: int) -> dict[str, Array]:
    return {"scale": jnp.ones((width,), jnp.float32), "bias": jnp.zeros((width,), jnp.float32)}


def init_params(key: Any, config: ModelConfig) -> dict:
    """Random parameters of the decoder.

    Embeddings ``wte [n_vocab, D]`` and ``wpe [n_ctx, D]`` from ``N(0, 0.02²)`` (GPT-2). Attention
    weights from :func:`jaxattn.init_attention_params` (``N(0, 1/fan_in)``, zero biases): after the
    block's LayerNorm, q and k then have unit-variance components, so the unscaled logits have variance
    ``d_k`` at initialisation, the regime the chapter describes. MLP ``W_fc [D, mlp_ratio·D]``,
    ``W_proj [mlp_ratio·D, D]`` from ``N(0, 1/fan_in)``, zero biases; LayerNorm gains 1, biases 0; with
    ``qk_layernorm``, per-block ``ln_q``, ``ln_k`` of width H.

    Returns:
      ``{"wte", "wpe", "blocks": [L × {"ln_1", "attn", "ln_2", "mlp"(, "ln_q", "ln_k")}], "ln_f"}``.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, received {type(config).__name__}")
    D, F = config.d_model, config.mlp_ratio * config.d_model
    k_wte, k_wpe, *k_blocks = jax.random.split(as_key(key), 2 + config.num_layers)
    blocks = []
    for kb in k_blocks:
        k_attn, k_fc, k_proj = jax.random.split(kb, 3)
        block = {
            "ln_1": _ln_params(D),
            "attn": init_attention_params(k_attn, D, config.num_heads, head_dim=config.head_dim, use_bias=True),
            "ln_2": _ln_params(D),
            "mlp": {
                "W_fc": _normal(k_fc, (D, F), 1 / math.sqrt(D)),
                "b_fc": jnp.zeros((F,), jnp.float32),
                "W_proj": _normal(k_proj, (F, D), 1 / math.sqrt(F)),
                "b_proj": jnp.zeros((D,), jnp.float32),
            },
        }
        if config.qk_layernorm:
            block["ln_q"] = _ln_params(config.head_dim)
            block["ln_k"] = _ln_params(config.head_dim)
        blocks.append(block)
    return {
        "wte": _normal(k_wte, (config.n_vocab, D), 0.02),
        "wpe": _normal(k_wpe, (config.n_ctx, D), 0.02),
        "blocks": blocks,
        "ln_f": _ln_params(D),
    }


def _linear(x: Array, w: Array, b: Array) -> Array:
    return x @ w + b[None, :]  # [T, out]


def _mlp(p: dict, x: Array) -> Array:
    h = jax.nn.gelu(_linear(x, p["W_fc"], p["b_fc"]), approximate=True)  # [T, F]
    return _linear(h, p["W_proj"], p["b_proj"])  # [T, D]


def _block(p: dict, x: Array, bias: Array, *, config: ModelConfig, scale: Any) -> tuple[Array, Array, Array]:
    a = p["attn"]
    h = layer_norm(x, **p["ln_1"], eps=_LN_EPS)  # [T, D]
    q = split_heads(_linear(h, a["W_Q"], a["b_Q"]), config.num_heads)  # [T, N, H]
    k = split_heads(_linear(h, a["W_K"], a["b_K"]), config.num_heads)  # [T, N, H]
    v = split_heads(_linear(h, a["W_V"], a["b_V"]), config.num_heads)  # [T, N, H]
    if config.qk_layernorm:
        q = layer_norm(q, **p["ln_q"], eps=_LN_EPS)  # [T, N, H]
        k = layer_norm(k, **p["ln_k"], eps=_LN_EPS)  # [T, N, H]
    out, weights = multi_head_attention(q, k, v, bias=bias, scale=scale, is_causal=True)  # [T, N, H], [N, T, T]
    logits = jax.vmap(lambda q1, k1: attention_logits(q1, k1, scale=scale), in_axes=1)(q, k)  # [N, T, T]
    x = x + _linear(merge_heads(out), a["W_O"], a["b_O"])  # [T, D]
    x = x + _mlp(p["mlp"], layer_norm(x, **p["ln_2"], eps=_LN_EPS))  # [T, D]
    return x, weights, logits


def forward(
    params: dict, tokens: Any, *, config: ModelConfig, scale: Any = None, logit_bias: Any = None
) -> tuple[Array, dict[str, Array]]:
    """The decoder on one sequence: next-token logits and every attention map it used.

    Args:
      params: from :func:`init_params`.
      tokens: int ``[T]``, ``T <= n_ctx``.
      config: the :class:`ModelConfig` the params were made with.
      scale: query-key scale of every head: ``None`` = ``1/sqrt(d_k)``, ``1.0`` = unscaled, any positive
        float, or a traced scalar (a sweep under ``vmap``).
      logit_bias: optional additive bias on the attention logits ``[L, N, T, T]``. Pass zeros and
        differentiate with respect to it to get ``∂loss/∂logits`` exactly (the probes' trick, see
        :func:`jaxattn.probes.attention_grads`); it changes nothing else.

    Returns:
      ``(logits [T, n_vocab], captured)``; ``captured["weights"]`` ``[L, N, T, T]`` are the attention
      maps and ``captured["attn_logits"]`` ``[L, N, T, T]`` the pre-softmax logits ``scale · q kᵀ`` before
      the causal mask (both from the core's own functions).
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array [T], received dtype {tokens.dtype.name}")
    if tokens.ndim != 1 or not 0 < tokens.shape[0] <= config.n_ctx:
        raise ValueError(f"tokens must have shape [T] with 0 < T <= n_ctx={config.n_ctx}, received {tuple(tokens.shape)}")
    T, L, N = tokens.shape[0], config.num_layers, config.num_heads
    if logit_bias is None:
        logit_bias = jnp.zeros((L, N, T, T), jnp.float32)
    elif jnp.shape(logit_bias) != (L, N, T, T):
        raise ValueError(f"logit_bias must have shape [L, N, T, T] = {(L, N, T, T)}, received {tuple(jnp.shape(logit_bias))}")
    if len(params["blocks"]) != L:
        raise ValueError(f"params has {len(params['blocks'])} blocks, config.num_layers is {L}")
    x = params["wte"][tokens] + params["wpe"][:T]  # [T, D]
    maps, logits = [], []
    for layer, p in enumerate(params["blocks"]):
        x, w, z = _block(p, x, logit_bias[layer], config=config, scale=scale)  # [T, D], [N, T, T], [N, T, T]
        maps.append(w)
        logits.append(z)
    x = layer_norm(x, **params["ln_f"], eps=_LN_EPS)  # [T, D]
    out = x @ params["wte"].T  # [T, n_vocab], tied embeddings
    return out, {"weights": jnp.stack(maps), "attn_logits": jnp.stack(logits)}


# ----------------------------------------------------------------------------------------------------
# Loss, the training step, and what it logs.
# ----------------------------------------------------------------------------------------------------


def loss_fn(
    params: dict, batch: dict[str, Array], *, config: ModelConfig, scale: Any = None, logit_bias: Any = None
) -> tuple[Array, dict[str, Array]]:
    """Mean cross-entropy (nats) over the answer positions of a batch, and what the forward captured.

    Args:
      params, config, scale: as in :func:`forward`.
      batch: from :func:`recall_batch` (``tokens``, ``targets``, ``loss_mask``, each ``[B, T]``).
      logit_bias: optional ``[B, L, N, T, T]`` (see :func:`forward`).

    Returns:
      ``(loss, aux)``: aux has ``accuracy`` (scalar, argmax correct at answer positions), ``weights`` and
      ``attn_logits`` ``[B, L, N, T, T]``.
    """
    B, T = batch["tokens"].shape
    if logit_bias is None:
        logit_bias = jnp.zeros((B, config.num_layers, config.num_heads, T, T), jnp.float32)
    run = functools.partial(forward, params, config=config, scale=scale)
    out, captured = jax.vmap(lambda t, b: run(t, logit_bias=b))(batch["tokens"], logit_bias)  # [B, T, n_vocab]
    logp = jax.nn.log_softmax(out, axis=-1)  # [B, T, n_vocab]
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]  # [B, T]
    m = batch["loss_mask"].astype(jnp.float32)  # [B, T]
    count = jnp.maximum(jnp.sum(m), 1.0)
    loss = jnp.sum(nll * m) / count
    correct = (jnp.argmax(out, axis=-1) == batch["targets"]).astype(jnp.float32)  # [B, T]
    return loss, {"accuracy": jnp.sum(correct * m) / count, **captured}


def _decay_mask(params: dict) -> dict:
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def optimizer(opt: OptConfig) -> optax.GradientTransformation:
    """Clip, Adam, decoupled weight decay: AdamW without its learning rate (applied in :func:`train_step`,
    so that the peak learning rate can be a vmapped argument)."""
    return optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps),
        optax.add_decayed_weights(opt.weight_decay, mask=_decay_mask),
    )


def lr_schedule(opt: OptConfig) -> Callable[[Any], Array]:
    """``w(t)``: the learning-rate multiplier of :class:`OptConfig` (peak 1)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=1.0,
        warmup_steps=opt.warmup_steps,
        decay_steps=opt.total_steps,
        end_value=opt.final_lr_fraction,
    )


def init_state(seed: Any, config: ModelConfig, opt: OptConfig) -> dict:
    """``{"params", "opt_state", "step"}`` for a run; params from ``fold_in(key(seed), 0)``."""
    params = init_params(jax.random.fold_in(jax.random.key(seed), 0), config)
    return {"params": params, "opt_state": optimizer(opt).init(params), "step": jnp.zeros((), jnp.int32)}


#: What :func:`train_step` logs at each step, with shapes (L layers, N heads); every value is float32.
METRICS = {
    "loss": "[] mean cross-entropy (nats) at the answer positions of the step's batch, before the update",
    "accuracy": "[] fraction of answer positions where the argmax is the answer",
    "entropy": "[L, N] per-head attention entropy (nats): jaxattn.probes.head_entropy, mean over batch",
    "max_logit": "[L, N] largest attention logit scale·q·k over the batch and the causal positions",
    "logit_grad": "[L, N] the probes' measure at the logits: ‖∂loss/∂logits‖ per query row, mean over rows "
    "and batch (via a zero logit bias)",
    "jacobian_frobenius": "[L, N] ‖diag(p) - p pᵀ‖_F of each row (jaxattn.probes.softmax_jacobian_norms), mean",
    "grad_norm_wq": "[L] ‖∂loss/∂W_Q‖ of each layer, before clipping",
    "grad_norm_wk": "[L] ‖∂loss/∂W_K‖ of each layer, before clipping",
    "grad_norm": "[] global gradient norm, before clipping",
    "learning_rate": "[] the learning rate applied at this step",
}


def _metrics(loss, aux, grads, dz, lr, config: ModelConfig) -> dict[str, Array]:
    T = aux["weights"].shape[-1]
    causal = causal_mask(T)  # [T, T]
    fill = jnp.finfo(jnp.float32).min
    logits = aux["attn_logits"]  # [B, L, N, T, T]
    blocks = grads["params"]["blocks"]
    return {
        "loss": loss,
        "accuracy": aux["accuracy"],
        "entropy": jnp.mean(head_entropy(aux["weights"], causal), axis=0),  # [L, N]
        "max_logit": jnp.max(jnp.where(causal, logits, fill), axis=(0, 3, 4)),  # [L, N]
        "logit_grad": jnp.mean(jnp.linalg.norm(dz, axis=-1), axis=(0, 3)),  # [L, N]
        "jacobian_frobenius": jnp.mean(softmax_jacobian_norms(logits, causal)["frobenius"], axis=(0, 3)),  # [L, N]
        "grad_norm_wq": jnp.stack([jnp.linalg.norm(b["attn"]["W_Q"]) for b in blocks]),  # [L]
        "grad_norm_wk": jnp.stack([jnp.linalg.norm(b["attn"]["W_K"]) for b in blocks]),  # [L]
        "grad_norm": jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads["params"]))),
        "learning_rate": lr,
    }


def train_step(
    state: dict, batch: dict[str, Array], *, learning_rate: Any, scale: Any, config: ModelConfig, opt: OptConfig
) -> tuple[dict, dict[str, Array]]:
    """One AdamW step on ``batch``, and the :data:`METRICS` of that batch (computed from the same forward
    and backward pass as the update).

    Args:
      state: from :func:`init_state`.
      batch: from :func:`recall_batch`.
      learning_rate: peak learning rate (a float or a traced scalar); the step's rate is
        ``learning_rate · lr_schedule(opt)(step)``.
      scale: query-key scale (see :func:`forward`).

    Returns:
      ``(new_state, metrics)``.
    """
    B, T = batch["tokens"].shape
    zeros = jnp.zeros((B, config.num_layers, config.num_heads, T, T), jnp.float32)

    def objective(diff):
        return loss_fn(diff["params"], batch, config=config, scale=scale, logit_bias=diff["bias"])

    (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(
        {"params": state["params"], "bias": zeros}
    )
    lr = jnp.asarray(learning_rate, jnp.float32) * lr_schedule(opt)(state["step"])
    updates, opt_state = optimizer(opt).update(grads["params"], state["opt_state"], state["params"])
    updates = jax.tree.map(lambda u: -lr * u, updates)
    new_state = {
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "step": state["step"] + 1,
    }
    return new_state, _metrics(loss, aux, grads, grads["bias"], lr, config)


def _batch_key(seed: Array, step: Array) -> Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), step)


@functools.partial(jax.jit, static_argnames=("num_steps", "config", "task", "opt"))
def _train_chunk(states, seeds, learning_rates, scales, *, num_steps, config, task, opt):
    """``num_steps`` steps of every run at once: ``vmap`` over runs inside ``scan`` over steps."""

    def one_run(state, seed, lr, scale):
        batch = recall_batch(_batch_key(seed, state["step"]), task, opt.batch_size)
        return train_step(state, batch, learning_rate=lr, scale=scale, config=config, opt=opt)

    def step(states, _):
        return jax.vmap(one_run)(states, seeds, learning_rates, scales)

    return jax.lax.scan(step, states, None, length=num_steps)


@functools.partial(jax.jit, static_argnames=("config", "opt"))
def _init_states(seeds, *, config, opt):
    return jax.vmap(lambda s: init_state(s, config, opt))(seeds)


def resolve_scale(scale: Any, head_dim: int) -> float:
    """The query-key scale as a float, in the core's vocabulary: ``None`` → ``1/sqrt(head_dim)``;
    a positive finite number → itself (``1.0`` is the unscaled attention)."""
    return float(check_scale(scale, check_int(head_dim, "head_dim")))


def train(
    config: ModelConfig,
    task: RecallTask,
    opt: OptConfig,
    *,
    seeds: Sequence[int],
    learning_rates: Sequence[float],
    scales: Sequence[Any],
    chunk: int = 50,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Train C runs of the same shapes at once (``vmap``), ``opt.total_steps`` steps each.

    Run ``c`` has seed ``seeds[c]`` (its initial params and its batches), peak learning rate
    ``learning_rates[c]`` and query-key scale ``scales[c]`` (see :func:`resolve_scale`); runs with equal
    seeds start from the same params and see the same batches, so scaled and unscaled runs are paired.

    Args:
      config, task, opt: shapes, task and optimizer recipe, shared by every run.
      seeds, learning_rates, scales: sequences of length C.
      chunk: steps per compiled call (the progress callback runs between calls).
      progress: optional ``progress(steps_done, total_steps)``, called once before anything compiles
        and after each chunk; e.g. a :class:`jaxattn.progress.ProgressBar`.

    Returns:
      dict of NumPy arrays: every key of :data:`METRICS` with shape ``[C, steps, ...]``, plus ``seed``,
      ``learning_rate_peak`` and ``scale`` ``[C]``.
    """
    if not isinstance(config, ModelConfig) or not isinstance(task, RecallTask) or not isinstance(opt, OptConfig):
        raise TypeError("config, task and opt must be a ModelConfig, a RecallTask and an OptConfig")
    if config.n_vocab < task.n_vocab or config.n_ctx < task.length:
        raise ValueError(
            f"config (n_vocab={config.n_vocab}, n_ctx={config.n_ctx}) is too small for the task "
            f"(n_vocab={task.n_vocab}, length={task.length}); use ModelConfig.for_task"
        )
    C = len(seeds)
    if len(learning_rates) != C or len(scales) != C or C == 0:
        raise ValueError(
            f"seeds, learning_rates and scales must have the same non-zero length C, received "
            f"{len(seeds)}, {len(learning_rates)}, {len(scales)}"
        )
    chunk = check_int(chunk, "chunk")
    seeds_a = jnp.asarray([int(s) for s in seeds], jnp.uint32)
    lrs = jnp.asarray([_non_negative_float(lr, "learning_rates[i]") for lr in learning_rates], jnp.float32)
    scl = jnp.asarray([resolve_scale(s, config.head_dim) for s in scales], jnp.float32)
    if progress is not None:  # before anything compiles
        progress(0, opt.total_steps)
    states = _init_states(seeds_a, config=config, opt=opt)
    pieces = []
    done = 0
    while done < opt.total_steps:
        n = min(chunk, opt.total_steps - done)
        states, logged = _train_chunk(states, seeds_a, lrs, scl, num_steps=n, config=config, task=task, opt=opt)
        pieces.append(jax.device_get(logged))
        done += n
        if progress is not None:
            progress(done, opt.total_steps)
    history = {name: np.swapaxes(np.concatenate([p[name] for p in pieces]), 0, 1) for name in METRICS}
    history["seed"] = np.asarray(seeds_a)
    history["learning_rate_peak"] = np.asarray(lrs)
    history["scale"] = np.asarray(scl)
    return history


# ----------------------------------------------------------------------------------------------------
# Summaries.
# ----------------------------------------------------------------------------------------------------


def summarize(history: dict[str, np.ndarray], *, threshold: float, window: int = 20) -> list[dict[str, Any]]:
    """One row per run of a :func:`train` history.

    Args:
      history: from :func:`train` (``loss [C, steps]``, ``entropy [C, steps, L, N]``, ...).
      threshold: the loss (nats) a run must reach.
      window: the final loss and accuracy are means over the last ``window`` steps; "steps to threshold"
        is the first step at which the trailing mean of the last ``window`` losses is ``<= threshold``.

    Returns:
      list of C dicts: ``seed``, ``learning_rate``, ``scale``, ``final_loss``, ``final_accuracy``,
      ``steps_to_threshold`` (int, or ``None`` if never reached), ``diverged`` (a non-finite loss at any
      step, or a final loss above the first step's), ``min_entropy`` (nats, the lowest per-head entropy
      at any logged step), ``max_logit`` (the largest attention logit at any step).
    """
    window = check_int(window, "window")
    threshold = float(threshold)
    loss = np.asarray(history["loss"], np.float64)  # [C, steps]
    if loss.ndim != 2:
        raise ValueError(f"history['loss'] must have shape [C, steps], received {loss.shape}")
    C, steps = loss.shape
    w = min(window, steps)
    rows = []
    for c in range(C):
        finite = bool(np.all(np.isfinite(loss[c])))
        trailing = np.convolve(np.nan_to_num(loss[c], nan=np.inf), np.ones(w) / w, mode="valid")  # [steps - w + 1]
        reached = np.flatnonzero(trailing <= threshold)
        final = float(np.mean(loss[c, -w:]))
        rows.append(
            {
                "seed": int(history["seed"][c]),
                "learning_rate": float(history["learning_rate_peak"][c]),
                "scale": float(history["scale"][c]),
                "final_loss": final,
                "final_accuracy": float(np.mean(history["accuracy"][c, -w:])),
                "steps_to_threshold": int(reached[0]) + w if reached.size else None,
                "diverged": (not finite) or not final <= float(loss[c, 0]),
                "min_entropy": float(np.min(history["entropy"][c])),
                "max_logit": float(np.max(history["max_logit"][c])),
            }
        )
    return rows
