"""jaxattn.viz's table panel: whole table names, every layer and head labelled, each table's top heads (a click
shows one), and tables that name the tokens they were computed on.

The browser and its helpers are tests/test_viz.py's."""

import numpy as np
import pytest
from selenium.webdriver.common.by import By
from test_viz import BIG, _no_errors_and_nothing_fetched, _open, _softmax, _switch
from test_viz import browser  # noqa: F401  (the fixture)

from jaxattn import viz

NAME = "zero-ablation (Parallel attention, mean over 200 prompts) L2"  # 60 characters
assert len(NAME) == 60


def _maps(L, N, T, seed=0):
    return _softmax(2.0 * np.random.default_rng(seed).standard_normal((L, N, T, T)), True)


# ----------------------------------------------------------------------------------------------------
# Tables with their tokens (no browser).
# ----------------------------------------------------------------------------------------------------


def test_a_table_computed_on_the_pages_tokens_is_accepted_in_each_form():
    maps, values = _maps(2, 3, 4), np.arange(6.0).reshape(2, 3)
    tokens = BIG[:4]
    page = viz.html(maps, tokens, tables={
        "plain": values,
        "named tuple": viz.Table(values, tokens),
        "mapping": {"values": values, "tokens": list(tokens)},
        "no tokens": viz.Table(values),
        "pair": viz.Table(values, (tokens, tokens)),
    })
    tables = viz.page_data(page)["tables"]
    assert list(tables) == ["plain", "named tuple", "mapping", "no tokens", "pair"]
    for got in tables.values():
        np.testing.assert_array_equal(got, values)
    queries, keys = ["q0", "q1"], ["k0", "k1", "k2"]
    cross = _softmax(np.zeros((2, 3, 2, 3)), False)
    page = viz.html(cross, (queries, keys), tables={"t": {"values": values, "tokens": (queries, keys)}})
    np.testing.assert_array_equal(viz.page_data(page)["tables"]["t"], values)


@pytest.mark.parametrize(
    "table, message",
    [
        (viz.Table(np.zeros((2, 3)), BIG[:3] + [" cat"]),
         r"tables\['effect'\]: computed on other tokens than the page's \(token 3 is ' cat', the page's is \"'t\"\)"),
        ({"values": np.zeros((2, 3)), "tokens": BIG[:3]},
         r"tables\['effect'\]: computed on other tokens than the page's \(3 tokens, the page has 4\)"),
        ({"values": np.zeros((2, 3)), "tokens": (BIG[:4], BIG[1:5])},
         r"tables\['effect'\]: computed on other tokens than the page's \(key labels: token 0 is ' trophy'"),
        ({"values": np.zeros((2, 3)), "tokens": "abcd"}, r"tables\['effect'\].tokens: expected a sequence of strings"),
        ({"values": np.zeros((2, 3)), "labels": BIG[:4]}, r"tables\['effect'\]: expected a mapping with the keys 'values'"),
    ],
)
def test_a_table_of_other_tokens_is_refused_naming_it(table, message):
    error = TypeError if "tokens: expected" in message else ValueError
    with pytest.raises(error, match=message):
        viz.html(_maps(2, 3, 4), BIG[:4], tables={"plain": np.zeros((2, 3)), "effect": table})


@pytest.mark.parametrize("top", [-1, 2.5, True, "10"])
def test_top_must_be_a_count(top):
    with pytest.raises(ValueError, match=r"top: expected an int >= 0"):
        viz.html(_maps(1, 2, 3), BIG[:3], top=top)


# ----------------------------------------------------------------------------------------------------
# In headless Chromium at 1280 x 800.
# ----------------------------------------------------------------------------------------------------

# Every grid label's box, by grid and kind, the table's name and list, and how the document scrolls.
BOXES = """const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const labels = id => ({layers: Array.from(document.querySelectorAll("#" + id + " .layer-label"), e => [e.textContent, box(e)]),
                       heads: Array.from(document.querySelectorAll("#" + id + " .head-label"), e => [e.textContent, box(e)])});
const root = document.documentElement, name = document.getElementById("table-name");
return {overview: labels("overview-labels"), table: labels("table-labels"),
        name: [name.textContent, box(name), name.scrollWidth <= name.clientWidth, getComputedStyle(name).visibility],
        select: document.getElementById("table").title, viewport: [root.clientWidth, root.clientHeight],
        scroll: [root.scrollWidth, root.scrollHeight]};"""


