"""jaxattn.progress: the tqdm-style bar and the step line, on a terminal and on a file, with a fake clock."""

import io

import pytest

from jaxattn.progress import ProgressBar, step


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_file_writes_whole_lines_at_most_every_interval():
    clock, out = Clock(), io.StringIO()
    bar = ProgressBar("sweep", 4, unit="dtypes", stream=out, width=8, min_interval=5.0, clock=clock)
    bar(0, note="float32: compiling")
    clock.now += 2.0
    bar(1, note="bfloat16")  # 2 s after the last line: not written
    clock.now += 8.0
    bar(2, note="float16")
    clock.now += 1.0
    bar(4, note="done")  # the last is always written
    assert out.getvalue().splitlines() == [
        "sweep [        ] 0/4 dtypes  0.0 s  float32: compiling",
        "sweep [####    ] 2/4 dtypes  10.0 s, ~10.0 s left  float16",
        "sweep [########] 4/4 dtypes  11.0 s  done",
    ]
    with pytest.raises(ValueError, match="progress bar 'sweep' is closed"):
        bar(4)


def test_bar_on_a_terminal_redraws_one_line_and_takes_a_new_total():
    clock, out = Clock(), Terminal()
    with ProgressBar("train", 1, stream=out, width=4, clock=clock) as bar:
        bar(0, 300)  # jaxattn.train.train's progress(steps_done, total_steps)
        clock.now += 90.0
        bar(100, 300)
        clock.now += 90.0
        bar.update(200)
    assert out.getvalue() == (
        "\rtrain [    ] 0/300 step  0.0 s\x1b[K"
        "\rtrain [#   ] 100/300 step  1:30 min, ~3:00 min left\x1b[K"
        "\rtrain [####] 300/300 step  3:00 min\x1b[K\n"
    )


def test_bar_closed_early_ends_its_line_and_rejects_bad_counts():
    out = Terminal()
    with ProgressBar("runs", 7, stream=out, clock=Clock()) as bar:
        bar(3)
    assert out.getvalue().endswith("\x1b[K\n")
    with pytest.raises(ValueError, match=r"total must be an int >= 0, received -1"):
        ProgressBar("x", -1)
    with pytest.raises(ValueError, match=r"done must be an int >= 0, received 1.5"):
        ProgressBar("x", 2, stream=io.StringIO())(1.5)
    with pytest.raises(TypeError, match="label must be a str, received int"):
        ProgressBar(3, 2)


def test_step_says_what_runs_and_how_long_it_took():
    clock, out = Clock(), io.StringIO()
    with step("loading gpt2", stream=out, clock=clock):
        clock.now += 3.25
    assert out.getvalue() == "loading gpt2 ... 3.2 s\n"
    out = io.StringIO()
    with pytest.raises(KeyError):
        with step("part 4", stream=out, clock=clock):
            clock.now += 61.0
            raise KeyError("x")
    assert out.getvalue() == "part 4 ... failed after 1:01 min\n"
