"""Optional dependencies: a part of jaxattn that needs an extra says which one, at import."""

from __future__ import annotations

import importlib.util


def require(extra: str, module: str, *packages: str) -> None:
    """Raise one ``ImportError`` naming ``jaxattn[extra]`` if any of ``packages`` is not installed.

    Checked with ``importlib.util.find_spec``, which finds a package without importing it.
    """
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(
            f"{module} needs the optional dependencies of jaxattn[{extra}], and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'jaxattn[{extra}]'"
        )
