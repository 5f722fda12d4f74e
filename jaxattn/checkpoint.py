"""Model-agnostic checkpoint loading: config files, weight files, hub resolution, tokenizers.

Nothing here knows about a particular architecture. A model module (:mod:`jaxattn.gpt2`, :mod:`jaxattn.bert`) hands
in a :class:`ConfigSchema` (which ``config.json`` fields it implements) and a table of expected weight
shapes; these helpers read the files without PyTorch, refuse what the model does not implement and
raise :class:`CheckpointError` naming the file and the key that is wrong.

Dtype policy (every loader): params come back in float32 by default, whatever the file holds (float16,
bfloat16, float32, or a mix of them); ``load(..., dtype=...)`` chooses another floating dtype through
:func:`cast_params`.

Weight files:
  * ``model.safetensors`` through safetensors' NumPy API (no PyTorch), a flat ``{name: array}``;
  * ``flax_model.msgpack`` through ``flax.serialization``, a nested dict flattened to ``"a/b/c"`` keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "CheckpointError",
    "ConfigSchema",
    "HubUnavailableError",
    "LazyArray",
    "ResolvedFiles",
    "TextTokenizer",
    "cast_params",
    "check_finite",
    "check_layer_count",
    "check_config_fields",
    "check_layer_names",
    "check_finite_params",
    "check_saveable_tokenizer",
    "check_shapes",
    "flatten",
    "stack_layers",
    "unstack_layers",
    "read_config",
    "read_msgpack",
    "read_safetensors",
    "resolve",
    "safetensors_names",
    "unflatten",
    "weight_names",
]


class CheckpointError(ValueError):
    """A checkpoint cannot be used: a file is missing, corrupt, or holds something the model refuses."""


class HubUnavailableError(CheckpointError):
    """A hub id could not be fetched because the hub cannot be reached and nothing is cached.

    A subclass of :class:`CheckpointError`, so callers that need not care catch both alike; a caller
    that can run on something else instead (the lab's bundled encoder) catches only this one, and a
    corrupt or refused checkpoint still fails loudly.
    """


# ----------------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConfigSchema:
    """Which ``config.json`` fields a model implements.

    Attributes:
      required: fields that must be present, with the Python type(s) their value must have.
      optional: fields that may be present: ``name -> (types, default)``.
      fixed: fields that, when present, must hold one of the listed values (e.g. a feature the model
        does not implement must be off): ``name -> (allowed values...)``.
      ignored: fields known not to change the forward pass (training-only settings, metadata).
    """

    required: Mapping[str, Any]
    optional: Mapping[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    fixed: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    ignored: frozenset[str] = frozenset()


def _type_ok(value: Any, types: Any) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not an int
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return True  # 1 is a fine float
    return isinstance(value, types)


def _type_name(types: Any) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def read_config(path: str | os.PathLike, schema: ConfigSchema) -> dict[str, Any]:
    """Read a ``config.json`` and check it against ``schema``.

    Every field must be required, optional, fixed or ignored by the schema: an unknown field raises
    (the model cannot promise to implement what it has never heard of).

    Args:
      path: the ``config.json`` file.
      schema: what the model implements.

    Returns:
      ``{field: value}`` for the required and optional fields (defaults filled in) and the fixed ones.

    Raises:
      CheckpointError: missing or unreadable file, invalid JSON, a missing required field, a value of
        the wrong type, a fixed field with an unsupported value, or an unknown field; the message names
        the file and the key.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the config file ({e})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not a config: its JSON nests too deeply to read") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    return check_config_fields(raw, schema, path)


def check_config_fields(raw: Mapping[str, Any], schema: ConfigSchema, source: Any) -> dict[str, Any]:
    """:func:`read_config`'s checks of the fields ``raw`` (a config's dict, e.g. a ``text_config`` inside
    another), the messages naming ``source``."""
    path = source
    out: dict[str, Any] = {}
    for key, types in schema.required.items():
        if key not in raw:
            raise CheckpointError(f"{path}: required field '{key}' is missing")
        if not _type_ok(raw[key], types):
            raise CheckpointError(
                f"{path}: field '{key}' must be {_type_name(types)}, found {raw[key]!r}"
            )
        out[key] = raw[key]
    for key, (types, default) in schema.optional.items():
        value = raw.get(key, default)
        if key in raw and not _type_ok(value, types):
            raise CheckpointError(f"{path}: field '{key}' must be {_type_name(types)}, found {value!r}")
        out[key] = value
    for key, allowed in schema.fixed.items():
        if key in raw:
            if raw[key] not in allowed:
                raise CheckpointError(
                    f"{path}: field '{key}' = {raw[key]!r} is not supported (supported: "
                    f"{', '.join(repr(a) for a in allowed)})"
                )
            out[key] = raw[key]
    known = set(schema.required) | set(schema.optional) | set(schema.fixed) | set(schema.ignored)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(
            f"{path}: unsupported config field '{unknown[0]}'"
            + (f" (and {', '.join(repr(u) for u in unknown[1:])})" if len(unknown) > 1 else "")
            + "; this model does not implement it, so its weights could be misread"
        )
    return out


# ----------------------------------------------------------------------------------------------------
# Weight files
# ----------------------------------------------------------------------------------------------------


class LazyArray:
    """A tensor of a weight file, read only when ``np.asarray`` asks for it (each time: nothing is kept).

    ``shape`` and ``dtype`` come from the file's header, so shapes are checked before any tensor is read,
    and a loader can read, convert and place one tensor at a time (``load(..., mesh=)``): a model is then
    never whole on the host.
    """

    __slots__ = ("shape", "_dtype", "_read")

    def __init__(self, shape: tuple[int, ...], dtype: Any, read: Any):
        self.shape, self._dtype, self._read = tuple(int(d) for d in shape), dtype, read

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        """The file's dtype (read from a tensor only for a dtype the header's names do not cover)."""
        return np.asarray(self._read()).dtype if self._dtype is None else np.dtype(self._dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = np.asarray(self._read())
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyArray(shape={self.shape}, dtype={self._dtype})"


def _safetensors_dtypes() -> dict[str, Any]:
    import jax.numpy as jnp

    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str | os.PathLike, *, lazy: bool = False) -> dict[str, Any]:
    """All tensors of a ``.safetensors`` file as NumPy arrays (no PyTorch), ``{name: array}``; with
    ``lazy=True`` as :class:`LazyArray` s, each read when it is used.

    Raises:
      CheckpointError: the file is missing, truncated or not a safetensors file (the message names it), or
        a tensor has a dtype NumPy has none of (FP8: the message names the tensor).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    if not lazy:
        return {name: np.asarray(a) for name, a in read_safetensors(path, lazy=True).items()}

    def failed(e: Exception) -> CheckpointError:
        return CheckpointError(f"{path}: cannot read safetensors file, truncated or corrupt? ({e})")

    try:
        handle = safe_open(str(path), framework="numpy")
        dtypes = _safetensors_dtypes()
        out = {}
        for name in handle.keys():
            info = handle.get_slice(name)
            kind = info.get_dtype()

            def read(name: str = name, kind: str = kind) -> np.ndarray:
                if kind not in dtypes:  # NumPy has no such dtype (FP8...): refused by name when read
                    raise CheckpointError(f"{path}: tensor '{name}' has dtype {kind}, which cannot be read here "
                                          f"(supported: {', '.join(dtypes)})")
                try:
                    return handle.get_tensor(name)
                except Exception as e:  # as above
                    raise failed(e) from None

            out[name] = LazyArray(info.get_shape(), dtypes.get(kind), read)
        return out
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError (not exported stably) or OSError
        raise failed(e) from None


_MAX_SAFETENSORS_HEADER = 100_000_000  # bytes; the limit the safetensors library itself enforces


def safetensors_names(path: str | os.PathLike) -> list[str]:
    """The tensor names of a ``.safetensors`` file, read from its JSON header alone (no tensor data is read).

    The header's claimed size is checked against the file's size before it is read.

    Raises:
      CheckpointError: the file is missing, or its header is truncated or not a safetensors header.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: cannot read safetensors file, truncated or corrupt? "
                                      f"(the file holds {size} bytes, fewer than the 8 of the header's size)")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
                raise CheckpointError(f"{path}: cannot read safetensors file, truncated or corrupt? (its header claims "
                                      f"{n} bytes, the file holds {size - 8} after the size field)")
            header = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: weight file not found") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: cannot read safetensors file, truncated or corrupt? "
                              f"(header: {type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: cannot read safetensors file, truncated or corrupt? (the header is not a JSON object)")
    return [name for name in header if name != "__metadata__"]


