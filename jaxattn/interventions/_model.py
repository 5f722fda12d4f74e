"""A model's forward on fixed inputs, as a pure function of its interventions (:class:`Bound`, :func:`bind`).

The effect tables of this package compile one program over many head masks or patches. The program must
receive the model's weights as arguments: a closure over them would bake every weight into the compiled
program as a constant, which XLA then constant-folds (on GPT-2-small shapes, 25 s to compile one forward
instead of 4 s). So a :class:`Bound` keeps the arrays (``args``) apart from the function that uses them
(``apply``), and the tables pass ``args`` through ``jax.jit``.

Axis alphabet: B inputs of a batch, L layers, N heads, T tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._inputs import batch_ids, batch_mask, check_id_values, check_mask_values
from jaxattn._sites import CAPTURE_NAMES
from jaxattn.decoder import warn_if_params_closed_over
from jaxattn.models import ModelSpec, bucket_length, spec

Array = jax.Array

def _site_rank(name: str) -> int:
    """The rank of a patch value for ``name`` without a batch axis: ``[L, ...]``."""
    return 1 + len(CAPTURE_NAMES[name][0].split())


@dataclasses.dataclass(frozen=True, eq=False)
class Bound:
    """A model's forward on fixed inputs: ``apply(args, head_mask=, patch=, capture=)`` with ``args`` apart.

    Attributes:
      apply: ``(args, *, head_mask, patch, capture) -> output``, pure in ``args``, ``head_mask [L, N]`` and
        ``patch`` (the model API's ``{name: (value, where)}``); ``capture`` is a tuple of names (static).
      args: the pytree of arrays ``apply`` reads (params, token ids, attention mask).
      n_layers, n_heads: L and N (query heads), the shape of ``head_mask`` and of every effect table.
      batch: ``None`` for one sequence, else B: ``apply`` runs ``jax.vmap`` over B sequences that share
        ``head_mask``; a patch value may carry a leading B axis (``[B, L, ...]``, e.g. captured from a
        batch of the same shape) or not (``[L, ...]``, shared); ``where`` never has one.
      module, config: the model (a module exporting ``SPEC``, or a :class:`~jaxattn.models.ModelSpec`) and
        config the forward was bound with; ``args["params"]`` holds its params.
      resume: ``(args, layer, resid_pre, attentions, *, head_mask, patch) -> output``, the forward from block
        ``layer`` on (the protocol's ``resume``), from ``resid_pre [(B,) T, D]`` with the maps
        ``attentions [(B,) L, N, T, T]`` of the blocks before it; ``None`` when the module has no ``resume``
        (the tables then run whole forwards).
      bucket: ``args`` with the ids and mask right-padded to :func:`jaxattn.models.bucket_length` (the
        padding masked), for the tables of a :class:`~jaxattn.interventions.RowMetric`, whose value does not
        depend on the length, and for the logit lens and attribution (a new prompt length inside a bucket
        then compiles nothing new); ``None`` when the inputs are traced, batched, not a causal model's, or
        already a bucket's length.
    """

    apply: Callable[..., Any]
    args: Any
    n_layers: int
    n_heads: int
    batch: int | None = None
    module: Any = None
    config: Any = None
    resume: Callable[..., Any] | None = None
    bucket: Any = None

    @property
    def spec(self) -> ModelSpec:
        """The bound model's declared protocol (:func:`jaxattn.models.spec`)."""
        return spec(self.module)

    def __call__(self, *, head_mask: Any = None, patch: Mapping[str, tuple[Any, Any]] | None = None,
                 capture: Sequence[str] = ()) -> Any:
        """The model's output with these interventions (``None``: none)."""
        return self.apply(self.args, head_mask=head_mask, patch=patch, capture=_names(capture))


def _names(capture: Any) -> tuple[str, ...]:
    if isinstance(capture, str):
        return (capture,)
    return tuple(capture)


@functools.lru_cache(maxsize=64)
def _apply_fn(forward: Callable[..., Any], config: Any, batched: bool) -> Callable[..., Any]:
    """The ``apply`` of :func:`bind`, one per (model, config, batched): every bound input of one model
    shares it, so the effect tables' compiled programs (kept per ``apply``) serve them all."""

    def one(args, ids, mask, head_mask, patch, capture):
        return forward(args["params"], config, ids, attention_mask=mask, head_mask=head_mask, patch=patch,
                       capture=capture, **args["kwargs"])

    def apply(args, *, head_mask=None, patch=None, capture=()):
        capture = _names(capture)
        if not batched:
            return one(args, args["ids"], args["mask"], head_mask, patch, capture)
        patch, axes = _batch_axes(patch)
        run = jax.vmap(lambda i, m, p: one(args, i, m, head_mask, p, capture), in_axes=(0, 0, axes))
        return run(args["ids"], args["mask"], patch)

    return apply


def _batch_axes(patch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(patch, in_axes)`` for a batched forward: a value ``[B, L, ...]`` is vmapped, ``[L, ...]`` shared."""
    patch = dict(patch or {})
    axes = {}
    for name, (value, where) in patch.items():
        if name not in CAPTURE_NAMES:
            raise ValueError(f"patch: unknown name {name!r}; the names are {', '.join(CAPTURE_NAMES)}")
        rank = _site_rank(name)
        if jnp.ndim(where) != rank:
            raise ValueError(f"patch[{name!r}] where must have {rank} axes [L, ...] (no batch axis), "
                             f"received shape {tuple(jnp.shape(where))}")
        if jnp.ndim(value) not in (rank, rank + 1):
            raise ValueError(f"patch[{name!r}] value must have shape [L, ...] or [B, L, ...] ({rank} or "
                             f"{rank + 1} axes), received shape {tuple(jnp.shape(value))}")
        axes[name] = (0 if jnp.ndim(value) == rank + 1 else None, None)
    return patch, axes


@functools.lru_cache(maxsize=64)
def _resume_fn(resume: Callable[..., Any], config: Any, batched: bool) -> Callable[..., Any]:
    """The ``resume`` of :func:`bind` (one per model, config and batching, like ``apply``); the protocol's
    ``resume`` takes a ``[T, T]`` mask with ``positions`` (packed sequences)."""

    def one(args, resid, layer, attentions, mask, head_mask, patch, **packed):
        return resume(args["params"], config, resid, layer, attention_mask=mask, head_mask=head_mask, patch=patch,
                      attentions=attentions, **packed, **args["kwargs"])

    def run(args, layer, resid_pre, attentions, *, head_mask=None, patch=None, packed=None):
        if packed is not None:  # (keep [T', T'], positions [T']): the batch packed into one sequence
            return one(args, resid_pre, layer, attentions, packed[0], head_mask, patch, positions=packed[1])
        if not batched:
            return one(args, resid_pre, layer, attentions, args["mask"], head_mask, patch)
        patch, axes = _batch_axes(patch)
        each = jax.vmap(lambda r, a, m, p: one(args, r, layer, a, m, head_mask, p), in_axes=(0, 0, 0, axes))
        return each(resid_pre, attentions, args["mask"], patch)

    return run


RESUME_KWARGS = frozenset({"scale"})  # the further forward arguments the protocol's resume takes


def on_device(x: Any) -> Any:
    """``x`` as a JAX array: a JAX array (or tracer) as it is, anything else put on the default device by
    ``jax.device_put``, which compiles nothing (``jnp.asarray`` of a NumPy array compiles a small copy
    program for each new shape)."""
    return x if isinstance(x, (jax.Array, jax.core.Tracer)) else jax.device_put(np.asarray(x))


def _on_one_device(a: Any) -> bool:
    """Whether ``a`` is a concrete JAX array whole on one device."""
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and len(a.sharding.device_set) == 1


def bind(module: Any, params: Any, config: Any, input_ids: Any, *, attention_mask: Any = None,
         **forward_kwargs: Any) -> Bound:
    """``module.forward(params, config, input_ids, ...)`` as a :class:`Bound`, for any bundled model.

    Args:
      module: a model: a module exporting the declared protocol as ``SPEC`` (``jaxattn.gpt2``,
        ``jaxattn.bert``, ``jaxattn.llama``) or a :class:`~jaxattn.models.ModelSpec` of one's own.
      params, config: as returned by ``module.load``.
      input_ids: ``[T]`` (one sequence) or ``[B, T]`` (B sequences of one padded length, run with
        ``jax.vmap`` under one head mask). May be traced: ``bind`` and every table are functions of the
        prompt, so ``jax.vmap(lambda ids: ablation_effects(bind(module, params, config, ids), metric))(batch)``
        gives one table per prompt (equal to a loop over them), and ``jax.jit`` of the same compiles it once.
      attention_mask: ``[T]`` or ``[B, T]`` like ``input_ids`` (1 = token, 0 = padding); ``None``: all real.
      **forward_kwargs: further arguments of ``module.forward`` (e.g. ``scale``, ``token_type_ids``), kept
        in ``args`` (arrays are traced, not baked in).

    Returns:
      a :class:`Bound`; ``bound()`` is the plain forward, ``bound(head_mask=m)`` ablates. Its ``resume`` is
      the model's ``resume`` (the forward from a layer on, which the effect tables use) when it declares
      one and ``forward_kwargs`` holds only arguments it takes (``scale``), else ``None``. Concrete ids of
      one sequence of a causal model are also kept padded to their bucket (:attr:`Bound.bucket`), where
      the tables of a :class:`~jaxattn.interventions.RowMetric` run: a new prompt length inside a bucket
      compiles nothing new for them.
    """
    # the tables' own jit would hide weights closed over by the caller's (they reach the forward traced)
    warn_if_params_closed_over(params, input_ids, "jaxattn.interventions.bind",
                               call="jaxattn.interventions.bind(module, p, config, ids)", stacklevel=3)
    declared = spec(module)
    # concrete arrays whole on one device are read on the host, as NumPy ones (nothing compiled per length);
    # the tables' programs put them where the params are
    input_ids, attention_mask = (np.asarray(a) if _on_one_device(a) else a for a in (input_ids, attention_mask))
    ids = batch_ids(input_ids, "input_ids")
    mask = batch_mask(attention_mask, ids.shape)
    batch = ids.shape[0] if ids.ndim == 2 else None
    apply = _apply_fn(declared.forward, config, batch is not None)
    sizes = declared.sizes(config)
    # the values of concrete ids and mask, as the forward checks them (the tables run it traced, where it cannot)
    check_id_values(input_ids, "input_ids", 0, int(sizes.vocab))
    check_mask_values(attention_mask, need_real=declared.causal)
    if attention_mask is None and isinstance(ids, jax.Array) and not isinstance(ids, jax.core.Tracer):
        mask = jax.device_put(mask, ids.sharding)  # where the ids are (split over a mesh's "data": the same split)
    args = {"params": params, "ids": on_device(ids), "mask": on_device(mask), "kwargs": dict(forward_kwargs)}
    resume = None
    if declared.resume is not None and set(forward_kwargs) <= RESUME_KWARGS:
        resume = _resume_fn(declared.resume, config, batch is not None)
    bucket = None
    if batch is None and declared.causal and set(forward_kwargs) <= RESUME_KWARGS and isinstance(ids, np.ndarray) \
            and isinstance(mask, np.ndarray) and ids.shape[0] <= sizes.max_length:
        B = bucket_length(ids.shape[0], int(sizes.max_length))
        if B > ids.shape[0]:  # padded on the host, the padding masked
            pad = (0, B - ids.shape[0])
            bucket = {**args, "ids": on_device(np.pad(ids, pad)), "mask": on_device(np.pad(mask, pad))}
    return Bound(apply, args, int(sizes.layers), int(sizes.heads), batch, module, config, resume, bucket)


def per_sequence(bound: Bound, table: Callable[..., Any], *per_sequence_args: Any) -> Any:
    """One table per sequence of a batched bound: ``table(bound of sequence b, *args_b)`` for every ``b``, stacked
    ``[B, ...]``, as one program (``jax.vmap`` over the sequences; :func:`bind` and every table are functions
    of the prompt). A batched bound's own tables are tables of ONE metric of the whole batch's output; this
    gives each sequence its own, equal to a Python loop that binds each sequence alone.

    Args:
      bound: a batched :class:`Bound` (``input_ids [B, T]``), bound by :func:`bind`.
      table: ``(one_sequence_bound, *args) -> table``, e.g. ``lambda b: ablation_effects(b, metric)``, with
        ``metric`` written for one sequence's output (``out.logits [T, V]``).
      *per_sequence_args: arrays with a leading B axis, split with the sequences (e.g. each sequence's own
        patch value ``[B, L, ...]``, read by ``lambda b, z: patching_effects(b, metric, z)``). Anything shared
        by every sequence is closed over by ``table`` instead.

    Returns:
      ``table``'s result with a leading B axis (every leaf of a pytree result).

    Raises:
      TypeError, ValueError: naming ``bound`` (not a batched Bound from :func:`bind`), ``table`` (not
        callable) or ``per_sequence_args`` (an argument without a leading axis of length B).
    """
    if not isinstance(bound, Bound) or bound.module is None:
        raise TypeError(f"bound must be a Bound made by interventions.bind, received {type(bound).__name__}")
    if bound.batch is None:
        raise ValueError("bound must be batched (bind input_ids [B, T]); a bound of one sequence gives its table "
                         "directly, received a bound of one sequence")
    if not callable(table):
        raise TypeError(f"table must be a function (one_sequence_bound, *args) -> table, received "
                        f"{type(table).__name__}")
    for i, a in enumerate(per_sequence_args):
        for leaf in jax.tree.leaves(a):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != bound.batch:
                raise ValueError(f"per_sequence_args[{i}] must have a leading axis of the bound's B = {bound.batch} "
                                 f"sequences, received shape {tuple(jnp.shape(leaf))}")
    args = bound.args

    def one(ids, mask, *xs):
        return table(bind(bound.module, args["params"], bound.config, ids, attention_mask=mask, **args["kwargs"]), *xs)

    return jax.vmap(one)(args["ids"], args["mask"], *per_sequence_args)
