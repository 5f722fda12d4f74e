"""What the residual stream says about the next token: the logit lens and direct logit attribution.

- :func:`logit_lens`: the logits the stream entering every layer would give, read through the model's
  own final norm and unembedding;
- :func:`logit_attribution`: how much each head, MLP and the embedding add to ``logit[a] - logit[b]``
  through the final norm with its statistics frozen at the clean run (direct logit attribution).

Both read the model through its protocol (:mod:`jaxattn.models`): ``final_norm``, ``unembed``,
``head_projections`` and ``final_norm_linear``, from the module :func:`bind` keeps in the
:class:`Bound`; each is one compiled program that takes the weights as arguments.

Axis alphabet: B inputs of a batch, L layers, N heads, T tokens, P positions read, H head dim, D width,
V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.interventions import _mesh
from jaxattn.interventions._model import Bound, on_device

Array = jax.Array


def _module(bound: Any, what: str, needs: tuple[str, ...]) -> Any:
    if not isinstance(bound, Bound):
        raise TypeError(f"bound must be a jaxattn.interventions.Bound (from bind), received {type(bound).__name__}")
    if bound.module is None:
        raise ValueError(f"bound must carry its model module ({what} reads the model protocol): make it with "
                         f"interventions.bind(module, ...), received a Bound with module=None")
    module = bound.spec
    missing = [f for f in needs if getattr(module, f) is None]
    if missing:
        raise ValueError(f"{what} needs the model protocol's {', '.join(missing)} (jaxattn.models); the model "
                         f"{module.name} declares no {', '.join(missing)}")
    params, config = bound.args["params"], bound.config
    D = int(module.sizes(config).width)
    try:  # an encoder without a language-model head refuses here, before anything is traced
        jax.eval_shape(lambda p: module.unembed(p, config, jnp.zeros((D,), jnp.float32)), params)
    except ValueError as e:
        raise ValueError(f"{what} needs logits: the model {module.name} has no unembedding (no language-model head): "
                         f"{e}") from None
    return module


def _index(x: Any, name: str, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int ({what}), received {type(x).__name__}")
    return int(x)


def _positions(positions: Any, T: int) -> np.ndarray:
    if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool):
        positions = [positions]
    pos = np.asarray(positions)
    if pos.ndim != 1 or pos.shape[0] == 0 or not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"positions must be a non-empty sequence of int token positions [P] (or one int), "
                         f"received dtype {pos.dtype.name} shape {pos.shape}")
    if np.any(pos < -T) or np.any(pos >= T):
        raise ValueError(f"positions must lie in [-T, T) = [-{T}, {T}) (the bound's input columns), received "
                         f"{pos.tolist()}")
    return (pos % T).astype(np.int32)


def _length(bound: Bound) -> int:
    return int(bound.args["ids"].shape[-1])


def _args(bound: Bound) -> Any:
    """The inputs the lens runs on: padded to their bucket when the bound keeps them so (its outputs read
    chosen real positions only, so a new prompt length inside a bucket compiles nothing), else as they are."""
    return bound.args if bound.bucket is None else bound.bucket


@functools.lru_cache(maxsize=64)
def _lens_program(apply: Callable[..., Any], final_norm: Callable[..., Any], unembed: Callable[..., Any],
                  config: Any, batched: bool) -> Callable[..., Array]:
    def one(params, resid_pre, logits, pos):  # [L, T, D], [T, V], [P]
        rows = unembed(params, config, final_norm(params, config, resid_pre[:, pos]))  # [L, P, V]
        return jnp.concatenate([rows.astype(logits.dtype), logits[pos][None]])  # [L + 1, P, V]

    def run(args, pos):
        out = apply(args, capture=("resid_pre",))
        read = lambda r, l: one(args["params"], r, l, pos)  # noqa: E731
        return jax.vmap(read)(out.captured["resid_pre"], out.logits) if batched else read(
            out.captured["resid_pre"], out.logits)

    return jax.jit(run)


def logit_lens(bound: Bound, *, positions: Any, mesh: Any = None) -> Array:
    """``[L + 1, P, V]``: the logits the residual stream entering each layer would give, at ``positions``.

    Row ``l < L`` is ``unembed(final_norm(resid_pre[l]))``: the stream entering block ``l`` (row 0 is the
    embedding) read through the model's own final norm and unembedding, as if the blocks from ``l`` on
    were skipped. Row ``L`` is the model's own logits (``unembed(final_norm(resid_post[L - 1]))``).

    Args:
      bound: a causal language model on its inputs (:func:`bind`); a batched bound gives ``[B, L + 1, P, V]``.
      positions: the token positions read, ints in ``[-T, T)`` (``[P]``; one int is ``P = 1``), indexing
        the bound's (padded) input columns: under left padding ``-1`` is every sequence's last token.
      mesh: a ``jax.sharding.Mesh`` to run on, the model as its params are placed (``module.shard``: split
        over the model axis; otherwise replicated); the result comes back replicated on the mesh.

    Raises:
      TypeError, ValueError: naming ``bound`` (not a Bound; no model module; a model without an
        unembedding, such as BERT, named), ``positions`` or ``mesh``.
    """
    module = _module(bound, "logit_lens", ("final_norm", "unembed"))
    pos = _positions(positions, _length(bound))
    program = _lens_program(bound.apply, module.final_norm, module.unembed, bound.config, bound.batch is not None)
    if mesh is not None:
        _mesh.check(mesh, None, used=False)
        return _mesh.run(program, mesh, _args(bound), on_device(pos), replicate=True)
    return program(_args(bound), on_device(pos))


_DLA_CAPTURE = ("attn_out", "mlp_out", "resid_post", "resid_pre", "z")


@functools.lru_cache(maxsize=64)
def _dla_program(apply: Callable[..., Any], final_norm: Callable[..., Any], final_norm_linear: Callable[..., Any],
                 unembed: Callable[..., Any], head_projections: Callable[..., Any], attn_out_linear: Any,
                 config: Any, L: int, D: int, batched: bool) -> Callable[..., dict[str, Array]]:
    def one(params, c, bias, w, pos, a, b):
        """One sequence: its captured tensors ``c`` ([L, T, ...]) and output-projection biases ``[L, T, D]``."""
        f32 = jnp.float32
        x0 = c["resid_post"][-1, pos]  # [D], the stream the final norm reads
        zero = jnp.zeros((D,), x0.dtype)

        def diff(h):  # logit[a] - logit[b] of a final-norm output h [D]: affine in h
            y = unembed(params, config, h)
            return (y[a] - y[b]).astype(f32)

        r = jax.grad(diff)(zero.astype(f32))  # [D], the direction of the difference
        _, pull = jax.vjp(lambda v: final_norm_linear(params, config, x0, v).astype(f32), zero.astype(f32))
        (u,) = pull(r)  # [D]: a component v of the stream adds u · v through the frozen norm
        dot = lambda v: jnp.sum(v.astype(f32) * u[(None,) * (v.ndim - 1)], axis=-1)  # noqa: E731
        z = c["z"][:, pos].astype(f32)  # [L, N, H]
        if attn_out_linear is None:  # the heads' outputs join the stream as they are
            heads = jnp.einsum("lnh,lnh->ln", z, jnp.einsum("lnhd,d->lnh", w.astype(f32), u))  # [L, N]
        else:  # through the layer's post-attention norm, frozen at the raw output of z
            each = jnp.einsum("lnh,lnhd->lnd", z, w.astype(f32))  # [L, N, D]
            heads = dot(attn_out_linear(params, config, z, each))  # [L, N]
        norm_bias = final_norm(params, config, zero)  # [D], the norm's bias (0 for RMSNorm)
        unembed_bias = diff(zero)  # the unembedding's own constant term (0 without a bias)
        # the logit difference the shares decompose: the unembedding's linear part at the final norm's
        # output, which is logit[a] - logit[b] for an affine unembedding, and the difference before the cap
        # for one that soft-caps the logits (Gemma 2)
        total = jnp.sum(r * final_norm(params, config, x0).astype(f32)) + unembed_bias
        parts = {
            "embed": dot(c["resid_pre"][0, pos]),
            "heads": heads,
            "mlps": dot(c["mlp_out"][:, pos]),
            "attn_bias": dot(bias[:, pos]),
            "final_norm_bias": jnp.sum(r * norm_bias.astype(f32)),
            "unembed_bias": unembed_bias,
            "total": total,
        }
        present = {"attn_bias": jnp.any(bias != 0), "final_norm_bias": jnp.any(norm_bias != 0),
                   "unembed_bias": jnp.any(unembed(params, config, zero) != 0)}
        return parts, present

    def run(args, pos, a, b):
        params = args["params"]
        out = apply(args, capture=_DLA_CAPTURE)
        nothing = jnp.zeros((L, 1, 1, 1), jnp.float32)
        everywhere = jnp.ones((L, 1, 1, 1), bool)
        bias = apply(args, patch={"z": (nothing, everywhere)}, capture=("attn_out",)).captured["attn_out"]
        w = head_projections(params, config)  # [L, N, H, D]
        read = lambda c, s: one(params, c, s, w, pos, a, b)  # noqa: E731
        if batched:
            parts, present = jax.vmap(read)(out.captured, bias)
            return parts, jax.tree.map(jnp.any, present)
        return read(out.captured, bias)

    return jax.jit(run)


def logit_attribution(bound: Bound, pair: Any, *, position: int = -1, mesh: Any = None) -> dict[str, Array]:
    """Direct logit attribution: each part of the residual stream's share of ``logit[a] - logit[b]``.

    The stream the final norm reads at ``position`` is a sum of parts: the embedding (``resid_pre`` of
    block 0), every head's output ``z[l, n] @ W[l, n]`` (``head_projections``), every output projection's
    bias, every MLP's output. The final norm is linearised at the clean stream ``x``: its statistics
    (LayerNorm's mean and standard deviation, RMSNorm's root mean square) are those of ``x``, frozen
    (the protocol's ``final_norm_linear``), so it is linear in the stream plus its constant bias, and each
    part's share is the logit difference of that part alone through the frozen norm and the unembedding.
    Where a model normalises its attention's output before it joins the stream (Gemma 2 and 3's
    post-attention norm), each head's output goes through that norm frozen at the layer's raw output
    (the protocol's ``attn_out_linear``). The shares add up to ``total``, the clean ``logit[a] - logit[b]``,
    up to float rounding; for a model whose unembedding soft-caps its logits (Gemma 2), which is not
    linear, ``total`` is that difference before the cap.

    Args:
      bound: a causal language model on its inputs (:func:`bind`), run clean (no head mask, no patch).
      pair: ``(a, b)``, two token ids in ``[0, V)``.
      position: the token position read, an int in ``[-T, T)`` indexing the bound's input columns (under
        left padding ``-1`` is every sequence's last token).
      mesh: as in :func:`logit_lens`.

    Returns:
      float32 arrays (with a leading B axis for a batched bound): ``"embed"`` (scalar), ``"heads"``
      ``[L, N]``, ``"mlps"`` ``[L]``, ``"total"`` (scalar), and, only where the model has the bias
      (nonzero in its weights): ``"attn_bias"`` ``[L]`` (each output projection's bias),
      ``"final_norm_bias"`` (the final norm's bias, e.g. GPT-2's ``ln_f``; RMSNorm has none) and
      ``"unembed_bias"`` (a language-model head's bias). The presence of a bias is read from the weights
      (concrete values); under a caller's ``jax.vmap`` or ``jax.jit`` (traced inputs) every one of these
      keys is returned, an absent bias's share as zeros.

    Raises:
      TypeError, ValueError: naming ``bound`` (not a Bound; no model module; a model without an
        unembedding or without ``final_norm_linear``, named), ``pair`` or ``position``.
    """
    module = _module(bound, "logit_attribution", ("final_norm", "unembed", "final_norm_linear",
                                                  "head_projections"))
    sizes = module.sizes(bound.config)
    V, T = int(sizes.vocab), _length(bound)
    if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"pair must be (a, b), two token ids in [0, {V}), received {pair!r}")
    a, b = (_index(x, "pair", f"a token id in [0, {V})") for x in pair)
    if not (0 <= a < V and 0 <= b < V):
        raise ValueError(f"pair must be (a, b), two token ids in [0, {V}), received {pair!r}")
    position = _index(position, "position", f"a token position in [-{T}, {T})")
    if not -T <= position < T:
        raise ValueError(f"position must lie in [-T, T) = [-{T}, {T}) (the bound's input columns), received {position}")
    program = _dla_program(bound.apply, module.final_norm, module.final_norm_linear, module.unembed,
                           module.head_projections, module.attn_out_linear, bound.config, int(sizes.layers),
                           int(sizes.width), bound.batch is not None)
    inputs = (_args(bound), jnp.asarray(position % T, jnp.int32), jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))
    if mesh is not None:
        _mesh.check(mesh, None, used=False)
        parts, present = _mesh.run(program, mesh, *inputs, replicate=True)
    else:
        parts, present = program(*inputs)
    # presence is read from the weights; traced (under a caller's vmap or jit) it cannot choose the keys,
    # so every part comes back, an absent bias's as zeros
    return {k: v for k, v in parts.items()
            if isinstance(present.get(k, True), jax.core.Tracer) or bool(present.get(k, True))}