def weight_names(path: str | os.PathLike) -> list[str]:
    """The tensor names of a weight file without reading any tensor: a ``.safetensors`` file's header
    (:func:`safetensors_names`), or the ``weight_map`` keys of a ``*.index.json`` shard index; a Flax
    ``.msgpack`` file has no header, so it is read whole (``a/b/c`` names).

    Raises:
      CheckpointError: the file is missing or unreadable, or an index without a ``weight_map`` object.
    """
    path = Path(path)
    if path.name.endswith(".msgpack"):  # no header to read apart: the file, bounded by its size
        return list(flatten(read_msgpack(path)))
    if not path.name.endswith(".json"):
        return safetensors_names(path)
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard index not found") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot read the shard index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to shard file names")
    return list(weight_map)


def check_layer_count(
    config_path: str | os.PathLike,
    weights_path: str | os.PathLike,
    *,
    field: str = "num_hidden_layers",
    pattern: str = r"model\.layers\.(\d+)\.",
) -> None:
    """Check a ``config.json``'s layer count against the layers the weight file holds, before anything is
    built from the config (a model's tables of expected weights have one entry per layer, so a claim of
    10**9 layers must be refused before they are made).

    Only tensor names are read (:func:`weight_names`: a safetensors header or a shard index), never
    tensor data. A config that cannot be read, or whose ``field`` is missing or not an int, passes: the
    config reader reports those. Nor does it judge a weight file it cannot read: the weight reader does.

    Args:
      config_path: the ``config.json``.
      weights_path: ``model.safetensors`` or ``model.safetensors.index.json``.
      field: the config field holding the layer count.
      pattern: a regular expression matched at the start of each tensor name; its first group is the
        layer index.

    Raises:
      CheckpointError: ``field`` differs from the number of distinct layer indices among the tensor
        names; the message names the field, both files, the claimed and the found count.
    """
    config_path, weights_path = Path(config_path), Path(weights_path)
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return  # the config reader reports it
    claimed = raw.get(field) if isinstance(raw, dict) else None
    if claimed is None and isinstance(raw, dict) and isinstance(raw.get("text_config"), dict):
        claimed = raw["text_config"].get(field)  # a multimodal config's text model (Gemma 3)
    if isinstance(claimed, bool) or not isinstance(claimed, int):
        return  # missing or mistyped: the config reader reports it
    try:
        names = weight_names(weights_path)
    except CheckpointError:
        return  # the weight reader reports it
    check_layer_names(names, claimed, weights_path, field=field, pattern=pattern, config_path=config_path)


