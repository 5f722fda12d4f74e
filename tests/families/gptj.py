"""A GPT-J-style causal decoder declared on jaxattn's public decoder API (nothing in jaxattn changed).

Each block reads ONE LayerNorm ``h = ln_1(x)`` and adds attention and MLP in parallel (``Family.parallel``):
``x + out_proj(attn(rot(q), rot(k), v)) + fc_out(gelu(fc_in(h)))``, q/k/v/out without biases, the MLP with
them; ``logits = ln_f(x) lm_head + bias`` (untied). RoPE turns the first ``rotary_dim`` features of each
head of q and k; it rotates HALVES of them (``decoder.rope``: pairs ``(j, j + rotary_dim/2)``) where GPT-J
rotates adjacent pairs ``(2j, 2j+1)``: the same model once q and k columns are permuted within each head
(what a loader of GPT-J weights would do; the tests' NumPy forward rotates adjacent pairs to show it).

Params (kernels ``(in, out)``, blocks stacked ``[L, ...]``)::

    transformer/wte/embedding                    [V, D]
    transformer/h/ln_1/{scale,bias}              [L, D]
    transformer/h/attn/{q,k,v,out}_proj/kernel   [L, D, D]   (D = N·H)
    transformer/h/mlp/fc_in/{kernel,bias}        [L, D, I], [L, I]
    transformer/h/mlp/fc_out/{kernel,bias}       [L, I, D], [L, D]
    transformer/ln_f/{scale,bias}                [D]
    lm_head/{kernel,bias}                        [D, V], [V]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import decoder, merge_heads, split_heads
from jaxattn.checkpoint import unflatten
from jaxattn.models import ModelSpec, QKWeights, Sizes

LAYOUT = "GPT-J names, kernels (in, out), blocks stacked"
CAUSAL = True


class GPTJConfig(NamedTuple):
    """A GPT-J-style model's shape (hashable: a static argument of the compiled programs)."""

    vocab_size: int  # V
    n_positions: int  # the longest input
    n_embd: int  # D
    n_layer: int  # L
    n_head: int  # N; H = D / N
    n_inner: int  # I
    rotary_dim: int  # the features of each head RoPE turns (even, <= H)
    rope_base: float = 10000.0
    layer_norm_epsilon: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def sizes(config: GPTJConfig) -> Sizes:
    return Sizes(layers=config.n_layer, heads=config.n_head, kv_heads=config.n_head, head_dim=config.head_dim,
                 width=config.n_embd, vocab=config.vocab_size, max_length=config.n_positions)


def param_shapes(config: GPTJConfig) -> dict[str, tuple[int, ...]]:
    V, D, L, I, h = config.vocab_size, config.n_embd, config.n_layer, config.n_inner, "transformer/h/"
    return {"transformer/wte/embedding": (V, D), h + "ln_1/scale": (L, D), h + "ln_1/bias": (L, D),
            **{f"{h}attn/{n}_proj/kernel": (L, D, D) for n in ("q", "k", "v", "out")},
            h + "mlp/fc_in/kernel": (L, D, I), h + "mlp/fc_in/bias": (L, I),
            h + "mlp/fc_out/kernel": (L, I, D), h + "mlp/fc_out/bias": (L, D),
            "transformer/ln_f/scale": (D,), "transformer/ln_f/bias": (D,),
            "lm_head/kernel": (D, V), "lm_head/bias": (V,)}


def init_params(seed: int, config: GPTJConfig, std: float = 0.3) -> dict:
    """Random float32 params (NumPy): kernels and embedding ``N(0, std²)``, biases ``N(0, 0.1²)``, LN scales
    ``1 + N(0, 0.1²)``."""
    rng = np.random.default_rng(seed)
    def draw(key, shape):
        base, spread = (1.0 if key.endswith("scale") else 0.0), (std if key.endswith(("kernel", "embedding")) else 0.1)
        return base + spread * rng.standard_normal(shape)

    return unflatten({k: jnp.asarray(draw(k, s), jnp.float32) for k, s in param_shapes(config).items()})


def check_params(params, config: GPTJConfig) -> None:
    decoder.check_stacked(params, "transformer/h", config.n_layer, field="n_layer", layout=LAYOUT)
    decoder.check_tree(params, param_shapes(config), root="transformer", layout=LAYOUT, kernel_layout="(in, out)")


def _ln(x, p, eps):
    return decoder.layer_norm(x, p["scale"], p["bias"], eps)


def _embed(params, config, ids, pos):
    return decoder.embed_ids(params["transformer"]["wte"]["embedding"], ids)  # NaN rows for ids outside [0, V)


def _rotation(config, pos, size):
    return decoder.rope_table(pos, size, decoder.rope_frequencies(config.rotary_dim, config.rope_base))


def _rotate(a, rot, rd):  # [T, N, H]: RoPE on the first rd features of each head, the rest as they are
    return jnp.concatenate([decoder.rope(a[..., :rd], rot), a[..., rd:]], axis=-1)


