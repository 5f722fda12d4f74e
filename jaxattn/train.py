"""Does it train without √d_k? A small decoder-only Transformer, a task that needs attention, and the
probes logged at every training step.

The model is GPT-2's pre-LayerNorm block (``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, tied embeddings)
written as plain functions over a params pytree, picoGPT style. Its attention is the core's
:func:`jaxattn.multi_head_attention` with ``is_causal=True``; the query-key ``scale`` is an argument
(``None`` = ``1/sqrt(d_k)``, ``1.0`` = unscaled, or any float, also a traced one so that scaled and
unscaled runs are one compiled program), and ``qk_layernorm`` optionally normalises q and k per head
before the dot product (Wortsman et al. 2023). The probes (:mod:`jaxattn.probes`) read the maps, the
logits and the gradient at the logits that this one forward pass produces.

Remedies: :func:`train` also takes ``remedies=`` instead of ``scales=``, the specs of
:class:`jaxattn.probes.Remedy` with the same names and meanings (``none``, ``sqrt_dk``, ``qk_norm``,
``qk_norm_sqrt_dk``, ``sigma_reparam``, ``sigma_reparam_sqrt_dk``, ``("cap", c)``, ``("temperature", τ)``).
Here they act on the model's own q and k (:func:`remedy_settings` says how): the scale
``(1/sqrt(d_k) if sqrt_dk else 1) / τ`` is the core's ``scale``; ``qk_norm`` RMS-normalises each q and k
row of each head over d_k with gain 1 (no learnable gain, as in the probes; ``ModelConfig.qk_norm``);
the cap is the core's ``logit_cap`` on the unscaled ``q·k``; ``sigma_reparam`` is σReparam (Zhai et al.
2023, "Stabilizing Transformer Training by Preventing Attention Entropy Collapse", ICML) on ``W_Q`` and
``W_K`` of every layer: ``Ŵ = (γ / σ(W)) W`` with γ a learned scalar per matrix, initialised to 1 as in the
probes and the reference JAX code, and σ(W) the spectral norm of the whole ``[D, N·H]`` matrix from
:func:`spectral_norm` (power iteration, gradient ``u vᵀ``; ``ModelConfig.sigma_reparam``).

Tasks: :class:`RecallTask` (below), and :class:`TextTask`, character-level next-token prediction on the
shipped Tiny Shakespeare slice (``jaxattn/data/tinyshakespeare.txt.gz``, made by
``tools/convert_tinyshakespeare.py``), scored at every position, with a validation loss on a fixed
slice logged after every chunk of steps.

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
import gzip
import hashlib
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._attention import attention_logits, init_attention_params, merge_heads, multi_head_attention, split_heads
from jaxattn._checks import as_key, check_int, check_scale
from jaxattn._extras import require
from jaxattn._masks import causal_mask
from jaxattn._inputs import check_id_values
from jaxattn._nn import embed_ids, layer_norm
from jaxattn.probes import Remedy, head_entropy, softmax_jacobian_norms

require("train", "jaxattn.train", "optax")

import optax  # noqa: E402  (after the check, so a missing optax names the extra)

Array = jax.Array
_LN_EPS = 1e-5  # LayerNorm epsilon (GPT-2's)
_RMS_EPS = 1e-6  # qk_norm: added to the mean square (q rows have mean square ~1, so it changes ~1e-6 relative)
SIGMA_SQUARINGS = 10  # spectral_norm: 2^10 power-iteration steps on the smaller Gram matrix, by squaring
TEXT_FILE = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt.gz"
TEXT_TRAIN_FRACTION = 0.9  # the first 90% of the shipped text train, the last 10% validate
# the shipped file as tools/convert_tinyshakespeare.py writes it (its SHIPPED_BYTES and SHIPPED_SHA256)
TEXT_BYTES = 233_318
TEXT_SHA256 = "ed33f9adb6622ec45f05376e7dfd67650db96fc1300cb85ed8a059c5f1567440"

__all__ = [
    "METRICS",
    "ModelConfig",
    "OptConfig",
    "RecallTask",
    "TextTask",
    "forward",
    "init_params",
    "init_state",
    "loss_fn",
    "lr_schedule",
    "optimizer",
    "load_text",
    "recall_batch",
    "remedy_settings",
    "resolve_scale",
    "rms_normalize",
    "sigma_reparam_weight",
    "spectral_norm",
    "summarize",
    "text_batch",
    "text_validation_batch",
    "train",
    "train_step",
]

# ----------------------------------------------------------------------------------------------------
# Configurations (frozen dataclasses: hashable, so they are static arguments of the compiled step).
# ----------------------------------------------------------------------------------------------------


def _seed(value: Any, name: str) -> int:
    """A run's seed: an int in [0, 2**32), the uint32 the runs' keys are folded from (``ValueError`` naming it)."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or not 0 <= value < 2 ** 32):
        raise ValueError(f"{name} must be an int in [0, 2**32), received {value!r}")
    return int(value)


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


