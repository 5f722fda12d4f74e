"""Progress for long runs, on a text stream (stderr by default): a line per step, a tqdm-style bar per loop.

Library functions stay silent: a long one takes an optional ``progress`` callback and calls it; an
experiment script passes a :class:`ProgressBar` (or wraps a step in :func:`step`) to say what it is doing.

    with step("loading gpt2"):                     # "loading gpt2 ..." then " 3.1 s" on the same line
        params, config, tokenizer = gpt2.load("gpt2")
    bar = ProgressBar("sweep", total=4, unit="dtype")
    lab.sweep(0, progress=bar)                     # sweep [######      ] 2/4 dtype  31.0 s, ~31 s left  float16

Needs only the standard library.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, TextIO

__all__ = ["ProgressBar", "step"]


def _stream(stream: TextIO | None) -> TextIO:
    return sys.stderr if stream is None else stream


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    return f"{m}:{s:02d} min" if m < 60 else f"{m // 60}:{m % 60:02d}:{s:02d} h"


class ProgressBar:
    """A tqdm-style bar: ``label [#######       ] 3/8 steps  12.1 s, ~20.2 s left  note``.

    Use it as a progress callback, ``bar(done, total=None, note=None)``: ``done`` units of ``total`` are
    finished and ``note`` says what runs now (``jaxattn.train.train(progress=bar)``,
    ``jaxattn.lab.sweep(progress=bar)``). The time left is the mean time per unit so far times the
    units left. On a terminal the bar redraws one line; on a file or a pipe it writes a line per call,
    at most one every ``min_interval`` seconds, the first and the last always.

    Args:
      label: what is being counted, shown first.
      total: the number of units, >= 0 (a call may change it).
      unit: the unit's name, shown after the count.
      stream: where to write (default ``sys.stderr``).
      width: characters of the bar.
      min_interval: seconds between lines when the stream is not a terminal.
      clock: a function returning seconds (``time.perf_counter``).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "step",
        stream: TextIO | None = None,
        width: int = 24,
        min_interval: float = 5.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not isinstance(label, str):
            raise TypeError(f"label must be a str, received {type(label).__name__}")
        self.label, self.unit = label, str(unit)
        self.total = self._check_total(total)
        self.width = int(width)
        if self.width < 1:
            raise ValueError(f"width must be a positive int, received {width!r}")
        self.min_interval = float(min_interval)
        self._stream = _stream(stream)
        self._tty = _is_terminal(self._stream)
        self._clock = clock
        self._start = clock()
        self._last_write: float | None = None
        self.done = 0
        self.closed = False

    @staticmethod
    def _check_total(total: int) -> int:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be an int >= 0, received {total!r}")
        return total

    def render(self, note: str | None = None) -> str:
        """The bar's line as text (no ``\\r`` or newline)."""
        total, done = self.total, self.done
        frac = 1.0 if total == 0 else min(max(done / total, 0.0), 1.0)
        filled = int(round(self.width * frac))
        elapsed = self._clock() - self._start
        text = f"{self.label} [{'#' * filled}{' ' * (self.width - filled)}] {done}/{total} {self.unit}  {_seconds(elapsed)}"
        if 0 < done < total:
            text += f", ~{_seconds(elapsed / done * (total - done))} left"
        if note:
            text += f"  {note}"
        return text

    def __call__(self, done: int, total: int | None = None, note: str | None = None) -> None:
        """Record that ``done`` units are finished (of ``total``, when given) and redraw."""
        if self.closed:
            raise ValueError(f"progress bar {self.label!r} is closed")
        if total is not None:
            self.total = self._check_total(total)
        if isinstance(done, bool) or not isinstance(done, int) or done < 0:
            raise ValueError(f"done must be an int >= 0, received {done!r}")
        self.done = done
        finished = self.total > 0 and done >= self.total
        now = self._clock()
        if self._tty:
            self._stream.write("\r" + self.render(note) + "\x1b[K" + ("\n" if finished else ""))
        elif finished or self._last_write is None or now - self._last_write >= self.min_interval:
            self._stream.write(self.render(note) + "\n")
        else:
            return
        self._last_write = now
        self._stream.flush()
        if finished:
            self.closed = True

    def update(self, n: int = 1, note: str | None = None) -> None:
        """``n`` more units are finished."""
        self(self.done + n, note=note)

    def close(self) -> None:
        """End the bar's line if it is still open (a run that stopped early)."""
        if not self.closed and self._last_write is not None and self._tty:
            self._stream.write("\n")
            self._stream.flush()
        self.closed = True

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def step(what: str, *, stream: TextIO | None = None, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """Say ``what ...`` before the block runs and how long it took after: ``what ... 3.1 s``.

    If the block raises, the line ends with ``failed after 3.1 s`` and the exception propagates. Nothing
    else should write to the same terminal inside the block (the line is finished when it ends).
    """
    if not isinstance(what, str):
        raise TypeError(f"what must be a str, received {type(what).__name__}")
    out = _stream(stream)
    start = clock()
    out.write(f"{what} ...")
    out.flush()
    try:
        yield
    except BaseException:
        out.write(f" failed after {_seconds(clock() - start)}\n")
        out.flush()
        raise
    out.write(f" {_seconds(clock() - start)}\n")
    out.flush()
