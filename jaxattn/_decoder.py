"""One causal decoder for every bundled family: the forward, the key/value-cache generation, span scores.

A family (GPT-2, the Llama family) supplies a :class:`Family`: its sizes, embedding, the block's q/k/v
(its pre-norm and RoPE included), output projection and MLP (its pre-norm included), the final norm and
the unembedding. Everything else, the residual stream, the named sites (capture, patch), the head mask,
causal attention through :func:`jaxattn.multi_head_attention`, padding, the cache and sampling, is
written here once.

Axis alphabet: T tokens (queries; keys are the same tokens, S = T), N query heads, K key/value heads, H
head dim, D width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._attention import attention_logits, multi_head_attention
from jaxattn._checks import check_int, check_scale
from jaxattn._nn import attention_mask as attention_mask_
from jaxattn._nn import causal_layer, check_span, positions, sampling, span_log_prob, token_ids
from jaxattn._nn import head_mask as head_mask_
from jaxattn._sites import Sites, check_capture, check_patch, site_shapes, sugar_names, with_sugar
from jaxattn.models import ModelOutput, Sizes

Array = jax.Array


class Family(NamedTuple):
    """What a decoder family supplies (module-level functions: the tuple is hashable, a static argument).

    Attributes:
      name: the family's module, for messages (``"jaxattn.llama"``).
      config_type: its config class.
      sizes: ``config -> Sizes``.
      check_params: ``(params, config) -> None``, raising ``ValueError`` naming the key at fault.
      layer: ``(params, i) -> p``, block ``i``'s params (every block's pytree has one structure).
      embed: ``(params, config, ids [T], pos [T]) -> [T, D]``, NaN rows for ids outside ``[0, V)``.
      rotation: ``(config, pos [T], size) -> rot`` handed to ``qkv`` (``None`` without RoPE).
      qkv: ``(p, config, x [T, D], rot) -> (q [T, N, H], k [T, K, H], v [T, K, H])``.
      attn_out: ``(p, config, z [T, N, H]) -> [T, D]``, the output projection.
      mlp: ``(p, config, x [T, D]) -> [T, D]``, the MLP sublayer's contribution (its norm included).
      final_norm, unembed: ``(params, config, x [..., D])``.
      window: ``config -> int | None``, a sliding window (query t sees keys s with t - s < window).
      max_name: the config field of the longest input, for messages.
    """

    name: str
    config_type: type
    sizes: Callable[[Any], Sizes]
    check_params: Callable[[Any, Any], None]
    layer: Callable[[Any, int], Any]
    embed: Callable[..., Array]
    rotation: Callable[..., Any]
    qkv: Callable[..., tuple[Array, Array, Array]]
    attn_out: Callable[..., Array]
    mlp: Callable[..., Array]
    final_norm: Callable[..., Array]
    unembed: Callable[..., Array]
    window: Callable[[Any], int | None]
    max_name: str


def check_config(family: Family, config: Any) -> Sizes:
    if not isinstance(config, family.config_type):
        raise TypeError(f"config must be a {family.config_type.__name__}, received {type(config).__name__}")
    return family.sizes(config)


def _ids(family: Family, config: Any, x: Any, name: str = "input_ids") -> Array:
    s = family.sizes(config)
    return token_ids(x, name, low=0, high=s.vocab, max_length=s.max_length, max_name=family.max_name)


def _keep(mask: Any, T: int, *, name: str = "attention_mask") -> Array:
    """The keep-mask ``[T]``; a concrete mask must mark at least one real token."""
    keep = attention_mask_(mask, T)
    if mask is not None and not isinstance(keep, jax.core.Tracer) and not bool(jnp.any(keep)):
        raise ValueError(f"{name} marks no real token (all {T} entries are 0): there is nothing to run the model on")
    return keep


def _key_mask(keep: Array, pos: Array, window: int | None) -> Array:
    """The keep-mask ``[S]`` (padded keys out) or, under a sliding window, ``[T, S]``.

    The window counts positions (real tokens only), so a padded sequence sees the window of the
    sequence alone; causality itself comes from ``is_causal`` (slot order, which padding keeps).
    """
    if window is None:
        return keep  # [S]
    return keep[None, :] & (pos[:, None] - pos[None, :] < window)  # [T, S]


# ----------------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("family", "config", "capture"))
def _forward(params, ids, keep, heads, scale, patch, *, family: Family, config, capture) -> ModelOutput:
    s = family.sizes(config)
    L, N, K, T = s.layers, s.heads, s.kv_heads, ids.shape[0]
    sites = Sites(capture, patch)
    pos = positions(keep)  # [T], real tokens counted from 0 (as Hugging Face's generate does for padding)
    x = family.embed(params, config, ids, pos)  # [T, D]
    rot = family.rotation(config, pos, T)
    mask = _key_mask(keep, pos, family.window(config))  # [S] or [T, S]
    weights = None  # [L, N, T, T], filled in place layer by layer (no stacking copy at the end)
    for i in range(L):
        p = family.layer(params, i)
        x = sites("resid_pre", i, x)  # [T, D]
        q, k, v = (sites(name, i, a) for name, a in zip("qkv", family.qkv(p, config, x, rot)))  # [T, N|K, H]
        z, weights = causal_layer(q, k, v, mask, scale, weights, i, L, sites)  # [T, N, H], [L, N, T, T]
        if "attn_logits" in capture:  # per query head, against its key head: the softmax's own input
            k_rep = jnp.repeat(k, N // K, axis=1)  # [T, N, H]
            sites("attn_logits", i, jax.vmap(lambda qn, kn: attention_logits(qn, kn, scale=scale), in_axes=1)(q, k_rep))
        z = sites("z", i, z) * heads[i][None, :, None].astype(z.dtype)  # [T, N, H], each head times its gate
        a = sites("attn_out", i, family.attn_out(p, config, z))  # [T, D]
        x = sites("resid_mid", i, x + a)  # [T, D]
        m = sites("mlp_out", i, family.mlp(p, config, x))  # [T, D]
        x = sites("resid_post", i, x + m)  # [T, D]
    h = family.final_norm(params, config, x)  # [T, D]
    return ModelOutput(logits=family.unembed(params, config, h), last_hidden_state=h, attentions=weights,
                       captured=sites.captured())


def forward(family: Family, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
            head_mask: Any = None, scale: Any = None, return_attention_logits: bool = False,
            return_qkv: bool = False, return_hidden_states: bool = False, capture: Any = (),
            patch: Any = None) -> ModelOutput:
    """The checked forward of a family (each model module's ``forward`` documents it)."""
    s = check_config(family, config)
    family.check_params(params, config)
    ids = _ids(family, config, input_ids)
    T = ids.shape[0]
    keep = _keep(attention_mask, T)
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.head_dim)
    shapes = site_shapes(T=T, S=T, N=s.heads, K=s.kv_heads, H=s.head_dim, D=s.width)
    asked = check_capture(capture)
    flags = dict(want_logits=bool(return_attention_logits), want_qkv=bool(return_qkv),
                 want_hidden=bool(return_hidden_states))
    out = _forward(params, ids, keep, heads, jnp.asarray(scale, jnp.float32), check_patch(patch, shapes, s.layers),
                   family=family, config=config, capture=sugar_names(asked, **flags))
    return with_sugar(out, asked, **flags)