def _qkv(p, config, x, rot, d):
    h = _ln(x, p["ln_1"], config.layer_norm_epsilon)  # [T, D]
    q, k, v = (split_heads(h @ p["attn"][f"{n}_proj"]["kernel"], config.n_head) for n in "qkv")  # [T, N, H]
    return _rotate(q, rot, config.rotary_dim), _rotate(k, rot, config.rotary_dim), v


def _attn_out(p, config, z, d):
    return merge_heads(z) @ p["attn"]["out_proj"]["kernel"]  # [T, D]


def _mlp(p, config, x, d):  # x: the stream entering the block (parallel wiring), normed by the block's one ln_1
    m, h = p["mlp"], _ln(x, p["ln_1"], config.layer_norm_epsilon)
    a = jax.nn.gelu(h @ m["fc_in"]["kernel"] + m["fc_in"]["bias"][None, :], approximate=True)  # [T, I]
    return a @ m["fc_out"]["kernel"] + m["fc_out"]["bias"][None, :]  # [T, D]


def final_norm(params, config, x):
    return _ln(x, params["transformer"]["ln_f"], config.layer_norm_epsilon)


def final_norm_linear(params, config, x, v):
    """``ln_f`` linearised at the stream ``x [..., D]`` on a part ``v`` of it, without its bias (the parts add up)."""
    lead, scale = (1,) * (x.ndim - 1), params["transformer"]["ln_f"]["scale"]
    inv = jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + config.layer_norm_epsilon)  # [..., 1], frozen at x
    return (v - jnp.mean(v, axis=-1, keepdims=True)) * inv * scale.reshape(lead + (-1,))


def unembed(params, config, x):
    return x @ params["lm_head"]["kernel"] + params["lm_head"]["bias"].reshape((1,) * (x.ndim - 1) + (-1,))


FAMILY = decoder.Family(
    name="families.gptj", config_type=GPTJConfig, sizes=sizes, check_params=check_params,
    blocks=lambda params: params["transformer"]["h"], embed=_embed, rotation=_rotation, qkv=_qkv,
    attn_out=_attn_out, mlp=_mlp, final_norm=final_norm, unembed=unembed, max_name="n_positions", parallel=True)


def forward(params, config, input_ids, **kwargs):
    return decoder.forward(FAMILY, params, config, input_ids, **kwargs)


def log_prob(params, config, input_ids, **kwargs):
    return decoder.log_prob(FAMILY, params, config, input_ids, **kwargs)


def generate(params, config, prompt_ids, **kwargs):
    return decoder.generate(FAMILY, params, config, prompt_ids, **kwargs)


def resume(params, config, resid_pre, layer, **kwargs):
    return decoder.resume(FAMILY, params, config, resid_pre, layer, **kwargs)


_DOC = dict(title="GPT-J's", config="GPTJConfig", formula="each block ``x += attn(ln_1(x)) + mlp(ln_1(x))``.")
for _fn, _doc in ((forward, decoder.FORWARD_DOC), (log_prob, decoder.LOG_PROB_DOC),
                  (generate, decoder.GENERATE_DOC), (resume, decoder.RESUME_DOC)):
    decoder.document(_fn, _doc, FAMILY, **_DOC)


def attention_input(params, config, layer, x):
    """``ln_1`` of block ``layer`` on the stream ``x [T, D]``: what its q, k, v (and its MLP) read."""
    return _ln(x, jax.tree.map(lambda a: a[layer], params["transformer"]["h"]["ln_1"]), config.layer_norm_epsilon)


def head_projections(params, config):
    """``[L, N, H, D]``: each head's rows of ``out_proj`` (``attn_out = Σ_n z[:, n] @ W[n]``)."""
    L, N, H, D = config.n_layer, config.n_head, config.head_dim, config.n_embd
    return params["transformer"]["h"]["attn"]["out_proj"]["kernel"].reshape(L, N, H, D)


def qk_weights(params, config):
    """``W_Q, W_K [L, N, D, H]`` on :func:`attention_input`, before the rotation; no biases."""
    L, N, H, D = config.n_layer, config.n_head, config.head_dim, config.n_embd
    heads = lambda w: jnp.transpose(w.reshape(L, D, N, H), (0, 2, 1, 3))  # noqa: E731
    a = params["transformer"]["h"]["attn"]
    return QKWeights(heads(a["q_proj"]["kernel"]), None, heads(a["k_proj"]["kernel"]), True, float(H) ** -0.5)


SPEC = ModelSpec(name=FAMILY.name, causal=CAUSAL, forward=forward, sizes=sizes, final_norm=final_norm, unembed=unembed,
                 final_norm_linear=final_norm_linear, attention_input=attention_input,
                 head_projections=head_projections, qk_weights=qk_weights, resume=resume, log_prob=log_prob)