def _overlap(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _page(tmp_path, L, N, T=8, **tables):
    rng = np.random.default_rng(L * 100 + N)
    values = rng.standard_normal((L, N))
    values[0, 1] = np.nan
    path = tmp_path / f"tables_{L}x{N}.html"
    path.write_text(viz.html(_maps(L, N, T), BIG[:T], tables={NAME: values, **tables}), encoding="utf-8")
    return path, values


@pytest.mark.parametrize("L, N", [(30, 9), (30, 12), (12, 40), (40, 40)])  # 40 heads: each grid 9 px a head
def test_every_layer_and_head_is_labelled_without_overlap_and_the_name_is_whole_at_1280_by_800(browser, tmp_path, L, N):
    path, _ = _page(tmp_path, L, N)
    browser.set_window_size(1280, 800)
    try:
        _open(browser, path)
        for view in ("heatmap", "both"):
            _switch(browser, "view", view)
            got = browser.execute_script(BOXES)
            W, H = got["viewport"]
            assert got["scroll"][0] <= W, got["scroll"]  # nothing to scroll to sideways
            for grid in ("overview", "table"):
                layers, heads = got[grid]["layers"], got[grid]["heads"]
                assert [t for t, _ in layers] == [f"L{i}" for i in range(L)], grid
                assert [t for t, _ in heads] == [f"h{i}" for i in range(N)], grid
                for kind in (layers, heads):
                    for (_, a), (_, b) in zip(kind, kind[1:]):
                        assert not _overlap(a, b), (grid, view, a, b)
                    for _, b in kind:
                        assert b[2] > b[0] and b[3] > b[1] and 0 <= b[0] and b[2] <= W and 0 <= b[1] and b[3] <= H
                assert not any(_overlap(a, b) for _, a in layers for _, b in heads), grid
            text, b, whole, visibility = got["name"]
            assert text == NAME and whole and visibility == "visible"  # the whole name, not cut
            assert 0 <= b[0] and b[2] <= W and 0 <= b[1] and b[3] <= H, b
            assert got["select"] == NAME
    finally:
        browser.set_window_size(1400, 1000)
    _no_errors_and_nothing_fetched(browser)


LIST = """return Array.from(document.querySelectorAll("#table-top button"),
                  e => [e.textContent, +e.dataset.layer, +e.dataset.head, e.dataset.value, e.hasAttribute("aria-current")]);"""


def test_the_top_heads_are_listed_by_magnitude_and_a_click_selects_one(browser, tmp_path):
    L, N = 30, 9
    rng = np.random.default_rng(3)
    scores = rng.random((L, N))
    path, values = _page(tmp_path, L, N, **{"head score": scores})
    browser.set_window_size(1280, 800)
    try:
        _open(browser, path)
        body = browser.find_element(By.TAG_NAME, "body")
        for index, table in enumerate((values, scores)):
            _switch(browser, "table", index)
            entries = browser.execute_script(LIST)
            flat = np.abs(table).ravel()
            order = [i for i in np.argsort(-flat, kind="stable") if not np.isnan(flat[i])][:10]
            assert [(l, n) for _, l, n, _, _ in entries] == [divmod(int(i), N) for i in order]
            for text, l, n, value, _ in entries:
                assert float(value) == table[l, n]  # exactly
                assert text.startswith(f"L{l} H{n}: ")
                assert float(text.split(": ")[1]) == pytest.approx(table[l, n], rel=1e-3)

        # a click on the third entry: the selectors, the page's state and the maps' title show that head
        _, l, n, _, _ = browser.execute_script(LIST)[2]
        assert (l, n) != (0, 0)
        browser.find_elements(By.CSS_SELECTOR, "#table-top button")[2].click()
        assert (body.get_attribute("data-layer"), body.get_attribute("data-head")) == (str(l), str(n))
        assert [browser.find_element(By.ID, k).get_attribute("value") for k in ("layer", "head")] == [str(l), str(n)]
        assert f"layer {l}, head {n}" in browser.find_element(By.CSS_SELECTOR, "#maps-box h2").text
        assert [e[4] for e in browser.execute_script(LIST)] == [i == 2 for i in range(10)]  # marked as shown

        # in the lines view too: the view stays, the head changes
        _switch(browser, "view", "lines")
        browser.find_elements(By.CSS_SELECTOR, "#table-top button")[0].click()
        _, l, n, _, _ = browser.execute_script(LIST)[0]
        assert (body.get_attribute("data-layer"), body.get_attribute("data-head")) == (str(l), str(n))
        assert body.get_attribute("data-view") == "lines"
    finally:
        browser.set_window_size(1400, 1000)
    _no_errors_and_nothing_fetched(browser)


def test_top_sets_the_lists_length_and_zero_hides_it(browser, tmp_path):
    values = np.random.default_rng(9).standard_normal((4, 3))
    for top, shown in ((3, 3), (50, 12), (0, 0)):
        path = tmp_path / f"top{top}.html"
        path.write_text(viz.html(_maps(4, 3, 5), BIG[:5], tables={"t": values}, top=top), encoding="utf-8")
        _open(browser, path)
        assert len(browser.execute_script(LIST)) == shown
        assert browser.find_element(By.ID, "table-side").is_displayed() == (top > 0)
    _no_errors_and_nothing_fetched(browser)