def log_prob(family: Family, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
             start: Any = 0, end: Any = None, scale: Any = None) -> Array:
    """The checked span score of a family (each model module's ``log_prob`` documents it)."""
    check_config(family, config)
    ids = _ids(family, config, input_ids)
    end = check_span(start, end, ids.shape[0])
    keep = _keep(attention_mask, ids.shape[0])
    out = forward(family, params, config, ids, attention_mask=keep, scale=scale)
    return span_log_prob(out.logits, ids, keep, start, end)


# ----------------------------------------------------------------------------------------------------
# Generation with a key/value cache: the layers run as one lax.scan over stacked block params, so the
# prompt pass and the one-token step each compile ONE block, whatever the depth.
# ----------------------------------------------------------------------------------------------------


def _pick(logits: Array, key: Array, temperature: Array, greedy: bool) -> Array:
    """The next token from ``logits [V]``: the argmax, or a draw from ``softmax(logits / temperature)``.

    The draw uses ``(logits - max) / temperature`` with the maximum's entries exactly 0, so a tiny
    temperature (even one that underflows to 0) concentrates on the argmax instead of overflowing.
    """
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    x = logits.astype(jnp.float32)
    top = jnp.max(x)
    scaled = jnp.where(x == top, 0.0, (x - top) / temperature)  # [V], <= 0
    return jax.random.categorical(key, scaled).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("family", "config", "max_new_tokens", "greedy"))
