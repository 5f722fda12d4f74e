"""Does it train without √d_k? (public face of :mod:`jaxattn._train`; see there for the details).

The task, generated from a seed (no downloads)::

    RecallTask, recall_batch

A small decoder-only Transformer (GPT-2 pre-LN blocks on :func:`jaxattn.multi_head_attention`, the
query-key ``scale`` an argument, optional qk-layernorm) as plain functions over a params pytree::

    ModelConfig, init_params, forward, loss_fn

Training with optax (AdamW, warm-up + cosine, clipping, weight decay) and the probes logged per step;
:func:`train` runs many configurations at once with ``jax.vmap``::

    OptConfig, optimizer, lr_schedule, init_state, train_step, train, resolve_scale, METRICS

Summaries of logged runs::

    summarize
"""

from jaxattn._train import (
    METRICS,
    ModelConfig,
    OptConfig,
    RecallTask,
    forward,
    init_params,
    init_state,
    loss_fn,
    lr_schedule,
    optimizer,
    recall_batch,
    resolve_scale,
    summarize,
    train,
    train_step,
)

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
