"""What every bundled model shares: its output type and the protocol the rest of jaxattn asks it through.

Each model module (``jaxattn.gpt2``, ``jaxattn.llama``, ``jaxattn.bert``) defines, besides
``load``/``forward``/``save`` (and ``generate``/``log_prob`` for the causal ones), the functions of the
model protocol, and declares them in a :class:`ModelSpec` it exports as ``SPEC``; interventions, the lab
and the viewer call them through it (:func:`spec`), never through a module's parameter paths or its name:

- ``CAUSAL``: whether query ``t`` sees only keys ``s <= t``;
- ``sizes(config) -> Sizes``: layers, heads, key/value heads, head dim, width, vocabulary, longest input;
- ``final_norm(params, config, x [..., D])`` and ``unembed(params, config, x [..., D]) -> [..., V]``, so
  that ``unembed(final_norm(out.captured["resid_post"][-1])) == out.logits`` (a logit lens is one line);
- ``final_norm_linear(params, config, x [..., D], v [..., D])``: the final norm linearised at the stream
  ``x`` (its statistics frozen at ``x``'s) applied to a part ``v`` of it, without its bias, so that the
  parts of the stream add up through it (direct logit attribution); causal language models only;
- ``attention_input(params, config, layer, x [T, D])``: what layer ``layer``'s q, k, v are projected from
  (its pre-norm of the residual stream; the stream itself for a post-norm encoder);
- ``head_projections(params, config) -> [L, N, H, D]``: each head's slice of the output projection, so
  that ``attn_out[l] = Σ_n z[l, :, n] @ W[l, n] (+ bias)``;
- ``qk_weights(params, config) -> QKWeights``: the query-key weights the entropy bound needs;
- ``shard(params, config, mesh, *, model_axis="model", split_vocab=False)``: the params placed on a
  ``jax.sharding`` mesh (heads and MLP units split over ``model_axis``, Megatron style), on which
  ``forward`` (and ``log_prob``, ``generate``) run as on one device, a batch split over the mesh's data
  axis through ``jax.vmap``; ``param_shardings(config, mesh)`` says where without moving anything
  (``docs/scaling.md``).
- ``resume(params, config, resid_pre [T, D], layer, *, attention_mask, head_mask, scale, patch,
  attentions) -> ModelOutput`` (optional): the forward from block ``layer`` on, given the residual stream
  entering it, with interventions of the blocks it runs; a traced ``layer`` is accepted (one compiled
  program for every start). The effect tables resume each intervention from the clean stream entering
  its layer when a module has it, and run whole forwards when it does not (``jaxattn.bert``, an encoder
  whose post-norm blocks have none: there every table runs whole forwards).

Axis alphabet: L layers, T tokens, S keys, N query heads, K key/value heads, H head dim, D width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["BUCKETS", "ModelOutput", "ModelSpec", "QKWeights", "Sizes", "bucket_length", "head_mesh", "head_mesh_shape",
           "left_pad", "pad_to_bucket", "spec"]


class Sizes(NamedTuple):
    """A model's sizes, read from its config by the module's ``sizes(config)``."""

    layers: int  # L
    heads: int  # N, query heads
    kv_heads: int  # K, key/value heads (K = N without grouped-query attention)
    head_dim: int  # H, the paper's d_k
    width: int  # D
    vocab: int  # V
    max_length: int  # the longest input the model takes
    window: int | None = None  # a sliding window of every layer: query t sees keys s with t - s < window (None: all)
    scale_dim: float | None = None  # the default logit scale is scale_dim^-1/2 (None: head_dim^-1/2)
    layer_windows: tuple[int | None, ...] | None = None  # each layer's own window (None in it: a full layer)
    mlp: int | None = None  # the MLP's hidden width, which Megatron-style sharding splits over "model" too


class ModelSpec(NamedTuple):
    """The model protocol, declared: the functions interventions, the lab and the viewer call (the module
    docstring says what each does). Every model module exports one as ``SPEC``; a model of one's own
    passes a ``ModelSpec`` (or an object with a ``SPEC``) wherever a model module is taken.

    Attributes:
      name: for messages (``"jaxattn.llama"``).
      causal: whether query ``t`` sees only keys ``s <= t``.
      forward: ``(params, config, ids [T], *, attention_mask, head_mask, patch, capture, **kw) -> ModelOutput``.
      sizes: ``config -> Sizes``.
      final_norm, unembed, final_norm_linear, attention_input, head_projections, qk_weights: as in the module
        docstring; ``None`` where the model has none (an encoder's ``unembed``).
      resume: ``(params, config, resid_pre [T, D], layer, *, attention_mask ([T], or [T, T] with
        positions), positions, head_mask, scale, patch, attentions) -> ModelOutput``, the forward from
        block ``layer`` on; ``None``: the tables run whole forwards.
      log_prob: ``(params, config, ids [T], *, attention_mask, start, end, scale) -> scalar``; causal
        language models only.
      attn_out_linear: ``(params, config, z [L, N, H], v [L, ..., D]) -> [L, ..., D]``: each layer's part
        ``v`` of its attention's raw output (``Σ_n z[n] @ W[n]``) as it joins the stream, for a model that
        normalises that output (Gemma 2 and 3's post-attention norm, linearised at the raw output of
        ``z``); ``None``: the raw output joins the stream as it is.
    """

    name: str
    causal: bool
    forward: Callable[..., Any]
    sizes: Callable[[Any], "Sizes"]
    final_norm: Callable[..., Any] | None = None
    unembed: Callable[..., Any] | None = None
    final_norm_linear: Callable[..., Any] | None = None
    attention_input: Callable[..., Any] | None = None
    head_projections: Callable[..., Any] | None = None
    qk_weights: Callable[..., Any] | None = None
    resume: Callable[..., Any] | None = None
    log_prob: Callable[..., Any] | None = None
    attn_out_linear: Callable[..., Any] | None = None


def spec(model: Any) -> ModelSpec:
    """``model``'s :class:`ModelSpec`: ``model`` itself, or the ``SPEC`` a model module exports.

    Raises:
      TypeError: naming what to declare, for anything else.
    """
    if isinstance(model, ModelSpec):
        return model
    declared = getattr(model, "SPEC", None)
    if isinstance(declared, ModelSpec):
        return declared
    name = getattr(model, "__name__", None) or type(model).__name__
    raise TypeError(f"{name} declares no model protocol: pass a jaxattn.models.ModelSpec, or a module that exports "
                    f"one as SPEC (as jaxattn.gpt2, jaxattn.llama and jaxattn.bert do)")


class ModelOutput(NamedTuple):
    """What every model's ``forward`` returns (a pytree: ``jit``, ``vmap`` and ``grad`` pass it through).

    The residual stream: ``captured["resid_pre"][l]`` enters block ``l``, ``captured["resid_post"][l]``
    leaves it, BEFORE the final norm; ``last_hidden_state`` is the final norm's output (Hugging Face's
    ``last_hidden_state`` of the base model), and the logits are ``unembed`` of it. For a post-norm encoder
    (BERT) each block ends with its own norm and there is no final norm: ``last_hidden_state`` is
    ``resid_post[-1]``.

    Attributes:
      logits: ``[T, V]`` next-token logits (causal models); ``None`` for an encoder.
      last_hidden_state: ``[T, D]`` the final norm's output (what ``logits`` are unembedded from).
      attentions: ``[L, N, T, S]`` every layer's attention weights, one map per query head.
      captured: the tensors named in ``capture``, each stacked over layers ``[L, ...]``.
      attention_logits, q, k, v, hidden_states: sugar over ``capture``, ``None`` unless asked for with
        ``return_attention_logits`` (``captured["attn_logits"]``), ``return_qkv`` (``q [L, T, N, H]``,
        ``k, v [L, T, K, H]``) or ``return_hidden_states`` (``[L + 1, T, D]``, as Hugging Face reports
        them: ``resid_pre`` of every block, then ``last_hidden_state``).
    """

    logits: Array | None
    last_hidden_state: Array
    attentions: Array
    captured: dict[str, Array] = {}
    attention_logits: Array | None = None
    q: Array | None = None
    k: Array | None = None
    v: Array | None = None
    hidden_states: Array | None = None
    pooler_output: Array | None = None  # [D], an encoder's pooled [CLS] (BERT with a pooler), else None


@dataclasses.dataclass(frozen=True)
class QKWeights:
    """One model's query-key weights, as ``q = x W_Q + b_q``, ``k = x W_K + b_k`` on its attention input.

    ``w_q [L, N, D, H]``, ``b_q [L, N, H]`` or None, ``w_k [L, K, D, H]``, ``b_k [L, K, H]`` or None;
    ``rotary``: q and k are rotated by position afterwards (RoPE); ``scale``: the logit scale ``1/sqrt(H)``;
    ``qk_norm``: q and k are RMS-normalised per head before the rotation (the bound does not hold then).
    """

    w_q: Array
    b_q: Array | None
    w_k: Array
    rotary: bool
    scale: float
    b_k: Array | None = None
    qk_norm: bool = False


BUCKETS = (16, 32, 64, 128, 256, 512, 1024)  # sequence lengths :func:`pad_to_bucket` pads to


def bucket_length(T: int, longest: int | None = None) -> int:
    """The length a causal forward of ``T`` tokens runs at: ``T`` rounded up to a multiple of
    ``2^max(3, ceil(log2 T) - 4)``, and never past ``longest`` (the model's longest input) nor below ``T``.

    Multiples of 8 up to 128, then eight lengths per doubling, so the padding is at most 7 tokens, or
    less than an eighth of ``T``: 1-8 -> 8, 9-16 -> 16, ..., 97-104 -> 104, 129-144 -> 144, 961-1024 ->
    1024 (T = 100 runs 4 % more rows, T = 1,000 2.4 %). Every prompt length inside a bucket shares one
    compiled forward.
    """
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ValueError(f"T must be a positive int, received {T!r}")
    T = int(T)
    step = 2 ** max(3, (T - 1).bit_length() - 4)
    B = -(-T // step) * step
    if longest is None:
        return B
    return T if T > longest else min(B, longest)  # past the model's longest input: as it is (the checks refuse it)


def pad_to_bucket(input_ids: Any, *, buckets: Any = BUCKETS, pad_id: int = 0) -> tuple[Array, Array]:
    """Right-pad ``input_ids [T]`` to the smallest bucket length ``B >= T``: ``(ids [B], attention_mask [B])``.

    Each distinct input length compiles its own forward; padded to a handful of bucket lengths, an
    experiment over many sentences compiles a handful of programs. With the returned mask, a causal
    model's forward gives at positions ``< T`` the logits and maps of the sequence alone (the pads come
    after them, and are masked as keys), so slice ``[:T]`` (``[..., :T, :T]`` for maps). A ``T`` above
    the largest bucket is returned as it is.

    Raises:
      ValueError: naming ``input_ids`` (not integer ids ``[T]``, or no token at all), ``buckets`` (not a
        non-empty sequence of increasing positive ints) or ``pad_id`` (not an int).
    """
    ids = np.asarray(input_ids)
    if ids.ndim == 1 and ids.shape[0] == 0:  # checked first: np.asarray([]) is float
        raise ValueError("input_ids must hold at least one token id, received an empty sequence (shape (0,))")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integer token ids [T], received dtype {ids.dtype} shape {ids.shape}")
    sizes = _buckets(buckets)
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
        raise ValueError(f"pad_id must be an int token id, received {pad_id!r}")
    T = ids.shape[0]
    B = next((b for b in sizes if b >= T), T)
    padded = np.full((B,), pad_id, np.int32)
    padded[:T] = ids
    return jnp.asarray(padded), jnp.asarray(np.arange(B) < T)


def _buckets(buckets: Any) -> tuple[int, ...]:
    """``buckets`` as a tuple of ints, checked: non-empty, positive, increasing."""
    received = f"received {buckets!r}"
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise ValueError(f"buckets must be a non-empty sequence of increasing positive ints, {received}")
    sizes = tuple(buckets)
    if (not sizes or any(isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b < 1 for b in sizes)
            or any(a >= b for a, b in zip(sizes, sizes[1:]))):
        raise ValueError(f"buckets must be a non-empty sequence of increasing positive ints, {received}")
    return tuple(int(b) for b in sizes)


def left_pad(sequences: Any, *, pad_id: int = 0, length: int | None = None) -> tuple[Array, Array]:
    """LEFT-pad token-id lists of different lengths into ``(ids [B, T], attention_mask [B, T])``.

    ``T`` is the longest sequence (or ``length``, if given and not shorter). Left padding puts every
    sequence's last token in the last column, where a causal model's ``generate`` continues it; every
    model's ``forward`` and ``log_prob`` give at the real positions what the sequence alone gives. Run
    a batch with ``jax.vmap`` over both arrays. ``log_prob``'s ``start``/``end`` index the padded
    columns: position ``t`` of sequence ``b`` is column ``t + T - len(b)``.
    """
    rows = []
    for b, seq in enumerate(sequences):
        a = np.asarray(seq)
        if a.ndim != 1 or a.shape[0] == 0 or not (np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"sequences[{b}] must be a non-empty list of integer token ids, received dtype "
                             f"{a.dtype} shape {a.shape}")
        rows.append(a)
    if not rows:
        raise ValueError("sequences must hold at least one sequence")
    T = max(len(r) for r in rows)
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < T:
            raise ValueError(f"length must be an int >= the longest sequence ({T}), received {length!r}")
        T = int(length)
    ids = np.full((len(rows), T), pad_id, np.int32)
    mask = np.zeros((len(rows), T), bool)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
        mask[b, T - len(r):] = True
    return jnp.asarray(ids), jnp.asarray(mask)


def head_mesh_shape(n_devices: int, heads: int, kv_heads: int | None = None, mlp: int | None = None) -> tuple[int, int]:
    """``(data, model)``: the largest ``"model"`` axis that divides both head counts (and the MLP width
    ``mlp``, when given) and fits in ``n_devices``, and as many ``"data"`` rows of it as the devices allow
    (``data · model <= n_devices``; the rest unused).

    Megatron-style sharding splits the heads and the MLP's hidden units over ``"model"``, so its size must
    divide ``heads``, ``kv_heads`` and ``mlp``. SmolLM2 (9 query, 3 key/value heads, MLP 1536) on 8
    devices: ``(2, 3)``, 6 devices used.
    """
    for name, value in (("n_devices", n_devices), ("heads", heads), ("mlp", 1 if mlp is None else mlp)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, received {value!r}")
    kv = heads if kv_heads is None else kv_heads
    if isinstance(kv, bool) or not isinstance(kv, (int, np.integer)) or kv < 1 or heads % kv:
        raise ValueError(f"kv_heads must be an int >= 1 dividing heads={heads}, received {kv_heads!r}")
    width = kv if mlp is None else mlp
    model = max(m for m in range(1, min(n_devices, kv) + 1) if kv % m == 0 and heads % m == 0 and width % m == 0)
    return int(n_devices) // model, model


def head_mesh(sizes: Sizes, devices: Sequence[Any] | None = None, axis_names: tuple[str, str] = ("data", "model")) -> Any:
    """A ``jax.sharding.Mesh`` ``(data, model)`` whose ``"model"`` axis the model's heads divide
    (:func:`head_mesh_shape` of ``len(devices)``, ``sizes.heads``, ``sizes.kv_heads`` and ``sizes.mlp``), over
    the first ``data · model`` of ``devices`` (default ``jax.devices()``); ``sizes`` is the module's ``sizes(config)``.
    Explicit axes (``jax.make_mesh``'s default), for ``module.load(..., mesh=)`` and ``module.shard``."""
    import jax

    if not isinstance(sizes, Sizes):
        raise TypeError(f"sizes must be a model's Sizes (module.sizes(config)), received {type(sizes).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    data, model = head_mesh_shape(len(devices), sizes.heads, sizes.kv_heads, sizes.mlp)
    return jax.make_mesh((data, model), axis_names, devices=devices[:data * model])
