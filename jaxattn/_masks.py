"""Boolean keep-masks: True means "this query may attend to this key".

Masks are combined with ``logical_and`` (:func:`combine_masks`) and applied inside the softmax with a
finite fill, so a row whose keys are all masked gives zero weights and zero output, never NaN.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxattn._checks import as_bool_array
from jaxattn._typing import Array, ArrayLike, Bool, Int


def _check_length(n: Any, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name} must be a non-negative Python int, received {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, received {n}")
    return int(n)


def clamp_offset(offset: int, T: int, S: int) -> int:
    """A causal offset clamped to ``[-T, S]``, the range in which it changes the mask ``[T, S]``.

    Any ``offset >= S`` lets every query see every key, any ``offset <= -T`` lets no query see any key;
    clamping keeps the mask identical and the index arithmetic inside int32.
    """
    return max(-T, min(S, int(offset)))


def causal_mask(T: int, S: int | None = None, offset: int = 0) -> Bool[Array, "T S"]:
    """Causal keep-mask ``[T, S]``: query ``i`` may attend to key ``j`` iff ``j <= i + offset``.

    ``offset=0`` aligns query 0 with key 0 (self-attention over one sequence, the convention of
    ``jax.nn.dot_product_attention(is_causal=True)``). For queries that continue a cached prefix of
    ``S - T`` keys, pass ``offset=S - T``.

    Args:
      T: number of queries.
      S: number of keys; ``None`` means ``T``.
      offset: how many keys past the diagonal each query may still see (may be negative). Any Python
        int is accepted: ``offset >= S`` keeps every key, ``offset <= -T`` none (it is clamped to
        ``[-T, S]``, which gives the same mask).

    Returns:
      bool ``[T, S]``.
    """
    T = _check_length(T, "T")
    S = T if S is None else _check_length(S, "S")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"offset must be a Python int, received {offset!r}")
    i = jnp.arange(T)[:, None]  # [T, 1]
    j = jnp.arange(S)[None, :]  # [1, S]
    return j <= i + clamp_offset(offset, T, S)  # [T, S]


def check_window(local_window_size: Any, name: str = "local_window_size") -> tuple[int, int] | None:
    """``local_window_size`` as ``(left, right)`` Python ints >= 0 (an int ``w`` is ``(w, w)``), or None.

    jax.nn.dot_product_attention's meaning: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``.
    """
    if local_window_size is None:
        return None
    pair = local_window_size if isinstance(local_window_size, (tuple, list)) else (local_window_size, local_window_size)
    if len(pair) != 2 or any(isinstance(w, bool) or not isinstance(w, (int, np.integer)) for w in pair):
        raise TypeError(
            f"{name} must be None, a Python int w (the window (w, w)) or a pair (left, right) of Python ints "
            f"(they choose the compiled program), received {local_window_size!r}"
        )
    left, right = int(pair[0]), int(pair[1])
    if left < 0 or right < 0:
        raise ValueError(f"{name} must be >= 0 on both sides, received (left, right) = ({left}, {right})")
    return left, right


def window_mask(T: int, S: int | None = None, local_window_size: Any = None, offset: int = 0) -> Bool[Array, "T S"]:
    """Sliding-window keep-mask ``[T, S]``: query ``i`` sees key ``j`` iff ``i + offset - left <= j <= i + offset + right``.

    ``local_window_size`` is ``jax.nn.dot_product_attention``'s: ``(left, right)`` keys on each side of
    the diagonal, or an int ``w`` for ``(w, w)``. A causal window of ``W`` keys (the query and the
    ``W - 1`` before it: query ``t`` sees key ``s`` iff ``0 <= t - s < W``, the convention of Mistral's and
    Gemma's ``sliding_window = W``) is ``is_causal=True`` with ``local_window_size=(W - 1, 0)``.
    ``offset`` moves the diagonal as :func:`causal_mask`'s does (``S - T`` for queries that continue
    ``S - T`` earlier keys).

    Returns:
      bool ``[T, S]``.
    """
    T = _check_length(T, "T")
    S = T if S is None else _check_length(S, "S")
    window = check_window(local_window_size)
    if window is None:
        raise TypeError("local_window_size must be given: (left, right) or an int")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"offset must be a Python int, received {offset!r}")
    return window_keep(window, int(offset), T, S)


def window_keep(window: tuple[int, int], offset: int, T: int, S: int) -> Array:
    """:func:`window_mask` of checked arguments (``[T, S]`` bool); the index arithmetic stays inside int32."""
    left, right = (min(w, T + S + abs(offset)) for w in window)
    offset = clamp_offset(offset, T + left + right, S + left + right)
    d = jnp.arange(S)[None, :] - jnp.arange(T)[:, None] - offset  # [T, S], key minus the query's diagonal
    return jnp.logical_and(d >= -left, d <= right)  # [T, S]


def padding_mask(lengths: Int[ArrayLike, "*batch"], S: int) -> Bool[Array, "*batch S"]:
    """Key-padding keep-mask: position ``j`` is kept iff ``j < length``.

    Args:
      lengths: integer array of any shape ``[...]`` (e.g. ``[B]``), the number of real keys.
      S: padded key length.

    Returns:
      bool ``[..., S]``. For one example (a scalar length) this is ``[S]``, which broadcasts against
      ``[T, S]`` and ``[N, T, S]`` as a mask for every query and head; ``vmap`` a batch of lengths.
    """
    S = _check_length(S, "S")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must be an integer array, received dtype {lengths.dtype.name}")
    positions = jnp.arange(S).reshape((1,) * lengths.ndim + (S,))  # [1..., S]
    return positions < lengths[..., None]  # [..., S]


def combine_masks(*masks: Bool[ArrayLike, "*#shape"] | None) -> Bool[Array, "*shape"] | None:
    """``logical_and`` of the given keep-masks, broadcasting their shapes; ``None`` entries are skipped.

    Returns ``None`` when every mask is ``None`` (attend everywhere).
    """
    kept = [as_bool_array(m, f"masks[{i}]") for i, m in enumerate(masks) if m is not None]
    if not kept:
        return None
    try:
        shape = np.broadcast_shapes(*(tuple(m.shape) for m in kept))
    except ValueError:
        shapes = ", ".join(str(tuple(m.shape)) for m in kept)
        raise ValueError(f"masks must broadcast against each other, received shapes {shapes}") from None
    out = jnp.broadcast_to(kept[0], shape)
    for m in kept[1:]:
        out = jnp.logical_and(out, jnp.broadcast_to(m, shape))
    return out