@functools.lru_cache(maxsize=1)
def load_text() -> dict[str, Any]:
    """The shipped Tiny Shakespeare slice as character ids: ``{"vocab": str (the sorted distinct
    characters; id i is vocab[i]), "train": int32 [n_train], "validation": int32 [n_validation]}``, the
    first :data:`TEXT_TRAIN_FRACTION` of the characters and the rest. Read once, then cached. The text is
    Tiny Shakespeare from github.com/karpathy/char-rnn (an MIT-licensed repository; the plays are in the
    public domain); ``jaxattn/data/README.md`` gives its source, citation and converter. A file that is not
    the shipped one (its size and sha256) raises ``ValueError``."""
    if not TEXT_FILE.is_file():
        raise FileNotFoundError(f"the shipped text {TEXT_FILE} is missing: reinstall jaxattn, or make it with "
                                "tools/convert_tinyshakespeare.py")
    raw = TEXT_FILE.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if len(raw) != TEXT_BYTES or digest != TEXT_SHA256:  # truncated, damaged or another text: never trained on
        raise ValueError(f"{TEXT_FILE}: expected the shipped Tiny Shakespeare slice ({TEXT_BYTES} bytes, sha256 "
                         f"{TEXT_SHA256}), found {len(raw)} bytes, sha256 {digest}: reinstall jaxattn, or make it "
                         "with tools/convert_tinyshakespeare.py")
    text = gzip.decompress(raw).decode("utf-8")
    vocab = "".join(sorted(set(text)))
    lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), np.uint32)]  # [n], one id per character
    cut = int(len(ids) * TEXT_TRAIN_FRACTION)
    return {"vocab": vocab, "train": ids[:cut], "validation": ids[cut:]}


@dataclasses.dataclass(frozen=True)
class TextTask:
    """Character-level next-token prediction on the shipped Tiny Shakespeare slice (:func:`load_text`).

    A sequence is ``context + 1`` consecutive characters of the training slice from a uniformly drawn start;
    the model reads the first ``context`` and is scored at every position on the next character (the causal
    mask keeps it from seeing it). The validation loss is the same loss on ``val_sequences`` fixed,
    non-overlapping windows from the start of the validation slice (:func:`text_validation_batch`).
    """

    context: int = 64
    val_sequences: int = 64

    def __post_init__(self):
        check_int(self.context, "context")
        check_int(self.val_sequences, "val_sequences")
        n_val = len(load_text()["validation"])
        if self.val_sequences * (self.context + 1) > n_val:
            raise ValueError(f"val_sequences × (context + 1) = {self.val_sequences * (self.context + 1)} must be "
                             f"<= the validation slice's {n_val} characters")

    @property
    def n_vocab(self) -> int:
        return len(load_text()["vocab"])

    @property
    def length(self) -> int:
        """T, the number of input positions (``context``)."""
        return self.context

    @property
    def chance_loss(self) -> float:
        """``log n_vocab``: the loss of a uniform guess over the characters."""
        return math.log(self.n_vocab)


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
    qk_norm: bool = False
    sigma_reparam: bool = False

    def __post_init__(self):
        for name in ("n_vocab", "n_ctx", "d_model", "num_heads", "head_dim", "num_layers", "mlp_ratio"):
            check_int(getattr(self, name), name)
        for name in ("qk_layernorm", "qk_norm", "sigma_reparam"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, received {getattr(self, name)!r}")
        if self.qk_layernorm and self.qk_norm:
            raise ValueError("qk_layernorm and qk_norm both normalise q and k per head: set one of them, received both True")

    @classmethod
    def for_task(cls, task: "RecallTask | TextTask", **kwargs: Any) -> "ModelConfig":
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


def _windows(data: Array, starts: Array, context: int) -> dict[str, Array]:
    seq = data[starts[:, None] + jnp.arange(context + 1)[None, :]]  # [B, T + 1]
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:], "loss_mask": jnp.ones(seq[:, 1:].shape, bool)}