def _generate(params, prompt, keep, heads, scale, temperature, key, *, family: Family, config, max_new_tokens,
              greedy):
    s = family.sizes(config)
    T, new = prompt.shape[0], max_new_tokens
    total = T + new
    window = family.window(config)
    blocks = jax.tree.map(lambda *a: jnp.stack(a), *[family.layer(params, i) for i in range(s.layers)])  # [L, ...]
    pos = positions(keep)  # [T]
    next_pos = jnp.sum(keep).astype(jnp.int32)  # the first new token's position
    key_pos = jnp.concatenate([pos, next_pos + jnp.arange(new, dtype=jnp.int32)])  # [total]
    key_keep = jnp.concatenate([keep, jnp.ones((new,), bool)])  # [total]: new tokens are real

    def block(x, p, gate, rot, q_pos, k_all, v_all, at):
        """One block on rows ``x [w, D]`` written at cache slots ``at..at+w-1`` of ``k_all, v_all [total, K, H]``."""
        q, k, v = family.qkv(p, config, x, rot)  # [w, N, H], 2 x [w, K, H]
        k_all = jax.lax.dynamic_update_slice(k_all, k.astype(k_all.dtype), (at, 0, 0))
        v_all = jax.lax.dynamic_update_slice(v_all, v.astype(v_all.dtype), (at, 0, 0))
        rows = at + jnp.arange(x.shape[0])  # [w], cache slots of the rows
        visible = (jnp.arange(total)[None, :] <= rows[:, None]) & key_keep[None, :]  # [w, total]
        if window is not None:
            visible &= q_pos[:, None] - key_pos[None, :] < window
        z, _ = multi_head_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask=visible, scale=scale)
        z = z * gate[None, :, None].astype(z.dtype)  # [w, N, H]
        x = x + family.attn_out(p, config, z)
        return x + family.mlp(p, config, x), k_all, v_all  # [w, D]

    # The prompt, at once: each layer's keys and values become the cache's first T slots.
    x = family.embed(params, config, prompt, pos)  # [T, D]
    rot = family.rotation(config, pos, total)
    dtype = jax.eval_shape(lambda: family.qkv(family.layer(params, 0), config, x, rot))[1].dtype
    empty = jnp.zeros((total, s.kv_heads, s.head_dim), dtype)  # [total, K, H]

    def prompt_layer(x, layer):
        p, gate = layer
        x, k_all, v_all = block(x, p, gate, rot, pos, empty, empty, 0)
        return x, (k_all, v_all)

    x, (cache_k, cache_v) = jax.lax.scan(prompt_layer, x, (blocks, heads))  # [T, D], 2 x [L, total, K, H]
    last = jnp.max(jnp.where(keep, jnp.arange(T), -1))  # the last real token: it predicts the first new one
    logits0 = family.unembed(params, config, family.final_norm(params, config, x[last]))  # [V]
    keys = jax.random.split(key, new)
    first = _pick(logits0, keys[0], temperature, greedy)

    def token_step(carry, i):  # one compiled step serves every new token
        token, cache_k, cache_v = carry
        at = T + i
        q_pos = (next_pos + i)[None]  # [1]
        x = family.embed(params, config, token[None], q_pos)  # [1, D]
        rot = family.rotation(config, q_pos, total)

        def layer_step(c, layer):
            x, cache_k, cache_v = c
            p, gate, l = layer
            x, k_l, v_l = block(x, p, gate, rot, q_pos, cache_k[l], cache_v[l], at)
            return (x, cache_k.at[l].set(k_l), cache_v.at[l].set(v_l)), None

        (x, cache_k, cache_v), _ = jax.lax.scan(layer_step, (x, cache_k, cache_v), (blocks, heads, jnp.arange(s.layers)))
        logits = family.unembed(params, config, family.final_norm(params, config, x[0]))  # [V]
        return (_pick(logits, keys[i + 1], temperature, greedy), cache_k, cache_v), (token, logits)

    (final, _, _), (tokens, step_logits) = jax.lax.scan(token_step, (first, cache_k, cache_v), jnp.arange(new - 1))
    ids = jnp.concatenate([prompt, tokens, final[None]])  # [T + new]
    return ids, jnp.concatenate([logits0[None], step_logits])  # [T + new], [new, V]: each token's logits


def generate(family: Family, params: Any, config: Any, prompt_ids: Any, *, max_new_tokens: Any,
             attention_mask: Any = None, head_mask: Any = None, temperature: Any = 0.0, key: Any = None,
             scale: Any = None, return_logits: bool = False) -> Any:
    """The checked generation of a family (each model module's ``generate`` documents it)."""
    s = check_config(family, config)
    family.check_params(params, config)
    new = check_int(max_new_tokens, "max_new_tokens")
    ids = _ids(family, config, prompt_ids, "prompt_ids")
    if ids.shape[0] + new > s.max_length:
        raise ValueError(f"prompt_ids T={ids.shape[0]} plus max_new_tokens={new} exceeds "
                         f"{family.max_name}={s.max_length}")
    keep = _keep(attention_mask, ids.shape[0])
    heads = head_mask_(head_mask, s.layers, s.heads)
    scale = check_scale(scale, s.head_dim)
    greedy, key = sampling(temperature, key)
    out, logits = _generate(params, ids, keep, heads, jnp.asarray(scale, jnp.float32),
                            jnp.asarray(0.0 if greedy else temperature, jnp.float32), key, family=family,
                            config=config, max_new_tokens=new, greedy=greedy)
    return (out, logits) if return_logits else out


def stack_layers(family: Family, params: Any, config: Any) -> Any:
    """Every block's params stacked over layers, ``[L, ...]`` leaves (for the protocol's per-layer tables)."""
    L = family.sizes(config).layers
    return jax.tree.map(lambda *a: jnp.stack(a), *[family.layer(params, i) for i in range(L)])

