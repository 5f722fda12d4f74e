"""Shape-annotated array types for the public signatures: ``Float[ArrayLike, "T H"]`` and friends.

The annotations use jaxtyping (https://docs.kidger.site/jaxtyping/) and the axis alphabet of
:mod:`jaxattn._attention`. jaxtyping is a dev/test dependency only: the tests check every public
signature at run time with ``jaxtyping.jaxtyped(typechecker=beartype.beartype)`` (tests/test_types.py).
Without jaxtyping, ``Float[X, "T H"]`` (any dtype category) evaluates to ``X`` itself, ``jax.Array`` or
``jax.typing.ArrayLike``, so the annotations still resolve for readers, IDEs and ``typing.get_type_hints``.
Nothing here checks anything at run time in normal use.
"""

from __future__ import annotations

from typing import Any

try:
    from jaxtyping import Array, ArrayLike, Bool, Float, Int, Key, Real, Shaped, UInt32
except ImportError:  # the core needs only jax and numpy
    import jax
    import jax.typing

    Array = jax.Array
    ArrayLike = jax.typing.ArrayLike

    class _DtypeCategory:
        """``Category[X, "axes"]`` is ``X``: the shape string is documentation only."""

        def __init__(self, name: str) -> None:
            self.__name__ = self.__qualname__ = name

        def __getitem__(self, item: tuple[Any, str]) -> Any:
            return item[0]

        def __repr__(self) -> str:
            return self.__name__

    Bool, Float, Int, Key, Real, Shaped, UInt32 = (
        _DtypeCategory(n) for n in ("Bool", "Float", "Int", "Key", "Real", "Shaped", "UInt32")
    )

__all__ = ["Array", "ArrayLike", "Bool", "Float", "Int", "Key", "Real", "Shaped", "UInt32"]
