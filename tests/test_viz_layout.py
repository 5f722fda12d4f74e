"""jaxattn.viz pages in headless Chromium at the edges: tables of extreme values, a title wider than the window.

The browser and its helpers are tests/test_viz.py's."""

import numpy as np
import pytest
from selenium.webdriver.common.by import By
from test_viz import BIG, BLUE, RED, _cell, _no_errors_and_nothing_fetched, _open, _pixel, _softmax, _switch
from test_viz import browser  # noqa: F401  (the fixture)

from jaxattn import viz

TINY = np.finfo(np.float64).tiny  # the smallest normal double
SUB = 5e-324  # the smallest subnormal double
MAX = np.finfo(np.float64).max  # 1.7976931348623157e308


def _maps(L, N, T, seed=0):
    return _softmax(2.0 * np.random.default_rng(seed).standard_normal((L, N, T, T)), True)


def test_tables_of_extreme_finite_values_render(browser, tmp_path):
    """Values near the largest double (whose range hi - lo overflows to Infinity), subnormals and NaN:
    the page finishes loading without a script error, shows each table with its true range, colours
    every head and names its value in the tooltip."""
    T = 4
    maps = _maps(2, 3, T)
    huge = np.array([[-1e308, 0.0, 1e308], [-MAX, MAX, np.nan]])
    positive = np.array([[MAX, 1e308, 1.0], [TINY, SUB, np.nan]])
    page = viz.html(maps, BIG[:T], tables={"huge": huge, "positive": positive}, title="extreme")
    np.testing.assert_array_equal(viz.page_data(page)["tables"]["huge"], huge)  # kept exactly
    path = tmp_path / "extreme.html"
    path.write_text(page, encoding="utf-8")
    _open(browser, path)  # waits for the script to finish (body[data-ready])

    box, grid = browser.find_element(By.ID, "table-box"), browser.find_element(By.ID, "table-grid")
    bar = browser.find_element(By.ID, "table-legend")
    assert box.is_displayed() and grid.size["width"] > 0 and grid.size["height"] > 0
    assert grid.get_attribute("data-scale") == "diverging"
    assert (float(bar.get_attribute("data-lo")), float(bar.get_attribute("data-hi"))) == (-MAX, MAX)
    assert _pixel(browser, "table-grid", 1, 1) == RED and _pixel(browser, "table-grid", 1, 0) == BLUE
    middle = _pixel(browser, "table-grid", 0, 1)  # 0 on a scale symmetric about 0: the palette's white
    assert middle == (247, 247, 247)
    tip = _cell(browser, "table-grid", 1, 1)
    assert tip["shown"] and "huge = 1.7976931348623157e+308" in tip["text"] and float(tip["value"]) == MAX
    tip = _cell(browser, "table-grid", 0, 2)
    assert "huge = 1e+308" in tip["text"] and "Infinity" not in tip["text"] and "NaN" not in tip["text"]

    _switch(browser, "table", 1)
    assert grid.get_attribute("data-scale") == "sequential"
    assert (float(bar.get_attribute("data-lo")), float(bar.get_attribute("data-hi"))) == (SUB, MAX)
    tip = _cell(browser, "table-grid", 1, 1)
    assert "positive = 5e-324" in tip["text"] and float(tip["value"]) == SUB
    labels = browser.execute_script("return arguments[0].getAttribute('aria-label')", bar)
    assert "Infinity" not in labels and "NaN" not in labels
    _no_errors_and_nothing_fetched(browser)


@pytest.mark.parametrize("infinite", [np.inf, -np.inf])
def test_tables_refuse_infinity_naming_the_table(infinite):
    table = np.zeros((2, 3))
    table[1, 2] = infinite
    with pytest.raises(ValueError, match=r"tables\['huge'\]: expected finite values or NaN \(no value\), received 1 infinite"):
        viz.html(_maps(2, 3, 4), BIG[:4], tables={"huge": table})


# The document's scroll box, and the title's: its lines, whether its text is wider than its box, how it ends.
TITLE = """const root = document.scrollingElement, h = document.getElementById("title"), s = getComputedStyle(h);
return {scroll: [root.scrollWidth, root.clientWidth], lines: Math.round(h.getBoundingClientRect().height / parseFloat(s.lineHeight)),
        cut: h.scrollWidth > h.clientWidth, overflow: s.textOverflow, whiteSpace: s.whiteSpace, tooltip: h.title,
        right: h.getBoundingClientRect().right, summaries: Array.from(document.querySelectorAll(".summary"), e => e.getBoundingClientRect().right)};"""


def test_a_long_title_is_one_line_cut_with_an_ellipsis_at_1280_by_800(browser, tmp_path):
    """A 400-character title (and run names as long): the page does not scroll sideways; the title is one
    line ending in an ellipsis, its tooltip the whole title."""
    T = 5
    title = "T" * 400
    long_name = "N" * 400
    path = tmp_path / "title.html"
    path.write_text(viz.html(_maps(2, 2, T), BIG[:T], other=_maps(2, 2, T, 1), names=(long_name, "B"), title=title,
                             tables={"E" * 400: np.ones((2, 2))}), encoding="utf-8")
    browser.set_window_size(1280, 800)
    try:
        _open(browser, path)
        for view in ("heatmap", "both"):
            _switch(browser, "view", view)
            got = browser.execute_script(TITLE)
            width, client = got["scroll"]
            assert width <= client, got  # nothing to scroll to sideways
            assert got["lines"] == 1 and got["whiteSpace"] == "nowrap", got
            assert got["cut"] and got["overflow"] == "ellipsis", got  # the text is cut, with "…"
            assert got["right"] <= client and max(got["summaries"]) <= client, got
            assert got["tooltip"] == title
        assert browser.execute_script("return document.title") == title
    finally:
        browser.set_window_size(1400, 1000)
    _no_errors_and_nothing_fetched(browser)
