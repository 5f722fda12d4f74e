"""The effect tables as the plain Python loop they stand for: one jitted whole forward per intervention.

The reference the tables' compiled programs are checked against, written from the public API alone:
``bound(head_mask=...)`` for ablations, ``bound(patch={name: (value, where)})`` for patches, with the
masks of :func:`jaxattn.interventions.head_masks` / :func:`~jaxattn.interventions.head_where` or, for a
position site, a ``where [L, T, 1]`` that selects one (layer, position) pair.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import interventions


def loop_table(bound, metric, *, name=None, value=None, gate=0.0, positions=None):
    """``[L, N]`` (or ``[L, P]`` for a position site): each intervention's metric minus the clean one's.

    ``name=None`` ablates each head (its gate set to ``gate``); otherwise patches ``name`` with ``value``
    (``positions``: the query positions of a head site patched together, or the positions of a position
    site patched one at a time)."""
    L, N = bound.n_layers, bound.n_heads
    if name is None:
        one = jax.jit(lambda args, mask: metric(bound.apply(args, head_mask=mask)))
        clean = float(one(bound.args, jnp.ones((L, N), jnp.float32)))
        masks = interventions.head_masks(L, N, value=gate)
        return np.array([float(one(bound.args, m)) - clean for m in masks]).reshape(L, N)
    one = jax.jit(lambda args, where: metric(bound.apply(args, patch={name: (value, where)})))
    captured = bound(capture=(name,)).captured[name]
    shape = captured.shape[1:] if bound.batch is not None else captured.shape  # [L, ...]
    if name in interventions.POSITION_SITES:
        T = shape[1]
        cols = np.arange(T) if positions is None else np.flatnonzero(positions)
        layer, pos = np.arange(L)[:, None, None], np.arange(T)[None, :, None]
        wheres = [jnp.asarray((layer == l) & (pos == t)) for l in range(L) for t in cols]
        rows = (L, len(cols))
    else:
        wheres = list(interventions.head_where(name, shape, positions=positions))
        rows = (L, -1)
    clean = float(one(bound.args, jnp.zeros_like(wheres[0])))
    return np.array([float(one(bound.args, w)) - clean for w in wheres]).reshape(rows)