def check_layer_names(
    names: Iterable[str],
    claimed: int,
    source: str | os.PathLike,
    *,
    field: str,
    pattern: str,
    config_path: str | os.PathLike | None = None,
) -> None:
    """Check a config's layer count ``claimed`` against the layers among tensor ``names`` read from
    ``source``, before a table of ``claimed`` entries is built (the check :func:`check_layer_count` makes
    from the files, for names already read).

    Args:
      names: the tensor names of the weight file.
      claimed: the config's layer count.
      source: the weight file, for the message.
      field: the config field holding the layer count, for the message.
      pattern: a regular expression matched at the start of each name; its first group is the layer index.
      config_path: the ``config.json`` the count comes from, if any, for the message.

    Raises:
      CheckpointError: ``claimed`` differs from the number of distinct layer indices among ``names``.
    """
    layer = re.compile(pattern)
    found = {int(m.group(1)) for m in map(layer.match, names) if m is not None}
    if claimed != len(found):
        held = f"{len(found)} layers (indices {min(found)} to {max(found)})" if found else "no layer"
        if config_path is None:
            raise CheckpointError(f"{source}: the config's {field} = {claimed}, but the file holds the tensors of "
                                  f"{held}; the config and the weights do not belong together")
        raise CheckpointError(
            f"{config_path}: field '{field}' = {claimed}, but {source} holds the tensors of {held}; "
            "the config and the weights do not belong together"
        )