def _text_batch(key: Array, data: Array, context: int, batch_size: int) -> dict[str, Array]:
    starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - context)  # [B]
    return _windows(data, starts, context)


def text_batch(key: Any, task: TextTask, batch_size: int) -> dict[str, Array]:
    """A batch of :class:`TextTask` windows of the training slice, starts drawn uniformly from ``key``.

    Returns:
      dict: ``tokens [B, T]`` int32, ``targets [B, T]`` int32 (the next characters), ``loss_mask [B, T]``
      bool (all True: every position is scored).
    """
    if not isinstance(task, TextTask):
        raise TypeError(f"task must be a TextTask, received {type(task).__name__}")
    batch_size = check_int(batch_size, "batch_size")
    return _text_batch_jit(as_key(key), jnp.asarray(load_text()["train"]), task.context, batch_size)


_text_batch_jit = jax.jit(_text_batch, static_argnums=(2, 3))


def text_validation_batch(task: TextTask) -> dict[str, Array]:
    """The fixed validation batch of :class:`TextTask`: ``val_sequences`` non-overlapping windows of
    ``context + 1`` characters from the start of the validation slice (keys as in :func:`text_batch`)."""
    if not isinstance(task, TextTask):
        raise TypeError(f"task must be a TextTask, received {type(task).__name__}")
    starts = jnp.arange(task.val_sequences) * (task.context + 1)
    return _windows(jnp.asarray(load_text()["validation"]), starts, task.context)


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
    ``qk_layernorm``, per-block ``ln_q``, ``ln_k`` of width H; with ``sigma_reparam``, per-block
    ``{"gamma_Q": 1, "gamma_K": 1}`` (σReparam's γ, scalars).

    Returns:
      ``{"wte", "wpe", "blocks": [L × {"ln_1", "attn", "ln_2", "mlp"(, "ln_q", "ln_k")(, "sigma_reparam")}],
      "ln_f"}``.
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
        if config.sigma_reparam:  # γ of Ŵ = (γ / σ(W)) W, scalars: no weight decay (it decays 2+ axes only)
            block["sigma_reparam"] = {"gamma_Q": jnp.ones((), jnp.float32), "gamma_K": jnp.ones((), jnp.float32)}
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


def rms_normalize(x: Array) -> Array:
    """``qk_norm``: each row of ``x [..., H]`` divided by its root mean square over H, gain 1:
    ``x / sqrt(mean_h x_h² + 1e-6)`` (the probes' remedy, plus an epsilon so that a zero row stays finite)."""
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + _RMS_EPS)


def spectral_norm(w: Array, squarings: int = SIGMA_SQUARINGS) -> Array:
    """σ(W), the largest singular value of ``w [D, M]``, by power iteration, differentiable.

    The smaller Gram matrix ``G`` (``W Wᵀ`` if ``D <= M``, else ``Wᵀ W``) is squared ``squarings`` times
    (normalised each time), which is ``2^squarings`` power-iteration steps on G at the cost of that many
    small matrix products; applied to a fixed start vector and then 4 plain steps on G, it gives the top
    singular vector, all under ``stop_gradient``. Then ``σ = |Wᵀ u|`` (or ``|W v|``), whose gradient with
    respect to W is ``u vᵀ``, the exact gradient of σ at a simple top singular value. (σReparam's reference
    code does one power step per training step from a persistent vector; this recomputes from scratch, so
    a run stays a pure function of its params.) A truncated iteration can only under-estimate σ.
    """
    D, M = w.shape
    wide = D <= M
    gram = jax.lax.stop_gradient(w @ w.T if wide else w.T @ w)  # [m, m], m = min(D, M)
    m = gram.shape[0]

    def square(_, p):
        p = p @ p
        return p / jnp.linalg.norm(p)

    power = jax.lax.fori_loop(0, squarings, square, gram / jnp.linalg.norm(gram))  # ∝ G^(2^squarings)
    x = power @ jax.random.normal(jax.random.key(0), (m,), w.dtype)  # fixed start: a run depends on its params only
    for _ in range(4):
        x = gram @ (x / jnp.linalg.norm(x))
    top = jax.lax.stop_gradient(x / jnp.linalg.norm(x))  # [m]
    return jnp.linalg.norm(w.T @ top if wide else w @ top)


