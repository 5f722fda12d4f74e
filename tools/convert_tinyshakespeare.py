"""Convert Tiny Shakespeare (char-rnn's ``input.txt``) into jaxattn's shipped character-level text.

    python tools/convert_tinyshakespeare.py input.txt jaxattn/data/tinyshakespeare.txt.gz

The input is ``data/tinyshakespeare/input.txt`` of the GitHub repository karpathy/char-rnn
(https://github.com/karpathy/char-rnn/blob/6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/data/tinyshakespeare/input.txt,
commit 6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e; 1,115,394 bytes, sha256
86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed). Citation: A. Karpathy, "The Unreasonable
Effectiveness of Recurrent Neural Networks" (2015) and github.com/karpathy/char-rnn. Licence: the repository
is MIT-licensed; the text is a selection of Shakespeare's plays, in the public domain.

What the script writes: the input's first ``KEEP_CHARS`` characters, cut back to the end of the last whole line
(``\\n``) at or before that many, as UTF-8, gzip-compressed at level 9 with no file name and modification time 0,
so that the same input gives the same bytes. Nothing else is changed. ``jaxattn.train.TextTask`` reads it: the
first ``TRAIN_FRACTION`` (90%) of the characters are the training slice, the rest the validation slice, and the
vocabulary is the sorted set of characters in the file.

The shipped ``jaxattn/data/tinyshakespeare.txt.gz`` made from the input above: 599,959 characters (the first
599,959 of the input; 64 distinct), 233,318 bytes, sha256
ed33f9adb6622ec45f05376e7dfd67650db96fc1300cb85ed8a059c5f1567440 (``SHIPPED_SHA256`` and ``SHIPPED_BYTES`` below; tests/test_train_remedies.py
checks the file against them). Standard library only; no network.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import sys
import tempfile
from pathlib import Path

KEEP_CHARS = 600_000  # at most this many characters of the input (the shipped file stays near 230 KB)
TRAIN_FRACTION = 0.9  # the first 90% of the kept characters train, the last 10% validate (jaxattn.train.TextTask)
INPUT_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHIPPED_SHA256 = "ed33f9adb6622ec45f05376e7dfd67650db96fc1300cb85ed8a059c5f1567440"
SHIPPED_BYTES = 233_318
SOURCE = ("data/tinyshakespeare/input.txt of github.com/karpathy/char-rnn, commit "
          "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e (MIT-licensed repository; the text is public domain)")


class ConversionError(ValueError):
    """The input is not a text this script converts."""


def convert_text(text: str, keep_chars: int = KEEP_CHARS) -> str:
    """The kept text: the first ``keep_chars`` characters, cut back to the end of the last whole line."""
    if not text:
        raise ConversionError("the input is empty")
    kept = text[:keep_chars]
    if len(text) > keep_chars:
        end = kept.rfind("\n")
        if end < 0:
            raise ConversionError(f"no line ends in the first {keep_chars} characters")
        kept = kept[: end + 1]
    return kept


def compress(text: str) -> bytes:
    """``text`` as UTF-8, gzip level 9, no file name, modification time 0 (deterministic bytes)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buffer, mtime=0) as f:
        f.write(text.encode("utf-8"))
    return buffer.getvalue()


def write_atomically(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part:
    into a temporary file in the same folder, which then replaces ``path`` (``os.replace``). On failure the
    temporary file is removed and ``path`` is as it was. (:func:`jaxattn.io.atomic_write` does the same;
    this script keeps to the standard library.)"""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the data is meant to be read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="char-rnn's data/tinyshakespeare/input.txt")
    parser.add_argument("out", help="the gzip file to write (jaxattn/data/tinyshakespeare.txt.gz), replaced atomically")
    parser.add_argument("--keep-chars", type=int, default=KEEP_CHARS, help=f"characters to keep (default {KEEP_CHARS})")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.out == "" or out.is_dir() or not out.parent.is_dir():
        print(f"error: out {args.out!r} must be a file in an existing folder", file=sys.stderr)
        return 2
    if args.keep_chars < 1:
        print(f"error: --keep-chars must be >= 1, received {args.keep_chars}", file=sys.stderr)
        return 2
    try:
        raw = Path(args.input).read_bytes()
        text = convert_text(raw.decode("utf-8"), args.keep_chars)
    except (OSError, UnicodeDecodeError, ConversionError) as e:
        print(f"error: input {args.input!r}: {e}", file=sys.stderr)
        return 2
    digest = hashlib.sha256(raw).hexdigest()
    if digest != INPUT_SHA256:
        print(f"note: the input's sha256 is {digest}, not char-rnn's {INPUT_SHA256}", file=sys.stderr)
    data = compress(text)
    try:
        write_atomically(out, data)
    except OSError as e:
        print(f"error: out {args.out!r}: cannot write there ({e.strerror or e}); nothing was changed", file=sys.stderr)
        return 2
    print(f"wrote {len(text)} characters ({len(set(text))} distinct), {len(data)} bytes, sha256 "
          f"{hashlib.sha256(data).hexdigest()} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