# A Flax checkpoint's tree nests a few levels (params/h/0/attn/c_attn/kernel); deeper is not a checkpoint,
# and reading it would exhaust Python's stack (flax's restore and :func:`flatten` recurse once per level).
_MSGPACK_MAX_DEPTH = 64


def _depth(tree: Any, limit: int) -> int:
    """How deep ``tree``'s dicts and lists nest (a leaf is 0), counted without recursion and at most ``limit + 1``."""
    deepest, stack = 0, [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def read_msgpack(path: str | os.PathLike) -> dict[str, Any]:
    """A Flax ``.msgpack`` checkpoint as a nested dict of NumPy arrays.

    Raises:
      CheckpointError: the file is missing, truncated, not a Flax msgpack file, or nests its dicts and
        lists more than 64 levels deep (the message names the file).
    """
    import msgpack
    from flax import serialization

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    data = path.read_bytes()
    too_deep = CheckpointError(f"{path}: not a Flax checkpoint: its msgpack data nests more than "
                               f"{_MSGPACK_MAX_DEPTH} levels deep (a checkpoint's tree nests a few)")
    try:
        tree = serialization.msgpack_restore(data)
    except (RecursionError, msgpack.StackError):  # deeper than Python's stack, or than msgpack's (1024)
        raise too_deep from None
    except (ValueError, TypeError, KeyError) as e:  # msgpack's errors subclass ValueError
        raise CheckpointError(f"{path}: cannot read Flax msgpack file, truncated or corrupt? ({e})") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: expected a nested dict of arrays, found {type(tree).__name__}")
    if _depth(tree, _MSGPACK_MAX_DEPTH) > _MSGPACK_MAX_DEPTH:
        raise too_deep
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a/b/c": leaf}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten`."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


_LAYER_KEY = re.compile(r"^(\d+)/(.+)$")


def _prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
        raise ValueError(f"prefix must be the blocks' key path such as 'model/layers', received {prefix!r}")
    return prefix + "/"


def stack_layers(params: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Per-layer blocks as stacked ``[L, ...]`` leaves: the decoders' in-memory layout.

    ``params`` is a nested dict (or a flat ``{"a/b/c": leaf}`` one, returned flat) whose blocks sit under
    ``prefix`` as ``{prefix}/{i}/{name}`` for ``i = 0..L-1`` (Hugging Face's Flax layout, e.g.
    ``FlaxLlamaForCausalLM.params`` with ``prefix="model/layers"``, or ``FlaxGPT2LMHeadModel.params``
    with ``"transformer/h"``); each ``{prefix}/{name}`` of the result stacks the ``L`` blocks' arrays along
    a new leading axis. Every other leaf is returned as it is. :func:`unstack_layers` is the inverse.

    Raises:
      ValueError: no block under ``prefix``, layer indices that are not ``0..L-1``, or blocks that differ
        in their weights or in a weight's shape (naming the key).
    """
    nested = any(isinstance(v, Mapping) for v in params.values())
    flat = flatten(params) if nested else dict(params)
    head = _prefix(prefix)
    blocks: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for key, value in flat.items():
        m = _LAYER_KEY.match(key[len(head):]) if key.startswith(head) else None
        if m is None:
            out[key] = value
        else:
            if m.group(1) != str(int(m.group(1))):  # "00" or "01": another spelling of a block's index
                raise ValueError(f"the blocks under '{prefix}' must be numbered 0..L-1 without leading zeros, "
                                 f"found '{key}'")
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = value
    if not blocks:
        raise ValueError(f"params hold no block under '{prefix}/0/...' (the per-layer layout stack_layers reads)")
    L = len(blocks)
    if sorted(blocks) != list(range(L)):
        raise ValueError(f"the blocks under '{prefix}' must be numbered 0..{L - 1}, found {sorted(blocks)[:8]}")
    names = list(blocks[0])
    for i in range(L):
        if set(blocks[i]) != set(names):
            extra = sorted(set(blocks[i]) ^ set(names))[0]
            raise ValueError(f"block {i} under '{prefix}' differs from block 0 in weight '{extra}'")
    for name in names:
        arrays = [blocks[i][name] for i in range(L)]
        shapes = {tuple(np.shape(a)) for a in arrays}
        if len(shapes) != 1:
            raise ValueError(f"weight '{prefix}/i/{name}' has shapes {sorted(shapes)} across the blocks: they must agree")
        if all(isinstance(a, np.ndarray) for a in arrays):
            out[head + name] = np.stack(arrays)
        else:
            import jax.numpy as jnp

            out[head + name] = jnp.stack([jnp.asarray(a) for a in arrays])
    return unflatten(out) if nested else out


def unstack_layers(params: Mapping[str, Any], prefix: str, layers: int | None = None) -> dict[str, Any]:
    """The inverse of :func:`stack_layers`: each ``[L, ...]`` leaf under ``prefix`` split into blocks
    ``{prefix}/{i}/{name}`` (Hugging Face's per-layer Flax layout, e.g. for ``FlaxLlamaForCausalLM(params=)``
    or a file). Nested in, nested out (flat in, flat out); every leaf under ``prefix`` must hold the same
    ``L`` blocks, which ``layers`` checks when given (``ValueError`` naming the weight otherwise)."""
    nested = any(isinstance(v, Mapping) for v in params.values())
    flat = flatten(params) if nested else dict(params)
    head = _prefix(prefix)
    out: dict[str, Any] = {}
    source = None if layers is None else "layers"  # where L comes from: the argument, or the first weight
    for key, value in flat.items():
        if not key.startswith(head):
            out[key] = value
            continue
        L = np.shape(value)[0] if np.ndim(value) else None
        if L is None or (layers is not None and L != layers):
            given = "" if source in (None, "layers") else f" (the blocks of '{source}': every weight the same)"
            raise ValueError(f"weight '{key}' must be stacked [L, ...]" + (f" with L = {layers}{given}" if layers else "")
                             + f", received shape {tuple(np.shape(value))}")
        if source is None:
            source, layers = key, L
        for i in range(L):
            out[f"{head}{i}/{key[len(head):]}"] = value[i]
    return unflatten(out) if nested else out


def check_shapes(
    arrays: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    source: str | os.PathLike,
    *,
    kernel_layout: str = "",
) -> None:
    """Every expected key present with its exact shape, no unexpected key, every array floating.

    Args:
      arrays: ``{key: array}`` as read (keys already mapped to the model's names).
      expected: ``{key: shape}``.
      source: the file the arrays came from, named in the message.
      kernel_layout: how this file stores 2-D kernels (e.g. ``"(out, in)"``), quoted when a kernel's
        shape is the expected one with its last two dims swapped (a kernel, or kernels stacked over layers).

    Raises:
      CheckpointError: naming the file, the key, the expected and the found shape; a kernel whose shape
        is the expected one reversed is reported as transposed.
    """
    missing = [k for k in expected if k not in arrays]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing weight '{missing[0]}'{more}")
    unexpected = [k for k in arrays if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{source}: unexpected weight '{unexpected[0]}'{more}, which this model does not use")
    for key, shape in expected.items():
        found = tuple(np.shape(arrays[key]))
        if found != tuple(shape):
            hint = ""
            if len(found) >= 2 and found[:-2] == tuple(shape)[:-2] and found[-2:] == tuple(shape)[-2:][::-1]:
                hint = " (it looks transposed" + (f"; this file stores kernels as {kernel_layout}" if kernel_layout else "") + ")"
            raise CheckpointError(
                f"{source}: weight '{key}' has shape {found}, expected {tuple(shape)}{hint}"
            )
        dtype = getattr(arrays[key], "dtype", None)  # read without converting: params may be traced
        dtype = np.asarray(arrays[key]).dtype if dtype is None else np.dtype(dtype)
        if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
            raise CheckpointError(f"{source}: weight '{key}' has dtype {dtype}, expected a floating dtype")


def check_finite(arrays: Mapping[str, Any], source: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming the first weight holding NaN or Inf."""
    for key, value in arrays.items():
        if not np.all(np.isfinite(np.asarray(value, np.float32))):
            raise CheckpointError(f"{source}: weight '{key}' holds NaN or Inf values; the file is corrupt")


def check_fits(key: str, a: Any, dtype: Any, source: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming weight ``key`` when a finite value of ``a`` would not be finite
    in ``dtype`` (inf in float16 for a float32 file's 1e5), with the largest ``|value|`` and the dtype's
    largest finite number."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    top = float(jnp.finfo(dtype).max)
    a = np.asarray(a)
    if a.size == 0 or top >= float(np.finfo(np.float32).max):
        return
    biggest = float(np.max(np.abs(a)))
    with np.errstate(over="ignore"):
        cast = np.asarray(biggest, np.float32).astype(dtype)  # rounding is monotonic: the largest is enough
    if not np.isfinite(cast.astype(np.float32)):  # inf (NaN in a dtype without inf)
        raise CheckpointError(
            f"{source}: weight '{key}' holds values up to |{biggest:.6g}|, beyond the largest finite {dtype.name} "
            f"number {top:.6g} (dtype={dtype.name} would turn them into inf); load it as float32"
        )


@dataclasses.dataclass(frozen=True)
class Fitting:
    """A loader's ``place(key, array)`` that first refuses, by :func:`check_fits`, a weight ``dtype`` cannot
    hold; :meth:`check` alone checks a part of a weight under its own key (a block's, before stacking)."""

    place: Any
    dtype: Any
    source: Any

    def check(self, key: str, a: Any) -> None:
        check_fits(key, a, self.dtype, self.source)

    def __call__(self, key: str, a: Any) -> Any:
        self.check(key, a)
        return self.place(key, a)


def fitting(place: Any, dtype: Any, source: str | os.PathLike) -> Fitting:
    """``place`` behind :func:`check_fits` (a :class:`Fitting`)."""
    return Fitting(place, dtype, source)


# ----------------------------------------------------------------------------------------------------
# Resolving a hub id or a local directory
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResolvedFiles:
    """Local paths of a checkpoint's files: ``files[name] = path`` for each file found."""

    source: str
    directory: Path
    files: Mapping[str, Path]


def _option(opt: str | Sequence[str]) -> tuple[str, ...]:
    return (opt,) if isinstance(opt, str) else tuple(opt)


def _group_text(group: Sequence[str | Sequence[str]]) -> str:
    return " or ".join(" + ".join(_option(o)) for o in group)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _looks_like_path(name: str) -> bool:
    """True for anything that cannot be a hub id (``gpt2``, ``owner/name``): ``./x``, ``/a/b/c``, ``~``."""
    return not _HUB_ID.match(name)


def _check_inside(filename: Any, where: str) -> None:
    """Refuse a checkpoint file name that is not a relative path inside the checkpoint (``where``)."""
    if not isinstance(filename, str):
        raise CheckpointError(f"{where}: a checkpoint file name must be a string, found {filename!r}")
    parts = re.split(r"[/\\]", filename)
    if (filename.strip() == "" or "\0" in filename or os.path.isabs(filename) or filename.startswith(("/", "\\"))
            or re.match(r"^[A-Za-z]:", filename) or ".." in parts):
        raise CheckpointError(
            f"{where}: file name {filename!r} is not inside the checkpoint (empty, absolute, with '..' or a NUL); "
            "a checkpoint names its files relative to its own folder"
        )


def resolve(
    name_or_path: str | os.PathLike,
    *,
    required: Sequence[str],
    any_of: Sequence[Sequence[str | Sequence[str]]] = (),
) -> ResolvedFiles:
    """Find a checkpoint's files in a local directory or on the Hugging Face hub (with its cache).

    A local directory is used as is. Anything else is a hub repository id (``gpt2``,
    ``openai-community/gpt2-medium``): each file is fetched with ``huggingface_hub.hf_hub_download``,
    which shows a progress bar and caches, and works offline from the cache.

    Args:
      name_or_path: a local directory or a hub id.
      required: file names that must all exist (e.g. ``["config.json"]``).
      any_of: groups of options; from each group the first option whose files all exist is taken (e.g.
        the weights, ``["model.safetensors", "flax_model.msgpack"]``, or a tokenizer,
        ``["tokenizer.json", ("vocab.json", "merges.txt")]``); at least one option must exist.

    Returns:
      A :class:`ResolvedFiles`.

    Raises:
      CheckpointError: a file name that is not a relative path inside the checkpoint (absolute, with
        ``..``, empty), whichever file listed it; a missing directory or file; a hub id that cannot be fetched: offline with
        nothing cached gives one :class:`HubUnavailableError` whose message says how to point at a
        local directory instead.
    """
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    for f in [*required, *(g for group in any_of for opt in group for g in _option(opt))]:
        _check_inside(f, name)
    if path.is_dir():
        files: dict[str, Path] = {}
        for f in required:
            if not (path / f).is_file():
                raise CheckpointError(f"{path / f}: file not found (the checkpoint directory needs {', '.join(required)})")
            files[f] = path / f
        for group in any_of:
            found = [opt for opt in group if all((path / f).is_file() for f in _option(opt))]
            if not found:
                raise CheckpointError(
                    f"{path}: none of {_group_text(group)} found in the checkpoint directory"
                )
            files.update({f: path / f for f in _option(found[0])})
        return ResolvedFiles(name, path, files)
    if path.exists():
        raise CheckpointError(f"{name}: not a directory; pass a checkpoint directory or a hub id")
    if _looks_like_path(name):
        raise CheckpointError(f"{name}: no such directory; pass a checkpoint directory or a hub id")
    return _resolve_hub(name, required, any_of)


def _offline_message(repo_id: str, required: Sequence[str], any_of: Sequence[Sequence[str]], detail: str) -> str:
    needs = list(required) + [_group_text(g) for g in any_of]
    return (
        f"cannot fetch '{repo_id}' from the Hugging Face hub and it is not in the local cache ({detail}). "
        f"Without network access, point at a local directory instead: a folder holding {'; '.join(needs)} "
        f"(e.g. copied from a machine that has `huggingface-cli download {repo_id}`), passed as the path "
        f"in place of '{repo_id}'."
    )


class _Offline(Exception):
    """Internal: the hub cannot be reached and the file is not cached."""


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection within ``timeout`` seconds.

    Without this, ``hf_hub_download`` on a machine with no network retries each request for ~25 s, printing
    every retry, before falling back to its cache; with it, an unreachable hub means cache-only at once.
    ``HF_HUB_OFFLINE=1`` skips the check (huggingface_hub then never touches the network).
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _resolve_hub(repo_id: str, required: Sequence[str], any_of: Sequence[Sequence[str]]) -> ResolvedFiles:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = not _hub_reachable()

    def fetch(filename: str) -> Path:
        try:
            return Path(hf_hub_download(repo_id, filename, local_files_only=offline))
        except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: offline, nothing cached
            raise _Offline("no network access, or the hub cannot be reached") from None

    files: dict[str, Path] = {}
    try:
        for f in required:
            try:
                files[f] = fetch(f)
            except EntryNotFoundError:
                raise CheckpointError(f"hub repository '{repo_id}' has no file '{f}'") from None
        for group in any_of:
            not_cached = None  # offline: an option missing from the cache, while a later one may be there
            for opt in group:
                try:
                    files.update({f: fetch(f) for f in _option(opt)})
                    break
                except EntryNotFoundError:
                    continue
                except _Offline as e:
                    not_cached = e
                    continue
            else:
                if not_cached is not None:
                    raise not_cached
                raise CheckpointError(f"hub repository '{repo_id}' has none of {_group_text(group)}")
    except _Offline as e:
        raise HubUnavailableError(_offline_message(repo_id, required, any_of, str(e))) from None
    except HFValidationError:
        raise CheckpointError(
            f"'{repo_id}' is neither a local directory nor a valid Hugging Face hub id"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"'{repo_id}' is neither a local directory nor a hub repository that can be accessed"
        ) from None
    except HfHubHTTPError as e:  # reached the hub, which refused (gated repository, server error)
        raise CheckpointError(f"the Hugging Face hub refused '{repo_id}': {str(e).splitlines()[0]}") from None
    except OSError as e:  # requests' ConnectionError and timeouts subclass OSError
        raise HubUnavailableError(_offline_message(repo_id, required, any_of, str(e).splitlines()[0])) from None
    directory = next(iter(files.values())).parent
    return ResolvedFiles(repo_id, directory, files)


# ----------------------------------------------------------------------------------------------------
# Tokenizers (the `tokenizers` package; no transformers)
# ----------------------------------------------------------------------------------------------------


def check_finite_params(params: Any) -> None:
    """``ValueError`` naming the first weight of ``params`` that holds NaN or Inf, raised before a model's
    ``save`` writes anything: its ``load`` refuses such a file as corrupt."""
    for key, value in flatten(params).items():
        a = np.asarray(value)
        if np.issubdtype(a.dtype, np.inexact) or a.dtype.name == "bfloat16":
            if not np.all(np.isfinite(a.astype(np.float32))):
                raise ValueError(f"params['{key}'] holds NaN or Inf values: load refuses a file holding them, so "
                                 f"nothing is written")


def check_saveable_tokenizer(tokenizer: Any) -> None:
    """``TypeError`` unless ``tokenizer`` is None or a :class:`TextTokenizer` (whose ``tokenizer.json`` a
    model's ``save`` writes), raised before anything is written. A SentencePiece tokenizer read from a
    GGUF (Gemma 3's) has no ``tokenizer.json``."""
    if tokenizer is not None and not isinstance(tokenizer, TextTokenizer):
        raise TypeError(f"tokenizer must be a jaxattn.checkpoint.TextTokenizer (save writes its tokenizer.json) or None, "
                        f"received {type(tokenizer).__name__}: a SentencePiece tokenizer from a GGUF has no "
                        f"tokenizer.json; pass tokenizer=None to save the weights and config only")


class TextTokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer``: text in, integer ids and readable labels out.

    Built from a ``tokenizer.json`` (:meth:`from_file`) or, for byte-level BPE models such as GPT-2,
    from ``vocab.json`` + ``merges.txt`` (:meth:`from_bpe_files`).
    """

    def __init__(self, tokenizer: Any, *, add_special_tokens: bool = True):
        self.backend = tokenizer
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> "TextTokenizer":
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)), **kwargs)
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"{path}: cannot read tokenizer file ({e})") from None

    @classmethod
    def from_bpe_files(cls, vocab: str | os.PathLike, merges: str | os.PathLike, **kwargs: Any) -> "TextTokenizer":
        """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt`` (no prefix space)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"{vocab}, {merges}: cannot read the BPE vocabulary ({e})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return cls(tok, **kwargs)

    @classmethod
    def train_byte_level_bpe(cls, texts: Sequence[str], vocab_size: int = 512, **kwargs: Any) -> "TextTokenizer":
        """A GPT-2-style byte-level BPE trained on ``texts`` (for random models run offline; a real
        model needs its own tokenizer). Its vocabulary has the 256 byte symbols, the merges learned
        (up to ``vocab_size``) and ``<|endoftext|>``."""
        from tokenizers import ByteLevelBPETokenizer

        tok = ByteLevelBPETokenizer(add_prefix_space=False)
        tok.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=1,
                                special_tokens=["<|endoftext|>"], show_progress=False)
        return cls(tok._tokenizer, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        """Token ids ``[T]`` (int32)."""
        return np.asarray(self.backend.encode(text, add_special_tokens=self.add_special_tokens).ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def labels(self, ids: Iterable[int]) -> list[str]:
        """One readable label per token: its own decoded text (``" it"``), or its vocabulary entry."""
        out = []
        for i in ids:
            text = self.backend.decode([int(i)], skip_special_tokens=False)
            out.append(text if text else (self.backend.id_to_token(int(i)) or f"<{int(i)}>"))
        return out


def cast_params(params: Any, dtype: Any) -> Any:
    """Every leaf of a params pytree as a JAX array of ``dtype`` (a floating dtype; float64 needs
    ``jax.enable_x64``): the loaders' one dtype policy, also for mixed-dtype files."""
    import jax
    import jax.numpy as jnp

    from jaxattn._checks import check_float_dtype

    dtype = check_float_dtype(dtype)
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