def sigma_reparam_weight(w: Array, gamma: Array) -> Array:
    """σReparam (Zhai et al. 2023): ``Ŵ = (γ / σ(W)) W``, σ from :func:`spectral_norm`."""
    return (gamma / spectral_norm(w)) * w


def _block(
    p: dict, x: Array, bias: Array, *, config: ModelConfig, scale: Any, logit_cap: Any
) -> tuple[Array, Array, Array]:
    a = p["attn"]
    w_q, w_k = a["W_Q"], a["W_K"]
    if config.sigma_reparam:
        w_q = sigma_reparam_weight(w_q, p["sigma_reparam"]["gamma_Q"])  # [D, N·H]
        w_k = sigma_reparam_weight(w_k, p["sigma_reparam"]["gamma_K"])  # [D, N·H]
    h = layer_norm(x, **p["ln_1"], eps=_LN_EPS)  # [T, D]
    q = split_heads(_linear(h, w_q, a["b_Q"]), config.num_heads)  # [T, N, H]
    k = split_heads(_linear(h, w_k, a["b_K"]), config.num_heads)  # [T, N, H]
    v = split_heads(_linear(h, a["W_V"], a["b_V"]), config.num_heads)  # [T, N, H]
    if config.qk_layernorm:
        q = layer_norm(q, **p["ln_q"], eps=_LN_EPS)  # [T, N, H]
        k = layer_norm(k, **p["ln_k"], eps=_LN_EPS)  # [T, N, H]
    if config.qk_norm:
        q = rms_normalize(q)  # [T, N, H]
        k = rms_normalize(k)  # [T, N, H]
    out, weights = multi_head_attention(
        q, k, v, bias=bias, scale=scale, is_causal=True, logit_cap=logit_cap
    )  # [T, N, H], [N, T, T]
    logits = jax.vmap(
        lambda q1, k1: attention_logits(q1, k1, scale=scale, logit_cap=logit_cap), in_axes=1
    )(q, k)  # [N, T, T]
    x = x + _linear(merge_heads(out), a["W_O"], a["b_O"])  # [T, D]
    x = x + _mlp(p["mlp"], layer_norm(x, **p["ln_2"], eps=_LN_EPS))  # [T, D]
    return x, weights, logits


def forward(
    params: dict, tokens: Any, *, config: ModelConfig, scale: Any = None, logit_cap: Any = None,
    logit_bias: Any = None,
) -> tuple[Array, dict[str, Array]]:
    """The decoder on one sequence: next-token logits and every attention map it used.

    Args:
      params: from :func:`init_params`.
      tokens: int ``[T]``, ``T <= n_ctx``.
      config: the :class:`ModelConfig` the params were made with.
      scale: query-key scale of every head: ``None`` = ``1/sqrt(d_k)``, ``1.0`` = unscaled, any positive
        float, or a traced scalar (a sweep under ``vmap``).
      logit_cap: ``None``, or the soft cap ``c`` of every head's logits, ``c · tanh(x / c)`` (the core's
        ``logit_cap``; a traced scalar is accepted).
      logit_bias: optional additive bias on the attention logits ``[L, N, T, T]`` (added before the cap). Pass zeros and
        differentiate with respect to it to get ``∂loss/∂logits`` exactly (the probes' trick, see
        :func:`jaxattn.probes.attention_grads`); it changes nothing else.

    Returns:
      ``(logits [T, n_vocab], captured)``; ``captured["weights"]`` ``[L, N, T, T]`` are the attention
      maps and ``captured["attn_logits"]`` ``[L, N, T, T]`` the pre-softmax logits ``scale · q kᵀ`` (capped
      when ``logit_cap`` is set: what the softmax sees) before the causal mask (both from the core's own functions).
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array [T], received dtype {tokens.dtype.name}")
    if tokens.ndim != 1 or not 0 < tokens.shape[0] <= config.n_ctx:
        raise ValueError(f"tokens must have shape [T] with 0 < T <= n_ctx={config.n_ctx}, received {tuple(tokens.shape)}")
    check_id_values(tokens, "tokens", 0, params["wte"].shape[0], "n_vocab")  # concrete ids; traced: NaN rows below
    T, L, N = tokens.shape[0], config.num_layers, config.num_heads
    if logit_bias is None:
        logit_bias = jnp.zeros((L, N, T, T), jnp.float32)
    elif jnp.shape(logit_bias) != (L, N, T, T):
        raise ValueError(f"logit_bias must have shape [L, N, T, T] = {(L, N, T, T)}, received {tuple(jnp.shape(logit_bias))}")
    if len(params["blocks"]) != L:
        raise ValueError(f"params has {len(params['blocks'])} blocks, config.num_layers is {L}")
    x = embed_ids(params["wte"], tokens) + params["wpe"][:T]  # [T, D]: an id out of range a NaN row, not another's
    maps, logits = [], []
    for layer, p in enumerate(params["blocks"]):
        x, w, z = _block(p, x, logit_bias[layer], config=config, scale=scale, logit_cap=logit_cap)  # [T, D], [N, T, T] ×2
        maps.append(w)
        logits.append(z)
    x = layer_norm(x, **params["ln_f"], eps=_LN_EPS)  # [T, D]
    out = x @ params["wte"].T  # [T, n_vocab], tied embeddings
    return out, {"weights": jnp.stack(maps), "attn_logits": jnp.stack(logits)}


# ----------------------------------------------------------------------------------------------------
# Loss, the training step, and what it logs.
# ----------------------------------------------------------------------------------------------------


def loss_fn(
    params: dict, batch: dict[str, Array], *, config: ModelConfig, scale: Any = None, logit_cap: Any = None,
    logit_bias: Any = None,
) -> tuple[Array, dict[str, Array]]:
    """Mean cross-entropy (nats) over the scored positions of a batch, and what the forward captured.

    Args:
      params, config, scale, logit_cap: as in :func:`forward`.
      batch: from :func:`recall_batch` or :func:`text_batch` (``tokens``, ``targets``, ``loss_mask``, each ``[B, T]``).
      logit_bias: optional ``[B, L, N, T, T]`` (see :func:`forward`).

    Returns:
      ``(loss, aux)``: aux has ``accuracy`` (scalar, argmax correct at answer positions), ``weights`` and
      ``attn_logits`` ``[B, L, N, T, T]``.
    """
    B, T = batch["tokens"].shape
    if logit_bias is None:
        logit_bias = jnp.zeros((B, config.num_layers, config.num_heads, T, T), jnp.float32)
    run = functools.partial(forward, params, config=config, scale=scale, logit_cap=logit_cap)
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
    "loss": "[] mean cross-entropy (nats) at the scored positions of the step's batch (recall: the answers; "
    "text: every position), before the update",
    "accuracy": "[] fraction of scored positions where the argmax is the target",
    "entropy": "[L, N] per-head attention entropy (nats): jaxattn.probes.head_entropy, mean over batch",
    "max_weight": "[L, N] largest attention weight of each query row, mean over rows and batch",
    "max_logit": "[L, N] largest attention logit scale·q·k over the batch and the causal positions (with a "
    "logit cap: the capped logit, what the softmax sees)",
    "logit_grad": "[L, N] the probes' measure at the logits: ‖∂loss/∂logits‖ per query row, mean over rows "
    "and batch (via a zero logit bias; with a logit cap, at the logits before the cap)",
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
        "max_weight": jnp.mean(jnp.max(aux["weights"], axis=-1), axis=(0, 3)),  # [L, N]
        "max_logit": jnp.max(jnp.where(causal, logits, fill), axis=(0, 3, 4)),  # [L, N]
        "logit_grad": jnp.mean(jnp.linalg.norm(dz, axis=-1), axis=(0, 3)),  # [L, N]
        "jacobian_frobenius": jnp.mean(softmax_jacobian_norms(logits, causal)["frobenius"], axis=(0, 3)),  # [L, N]
        "grad_norm_wq": jnp.stack([jnp.linalg.norm(b["attn"]["W_Q"]) for b in blocks]),  # [L]
        "grad_norm_wk": jnp.stack([jnp.linalg.norm(b["attn"]["W_K"]) for b in blocks]),  # [L]
        "grad_norm": jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads["params"]))),
        "learning_rate": lr,
    }


def train_step(
    state: dict, batch: dict[str, Array], *, learning_rate: Any, scale: Any, config: ModelConfig, opt: OptConfig,
    logit_cap: Any = None,
) -> tuple[dict, dict[str, Array]]:
    """One AdamW step on ``batch``, and the :data:`METRICS` of that batch (computed from the same forward
    and backward pass as the update).

    Args:
      state: from :func:`init_state`.
      batch: from :func:`recall_batch`.
      learning_rate: peak learning rate (a float or a traced scalar); the step's rate is
        ``learning_rate · lr_schedule(opt)(step)``.
      scale, logit_cap: query-key scale and soft cap (see :func:`forward`).

    Returns:
      ``(new_state, metrics)``.
    """
    B, T = batch["tokens"].shape
    zeros = jnp.zeros((B, config.num_layers, config.num_heads, T, T), jnp.float32)

    def objective(diff):
        return loss_fn(diff["params"], batch, config=config, scale=scale, logit_cap=logit_cap, logit_bias=diff["bias"])

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


def _task_batch(key: Array, task: Any, batch_size: int, data: Any) -> dict[str, Array]:
    if isinstance(task, TextTask):
        return _text_batch(key, data, task.context, batch_size)
    return recall_batch(key, task, batch_size)


@functools.partial(jax.jit, static_argnames=("num_steps", "config", "task", "opt"))
def _train_chunk(states, seeds, learning_rates, scales, caps, data, *, num_steps, config, task, opt):
    """``num_steps`` steps of every run at once: ``vmap`` over runs inside ``scan`` over steps. ``caps`` is
    None (no cap) or one soft cap per run; ``data`` the training slice of a :class:`TextTask`, else None."""

    def one_run(state, seed, lr, scale, cap):
        batch = _task_batch(_batch_key(seed, state["step"]), task, opt.batch_size, data)
        return train_step(state, batch, learning_rate=lr, scale=scale, logit_cap=cap, config=config, opt=opt)

    def step(states, _):
        return jax.vmap(one_run)(states, seeds, learning_rates, scales, caps)

    return jax.lax.scan(step, states, None, length=num_steps)


@functools.partial(jax.jit, static_argnames=("config",))
def _eval_loss(params, scales, caps, batch, *, config):
    """The loss of every run (``vmap``) on one batch: ``[C]``."""

    def one(p, scale, cap):
        return loss_fn(p, batch, config=config, scale=scale, logit_cap=cap)[0]

    return jax.vmap(one)(params, scales, caps)


@functools.partial(jax.jit, static_argnames=("config", "opt"))
def _init_states(seeds, *, config, opt):
    return jax.vmap(lambda s: init_state(s, config, opt))(seeds)


def resolve_scale(scale: Any, head_dim: int) -> float:
    """The query-key scale as a float, in the core's vocabulary: ``None`` → ``1/sqrt(head_dim)``;
    a positive finite number → itself (``1.0`` is the unscaled attention)."""
    return float(check_scale(scale, check_int(head_dim, "head_dim")))


def remedy_settings(remedy: Any, head_dim: int) -> dict[str, Any]:
    """What a remedy spec (:meth:`jaxattn.probes.Remedy.parse`) sets in training at ``d_k = head_dim``.

    Returns:
      ``{"name", "scale", "logit_cap", "qk_norm", "sigma_reparam"}``: the core's ``scale``
      ``(1/sqrt(d_k) if sqrt_dk else 1) / temperature``, its ``logit_cap`` (``None`` or c, on the logits
      ``scale · q·k``: the unscaled ``q·k`` for ``("cap", c)``), and the :class:`ModelConfig` flags.
    """
    r = Remedy.parse(remedy)
    base = 1.0 / math.sqrt(check_int(head_dim, "head_dim")) if r.sqrt_dk else 1.0
    return {"name": r.name, "scale": base / r.temperature, "logit_cap": r.logit_cap, "qk_norm": r.qk_norm,
            "sigma_reparam": r.sigma_reparam}


def _run_settings(config: ModelConfig, scales: Any, remedies: Any, C: int) -> list[dict[str, Any]]:
    """Per run: name, scale, logit_cap, qk_norm, sigma_reparam (checked before anything compiles)."""
    if (scales is None) == (remedies is None):
        raise ValueError("give exactly one of scales= and remedies= (sequences of length C), received "
                         f"{'both' if scales is not None else 'neither'}")
    if remedies is not None:
        if isinstance(remedies, (str, Remedy)) or not isinstance(remedies, (list, tuple)):
            raise TypeError(f"remedies must be a list or tuple of remedy specs, one per run, received {remedies!r}")
        out = []
        for i, spec in enumerate(remedies):
            try:
                out.append(remedy_settings(spec, config.head_dim))
            except (TypeError, ValueError) as e:
                raise type(e)(f"remedies[{i}]: {e}") from None
        for s in out:
            if s["qk_norm"] and config.qk_layernorm:
                raise ValueError(f"remedies: {s['name']!r} sets qk_norm, and config.qk_layernorm is True: choose one")
    else:
        out = [{"name": None, "scale": resolve_scale(s, config.head_dim), "logit_cap": None,
                "qk_norm": config.qk_norm, "sigma_reparam": config.sigma_reparam} for s in scales]
    if len(out) != C:
        raise ValueError(f"seeds, learning_rates and {'remedies' if remedies is not None else 'scales'} must have the "
                         f"same non-zero length C, received {C}, {C}, {len(out)}")
    return out


def train(
    config: ModelConfig,
    task: "RecallTask | TextTask",
    opt: OptConfig,
    *,
    seeds: Sequence[int],
    learning_rates: Sequence[float],
    scales: Sequence[Any] | None = None,
    remedies: Sequence[Any] | None = None,
    chunk: int = 50,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Train C runs of the same shapes at once (``vmap``), ``opt.total_steps`` steps each.

    Run ``c`` has seed ``seeds[c]`` (its initial params and its batches), peak learning rate
    ``learning_rates[c]``, and either the query-key scale ``scales[c]`` (see :func:`resolve_scale`) or the
    remedy ``remedies[c]`` (a :class:`jaxattn.probes.Remedy` or its short form; :func:`remedy_settings`).
    Runs with equal seeds start from the same params (the embeddings, MLPs and projections; σReparam adds
    its γ = 1) and see the same batches, so runs are paired across scales and remedies.

    Runs whose remedies change the model's structure differently (qk_norm, σReparam, a cap or none) are
    separate compiled programs, called one after the other; all the runs of one structure (seeds ×
    learning rates × scales, temperatures or cap values) are one ``vmap``.

    Args:
      config, task, opt: shapes, task (:class:`RecallTask` or :class:`TextTask`) and optimizer recipe,
        shared by every run. With ``remedies``, each remedy sets ``config.qk_norm`` and
        ``config.sigma_reparam`` for its runs.
      seeds, learning_rates: sequences of length C.
      scales, remedies: exactly one of them, a sequence of length C.
      chunk: steps per compiled call (the progress callback runs between calls, and a :class:`TextTask`'s
        validation loss is taken before the first and after each).
      progress: optional ``progress(steps_done, total_steps)`` (steps summed over the compiled programs),
        called once before anything compiles and after each chunk; e.g. a :class:`jaxattn.progress.ProgressBar`.

    Returns:
      dict of NumPy arrays: every key of :data:`METRICS` with shape ``[C, steps, ...]``, plus ``seed``,
      ``learning_rate_peak``, ``scale`` and ``logit_cap`` (NaN: none) ``[C]``; with ``remedies``, ``remedy``
      ``[C]`` (the names); for a :class:`TextTask`, ``val_loss [C, E]`` at steps ``val_step [E]``.
    """
    if not isinstance(config, ModelConfig) or not isinstance(task, (RecallTask, TextTask)) or not isinstance(opt, OptConfig):
        raise TypeError("config, task and opt must be a ModelConfig, a RecallTask or TextTask, and an OptConfig")
    if config.n_vocab < task.n_vocab or config.n_ctx < task.length:
        raise ValueError(
            f"config (n_vocab={config.n_vocab}, n_ctx={config.n_ctx}) is too small for the task "
            f"(n_vocab={task.n_vocab}, length={task.length}); use ModelConfig.for_task"
        )
    C = len(seeds)
    if len(learning_rates) != C or C == 0:
        raise ValueError(f"seeds, learning_rates and {'remedies' if remedies is not None else 'scales'} must have "
                         f"the same non-zero length C, received {len(seeds)}, {len(learning_rates)}")
    seeds_a = np.asarray([_seed(s, f"seeds[{i}]") for i, s in enumerate(seeds)], np.uint32)
    lrs = np.asarray([_non_negative_float(lr, f"learning_rates[{i}]") for i, lr in enumerate(learning_rates)],
                     np.float32)
    settings = _run_settings(config, scales, remedies, C)
    chunk = check_int(chunk, "chunk")
    scl = np.asarray([s["scale"] for s in settings], np.float32)
    caps = np.asarray([np.nan if s["logit_cap"] is None else s["logit_cap"] for s in settings], np.float32)
    groups: dict[tuple, list[int]] = {}
    for c, s in enumerate(settings):
        groups.setdefault((s["qk_norm"], s["sigma_reparam"], s["logit_cap"] is not None), []).append(c)
    text = isinstance(task, TextTask)
    data = jnp.asarray(load_text()["train"]) if text else None
    val_batch = text_validation_batch(task) if text else None
    total = opt.total_steps * len(groups)
    if progress is not None:  # before anything compiles
        progress(0, total)
    parts, val_parts, order, done_all = [], [], [], 0
    for (qk_norm, sigma, capped), idx in groups.items():
        cfg = dataclasses.replace(config, qk_norm=qk_norm, sigma_reparam=sigma)
        g_seeds, g_lrs, g_scl = jnp.asarray(seeds_a[idx]), jnp.asarray(lrs[idx]), jnp.asarray(scl[idx])
        g_caps = jnp.asarray(caps[idx]) if capped else None
        states = _init_states(g_seeds, config=cfg, opt=opt)
        pieces, vals, val_steps, done = [], [], [], 0
        while True:
            if text:
                vals.append(np.asarray(_eval_loss(states["params"], g_scl, g_caps, val_batch, config=cfg)))
                val_steps.append(done)
            if done >= opt.total_steps:
                break
            n = min(chunk, opt.total_steps - done)
            states, logged = _train_chunk(states, g_seeds, g_lrs, g_scl, g_caps, data, num_steps=n, config=cfg,
                                          task=task, opt=opt)
            pieces.append(jax.device_get(logged))
            done += n
            done_all += n
            if progress is not None:
                progress(done_all, total)
        parts.append({name: np.swapaxes(np.concatenate([p[name] for p in pieces]), 0, 1) for name in METRICS})
        if text:
            val_parts.append(np.stack(vals, axis=1))  # [C_group, E]
        order.extend(idx)
    inverse = np.argsort(np.asarray(order))  # back to the caller's run order
    history = {name: np.concatenate([p[name] for p in parts])[inverse] for name in METRICS}
    if text:
        history["val_loss"] = np.concatenate(val_parts)[inverse]
        history["val_step"] = np.asarray(val_steps, np.int32)
    history["seed"] = seeds_a
    history["learning_rate_peak"] = lrs
    history["scale"] = scl
    history["logit_cap"] = caps
    if remedies is not None:
        history["remedy"] = np.asarray([s["name"] for s in settings])
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
      at any logged step), ``max_logit`` (the largest attention logit at any step); where the history has
      them, ``remedy`` (the name), ``final_val_loss`` (the last validation loss), and per layer ``[L]``
      (means over heads and over the last ``window`` steps) ``final_entropy``, ``final_max_weight``,
      ``final_logit_grad``.
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
        row = {
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
        if "remedy" in history:
            row["remedy"] = str(history["remedy"][c])
        if "val_loss" in history:
            row["final_val_loss"] = float(history["val_loss"][c, -1])
        for name in ("entropy", "max_weight", "logit_grad"):
            if name in history:
                row[f"final_{name}"] = np.mean(history[name][c, -w:], axis=(0, 2)).tolist()  # [L]
        rows.append(row)
    return rows
