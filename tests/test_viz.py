"""jaxattn.viz: the HTML page (its data, its size, in a real browser) and the PNG figures."""

import ast
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxattn import viz

ROOT = Path(__file__).resolve().parent.parent

# The trophy pair as a model would label it, with two tokens that would break a page that pasted them
# into HTML unescaped ("</script>" ends a script element; "&" starts an entity).
BIG = ["The", " trophy", " didn", "'t", " fit", " in", " the", " suitcase", " because", " it", " was", " too", " big",
       ".", "</script>&"]
SMALL = BIG[:12] + [" small"] + BIG[13:]
ADJ = 12  # the first position where the two sentences differ


def _softmax(logits, causal):
    T, S = logits.shape[-2:]
    if causal:
        logits = np.where(np.tril(np.ones((T, S), bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def pair():
    """Causal maps [L, N, T, T] of two sentences that share their first ADJ tokens: rows before ADJ agree."""
    rng = np.random.default_rng(0)
    L, N, T = 4, 3, len(BIG)
    logits = 2.0 * rng.standard_normal((L, N, T, T))
    other = logits.copy()
    other[:, :, ADJ:, :] += 2.0 * rng.standard_normal((L, N, T - ADJ, T))
    other[:, :, :, ADJ] += 1.5  # the adjective's column changes in every later row
    return _softmax(logits, True), _softmax(other, True)


def _entropy(p):
    p = np.asarray(p, np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


# ----------------------------------------------------------------------------------------------------
# The page's data and size (no browser).
# ----------------------------------------------------------------------------------------------------


def test_page_is_self_contained_and_holds_the_maps(pair):
    big, small = pair
    page = viz.html(big, BIG, other=small, other_tokens=SMALL, names=("too big", "too small"), title="pair")
    assert "default-src 'none'" in page  # the Content-Security-Policy forbids fetching anything
    assert not re.search(r"""\b(src|href)\s*=\s*["'](?!data:)""", page)  # no script, style or image from elsewhere
    assert "http://" not in page and "https://" not in page
    assert page.count("</script>") == 2  # the data's own "</script>" token is escaped
    data = viz.page_data(page)
    assert data["difference"] is True and data["difference_note"] == ""
    (a, b) = data["runs"]
    assert (a["name"], b["name"]) == ("too big", "too small") and a["keys"] == BIG and b["queries"] == SMALL
    assert a["causal"] is True and b["causal"] is True
    for run, maps in ((a, big), (b, small)):
        np.testing.assert_allclose(run["weights"], maps, rtol=0, atol=0.5 / viz.LEVELS + 1e-12)
        np.testing.assert_array_equal(run["masked"], maps == 0.0)  # the mask's zeros are told from small weights
        np.testing.assert_allclose(run["entropy"], _entropy(maps).mean(-1), atol=1e-5)


def test_page_size_for_smollm2_shaped_maps_of_a_pair():
    # SmolLM2-135M: 30 layers x 9 heads; the trophy sentences are about 15 tokens.
    rng = np.random.default_rng(1)
    big, small = (_softmax(rng.standard_normal((30, 9, 15, 15)), True) for _ in range(2))
    page = viz.html(big, BIG, other=small, other_tokens=SMALL, names=("too big", "too small"))
    size = len(page.encode("utf-8"))
    assert size < 5_000_000
    # the weights take 2 bytes each (base64: 8/3), the page's script and style a few tens of KB
    assert size < 2 * big.size * 2 * 4 / 3 + 60_000


def test_page_of_bidirectional_maps_and_of_unequal_shapes():
    rng = np.random.default_rng(2)
    full = _softmax(rng.standard_normal((2, 2, 5, 5)), False)
    data = viz.page_data(viz.html(full, ["[CLS]", "a", "b", "c", "[SEP]"]))
    assert len(data["runs"]) == 1 and data["runs"][0]["causal"] is False and data["difference"] is False
    longer = _softmax(rng.standard_normal((2, 2, 6, 6)), False)
    data = viz.page_data(viz.html(full, list("abcde"), other=longer, other_tokens=list("abcdef")))
    assert data["difference"] is False and "no difference view" in data["difference_note"]
    cross = _softmax(rng.standard_normal((1, 1, 2, 3)), False)  # T != S: queries and keys labelled apart
    data = viz.page_data(viz.html(cross, (["q0", "q1"], ["k0", "k1", "k2"])))
    assert data["runs"][0]["queries"] == ["q0", "q1"] and data["runs"][0]["keys"] == ["k0", "k1", "k2"]


def test_page_holds_the_tables_exactly_in_their_order(pair):
    import jax.numpy as jnp

    big, _ = pair
    L, N = big.shape[:2]
    rng = np.random.default_rng(4)
    effect = rng.standard_normal((L, N))
    effect[1, 2] = np.nan  # a head without a value
    scores = jnp.asarray(rng.random((L, N)), jnp.bfloat16)  # JAX, bfloat16: kept as its float64 values
    name = "logit attribution </script>&<b>"
    page = viz.html(big, BIG, tables={"ablation effect": effect, name: scores, "h\udc80": np.zeros((L, N))})
    assert page.count("</script>") == 2 and "<b>" not in page
    tables = viz.page_data(page)["tables"]
    assert list(tables) == ["ablation effect", name, "h\ufffd"]  # a lone surrogate becomes U+FFFD
    np.testing.assert_array_equal(tables["ablation effect"], effect)  # NaN where NaN, every other value exact
    np.testing.assert_array_equal(tables[name], np.asarray(scores, np.float64))
    assert viz.page_data(viz.html(big, BIG))["tables"] == {}


@pytest.mark.parametrize(
    "maps, tokens, kwargs, error, message",
    [
        (np.ones((2, 2, 3)), list("abc"), {}, ValueError, r"maps: expected shape \[L, N, T, S\] .* received shape \(2, 2, 3\)"),
        (np.ones((1, 1, 2, 2), np.int32), list("ab"), {}, TypeError, r"maps: expected a floating-point array .* received dtype int32"),
        (np.full((1, 1, 2, 2), 1.5), list("ab"), {}, ValueError, r"maps: expected attention weights in \[0, 1\], received values from 1.5 to 1.5"),
        (np.full((1, 1, 2, 2), np.nan), list("ab"), {}, ValueError, r"maps: expected finite weights, received 4 that are not"),
        (np.full((1, 1, 2, 2), 0.5), list("abc"), {}, ValueError, r"tokens: expected 2 labels \(one per key column, S\), received 3"),
        (np.full((1, 1, 2, 2), 0.5), "ab", {}, TypeError, r"tokens: expected a sequence of 2 strings .* received str"),
        (np.full((1, 1, 2, 2), 0.5), [1, 2], {}, TypeError, r"tokens: expected strings .* received an item of type int"),
        (np.full((1, 1, 1, 2), 0.5), list("ab"), {}, ValueError, r"tokens: the maps have T=1 query rows and S=2 key columns; pass \(query_labels, key_labels\)"),
        (np.full((1, 1, 2, 2), 0.5), list("ab"), {"names": ("a",)}, ValueError, r"names: expected two non-empty strings, received \('a',\)"),
        (np.full((1, 1, 2, 2), 0.5), list("ab"), {"other_tokens": list("ab")}, ValueError, r"other_tokens: given without other"),
        (np.full((1, 1, 2, 2), 0.5), list("ab"), {"other": np.ones((1, 2, 2))}, ValueError, r"other: expected shape \[L, N, T, S\]"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": [np.zeros((2, 3))]}, TypeError,
         r"tables: expected a mapping from table names \(str\) to \[L, N\] arrays, received list"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {3: np.zeros((2, 3))}}, TypeError,
         r"tables: expected table names that are str, received a key of type int"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"": np.zeros((2, 3))}}, ValueError,
         r"tables: expected non-empty table names, received ''"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"x\udc80": np.zeros((2, 3)), "x\udc81": np.zeros((2, 3))}},
         ValueError, r"tables: two table names read 'x\ufffd' once lone surrogates become U\+FFFD"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"effect": np.zeros((3, 2))}}, ValueError,
         r"tables\['effect'\]: expected shape \[L, N\] = \(2, 3\) \(the layers and heads of maps\), received shape \(3, 2\)"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"effect": np.zeros(6)}}, ValueError,
         r"tables\['effect'\]: expected shape \[L, N\] = \(2, 3\) .* received shape \(6,\)"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"effect": np.zeros((2, 3), np.int64)}}, TypeError,
         r"tables\['effect'\]: expected a real floating-point array \[L, N\] = \(2, 3\), received dtype int64"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"effect": np.zeros((2, 3), np.complex64)}}, TypeError,
         r"tables\['effect'\]: expected a real floating-point array .* received dtype complex64"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"effect": [["a"] * 3] * 2}}, TypeError,
         r"tables\['effect'\]: expected a real floating-point array .* received dtype <U1"),
        (np.full((2, 3, 2, 2), 0.5), list("ab"), {"tables": {"effect": np.array([[0, np.inf, 0], [0, 0, -np.inf]])}},
         ValueError, r"tables\['effect'\]: expected finite values or NaN \(no value\), received 2 infinite"),
    ],
)
def test_page_rejects_bad_input_naming_the_argument(maps, tokens, kwargs, error, message):
    with pytest.raises(error, match=message):
        viz.html(maps, tokens, **kwargs)


# ----------------------------------------------------------------------------------------------------
# In a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by selenium. Missing
# either fails the test; it is never skipped (.ci/run installs them).
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.fail(f"the browser test needs selenium (the dev extra: pip install -e '.[dev]'): {e}")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("the browser test needs headless Chromium: apt-get install chromium chromium-driver "
                    f"(found chromium={chromium}, chromedriver={driver}); .ci/run installs both")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield d
    finally:
        d.quit()


def _open(browser, path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(path.as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))


def _at(browser, element, x, y, *, click=False):
    """Move the mouse to CSS pixel (x, y) from the element's top-left corner (and click)."""
    from selenium.webdriver.common.action_chains import ActionChains

    w, h = browser.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.width, r.height];", element)
    chain = ActionChains(browser).move_to_element_with_offset(element, int(round(x - w / 2)), int(round(y - h / 2)))
    (chain.click() if click else chain).perform()


TOOLTIP = """const t = document.getElementById("tooltip");
return Object.assign({text: t.innerText, shown: !t.hidden && t.getBoundingClientRect().width > 0}, t.dataset);"""


def _cell(browser, canvas_id, t, s, *, click=False):
    """Hover (or click) the cell in row t, column s of a grid canvas; returns the tooltip: its text,
    whether it is shown, and its data attributes."""
    from selenium.webdriver.common.by import By

    canvas = browser.find_element(By.ID, canvas_id)
    x0, y0, cell = browser.execute_script("const d = arguments[0].dataset; return [+d.x0, +d.y0, +d.cell];", canvas)
    _at(browser, canvas, x0 + (int(s) + 0.5) * cell, y0 + (int(t) + 0.5) * cell, click=click)
    return browser.execute_script(TOOLTIP)


def _choose(browser, select_id, value):
    """Pick an option as a user does (selenium's Select)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, select_id)).select_by_value(str(value))


def _switch(browser, select_id, value):
    """Set a selector and fire its change event in one round trip (faster than Select's dozen)."""
    browser.execute_script(
        "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
        "s.dispatchEvent(new Event('change')); return s.value;", select_id, str(value))


def _weight(text):
    return float(re.search(r"weight (\d\.\d{4})", text).group(1))


def _distinct_colours(png):
    from matplotlib.image import imread

    pixels = np.round(imread(io.BytesIO(png))[..., :3] * 255).astype(np.uint32)  # [H, W, 3]
    return len(np.unique(pixels[..., 0] << 16 | pixels[..., 1] << 8 | pixels[..., 2]))


def _no_errors_and_nothing_fetched(browser):
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    assert browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)") == []


def test_page_in_a_browser_selects_hovers_and_shows_the_difference(browser, pair, tmp_path):
    from selenium.webdriver.common.by import By

    big, small = pair
    path = tmp_path / "pair.html"
    path.write_text(viz.html(big, BIG, other=small, other_tokens=SMALL, names=("too big", "too small"), title="pair"),
                    encoding="utf-8")
    _open(browser, path)
    body = browser.find_element(By.TAG_NAME, "body")

    # pick a head with the selectors, hover a cell: the token pair and the weight of the data
    _choose(browser, "layer", 2)
    _choose(browser, "head", 1)
    tip = _cell(browser, "heatmap", 9, 1)
    assert tip["shown"]
    assert 'layer 2, head 1: query 9 " it" \u2192 key 1 " trophy"' in tip["text"]
    assert _weight(tip["text"]) == pytest.approx(big[2, 1, 9, 1], abs=5e-5 + 1e-5)
    assert (tip["query"], tip["key"], tip["keyToken"]) == ("9", "1", " trophy")
    assert float(tip["weight"]) == pytest.approx(big[2, 1, 9, 1], abs=1e-5)

    # a key the causal mask hides
    tip = _cell(browser, "heatmap", 3, 14)
    assert 'query 3 "\'t" \u2192 key 14 "</script>&"' in tip["text"] and "weight 0 (hidden by the mask)" in tip["text"]

    # pick another head in the entropy overview: the selectors and the heatmap follow
    _cell(browser, "overview", 3, 2, click=True)
    assert (body.get_attribute("data-layer"), body.get_attribute("data-head")) == ("3", "2")
    assert browser.find_element(By.ID, "layer").get_attribute("value") == "3"
    tip = _cell(browser, "heatmap", 14, 12)
    assert 'layer 3, head 2: query 14 "</script>&" \u2192 key 12 " big"' in tip["text"]
    assert _weight(tip["text"]) == pytest.approx(big[3, 2, 14, 12], abs=6e-5)

    # the second sentence, then the difference: too big minus too small
    _switch(browser, "mode", 1)
    tip = _cell(browser, "heatmap", 13, 12)
    assert 'key 12 " small"' in tip["text"] and _weight(tip["text"]) == pytest.approx(small[3, 2, 13, 12], abs=6e-5)
    _switch(browser, "mode", "diff")
    tip = _cell(browser, "heatmap", 13, 12)
    d = big[3, 2, 13, 12] - small[3, 2, 13, 12]
    assert 'key 12 " big/ small"' in tip["text"]
    match = re.search(r"too big (\d\.\d{4}) \u2212 too small (\d\.\d{4}) = ([+\u2212]\d\.\d{4})", tip["text"])
    assert match, tip["text"]
    assert float(match.group(3).replace("\u2212", "-")) == pytest.approx(d, abs=1e-4)
    assert float(tip["weight"]) == pytest.approx(d, abs=2e-5)
    tip = _cell(browser, "heatmap", 5, 3)  # before the adjective a causal row is the same in both
    assert "= +0.0000" in tip["text"]

    # BertViz-style lines next to the heatmap: hovering a query names the key it weighs most
    _switch(browser, "mode", 0)
    _switch(browser, "view", "both")
    lines = browser.find_element(By.ID, "lines")
    assert lines.is_displayed() and browser.find_element(By.ID, "heatmap").is_displayed()
    xl, y0, row = browser.execute_script("const d = arguments[0].dataset; return [+d.xl, +d.y0, +d.row];", lines)
    _at(browser, lines, xl - 8, y0 + 10.5 * row)
    tip = browser.execute_script(TOOLTIP)
    top = int(np.argmax(big[3, 2, 10]))
    assert f'query 10 " was" looks most at: {json.dumps(BIG[top])} {big[3, 2, 10, top]:.4f}' in tip["text"]

    # not blank: the whole page and the heatmap alone are many colours
    assert _distinct_colours(browser.get_screenshot_as_png()) > 100
    assert _distinct_colours(browser.find_element(By.ID, "heatmap").screenshot_as_png) > 20
    _no_errors_and_nothing_fetched(browser)


def test_page_in_a_browser_for_a_bidirectional_model(browser, tmp_path):
    from selenium.webdriver.common.by import By

    rng = np.random.default_rng(3)
    maps = _softmax(rng.standard_normal((2, 4, 6, 6)) * 2, False)
    tokens = ["[CLS]", "the", "trophy", "it", "big", "[SEP]"]
    path = tmp_path / "encoder.html"
    path.write_text(viz.html(maps, tokens, title="encoder"), encoding="utf-8")
    _open(browser, path)
    assert not browser.find_element(By.ID, "mode").is_displayed()  # one set of maps: nothing to switch
    assert "causal" not in browser.find_element(By.CLASS_NAME, "summary").text
    _choose(browser, "layer", 1)
    _choose(browser, "head", 3)
    tip = _cell(browser, "heatmap", 0, 5)  # above the diagonal: a bidirectional query sees later keys
    assert 'layer 1, head 3: query 0 "[CLS]" \u2192 key 5 "[SEP]"' in tip["text"]
    assert _weight(tip["text"]) == pytest.approx(maps[1, 3, 0, 5], abs=6e-5) and maps[1, 3, 0, 5] > 0
    assert _distinct_colours(browser.find_element(By.ID, "heatmap").screenshot_as_png) > 20
    _no_errors_and_nothing_fetched(browser)


# The page's palettes (page.js) and its colour at x in [0, 1], as the page computes it: the oracle for pixels.
VIRIDIS = ["#440154", "#481a6c", "#472f7d", "#414487", "#39568c", "#31688e", "#2a788e", "#23888e",
           "#1f988b", "#22a884", "#35b779", "#54c568", "#7ad151", "#a5db36", "#d2e21b", "#fde725"]
BLUE, RED, GREY = (33, 102, 172), (178, 24, 43), (217, 217, 217)  # the diverging scale's ends; no value


def _ramp(stops, x):
    rgb = [tuple(int(h[i:i + 2], 16) for i in (1, 3, 5)) for h in stops]
    p = min(1.0, max(0.0, x)) * (len(stops) - 1)
    i = min(len(stops) - 2, int(p))
    return tuple(round(a + (p - i) * (b - a)) for a, b in zip(rgb[i], rgb[i + 1]))


PIXEL = """const c = document.getElementById(arguments[0]), d = c.dataset, r = window.devicePixelRatio || 1;
const x = (+d.x0 + (arguments[2] + 0.5) * +d.cell) * r, y = (+d.y0 + (arguments[1] + 0.5) * +d.cell) * r;
return Array.from(c.getContext("2d").getImageData(Math.floor(x), Math.floor(y), 1, 1).data.slice(0, 3));"""


def _pixel(browser, canvas_id, t, s):
    """The colour (r, g, b) drawn at the centre of the cell in row t, column s of a grid canvas."""
    return tuple(browser.execute_script(PIXEL, canvas_id, int(t), int(s)))


def test_page_in_a_browser_shows_tables_and_a_click_selects_the_head(browser, pair, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    big, _ = pair
    L, N = big.shape[:2]
    rng = np.random.default_rng(5)
    scores = rng.random((L, N))  # one sign: sequential, from its smallest value to its largest
    effect = rng.standard_normal((L, N))  # both signs: blue-white-red from -max|effect| to +max|effect|
    effect[2, 0] = np.nan
    name = "ablation effect </script>&<b>"
    path = tmp_path / "tables.html"
    path.write_text(viz.html(big, BIG, tables={"head score": scores, name: effect}, title="tables"), encoding="utf-8")
    _open(browser, path)
    body = browser.find_element(By.TAG_NAME, "body")
    table = Select(browser.find_element(By.ID, "table"))
    assert [o.text for o in table.options] == ["head score", name]  # the name as text, not markup

    grid, bar = browser.find_element(By.ID, "table-grid"), browser.find_element(By.ID, "table-legend")
    assert grid.get_attribute("data-scale") == "sequential"
    assert (float(bar.get_attribute("data-lo")), float(bar.get_attribute("data-hi"))) == (scores.min(), scores.max())
    low = np.unravel_index(np.argmin(scores), scores.shape)
    assert _pixel(browser, "table-grid", *low) == _ramp(VIRIDIS, 0.0)

    _choose(browser, "table", 1)
    m = np.nanmax(np.abs(effect))
    assert body.get_attribute("data-table") == "1" and grid.get_attribute("data-scale") == "diverging"
    assert (float(bar.get_attribute("data-lo")), float(bar.get_attribute("data-hi"))) == (-m, m)
    assert name in bar.get_attribute("aria-label")
    strongest = np.unravel_index(np.nanargmax(np.abs(effect)), effect.shape)
    assert _pixel(browser, "table-grid", *strongest) == (RED if effect[strongest] > 0 else BLUE)
    assert _pixel(browser, "table-grid", 2, 0) == GREY
    tip = _cell(browser, "table-grid", 2, 0)
    assert tip["shown"] and f"layer 2, head 0: {name}: no value" in tip["text"] and tip["value"] == "NaN"

    # hover a head: its value; click it: the selectors, the heatmap and its colours show that head
    t, s = 9, 1
    assert _pixel(browser, "heatmap", t, s) == _ramp(VIRIDIS, big[0, 0, t, s])
    tip = _cell(browser, "table-grid", 3, 1, click=True)
    assert f"layer 3, head 1: {name} = {float(f'{effect[3, 1]:.4g}')!r}" in tip["text"]
    assert float(tip["value"]) == effect[3, 1]  # exactly: the page keeps every value
    assert (body.get_attribute("data-layer"), body.get_attribute("data-head")) == ("3", "1")
    assert [browser.find_element(By.ID, k).get_attribute("value") for k in ("layer", "head")] == ["3", "1"]
    tip = _cell(browser, "heatmap", t, s)
    assert 'layer 3, head 1: query 9 " it" \u2192 key 1 " trophy"' in tip["text"]
    assert _weight(tip["text"]) == pytest.approx(big[3, 1, t, s], abs=6e-5)
    for t, s in ((t, s), (14, 0), (6, 6)):
        assert np.abs(np.subtract(_pixel(browser, "heatmap", t, s), _ramp(VIRIDIS, big[3, 1, t, s]))).max() <= 1
    _no_errors_and_nothing_fetched(browser)


# The viewport's box, and every element drawn outside it or with its content cut (an ellipsis), the colour bars'.
FITS = """const root = document.documentElement, W = root.clientWidth, H = root.clientHeight;
const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const inside = b => b[0] >= 0 && b[1] >= 0 && b[2] <= W && b[3] <= H;
const name = e => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + (e.className ? "." + e.className : "");
const outside = [], cut = [], shown = {};
for (const e of document.body.querySelectorAll("*")) {
  const r = e.getBoundingClientRect();
  if (r.width === 0 || r.height === 0) continue;  // hidden (display: none) or empty
  if (!inside(box(e))) outside.push(name(e) + " " + JSON.stringify(box(e)));
  if (getComputedStyle(e).overflowX === "hidden" && e.scrollWidth > e.clientWidth) cut.push(name(e) + " " + e.textContent);
}
for (const id of ["legend", "overview-legend", "table-legend", "heatmap", "lines"]) {
  const b = box(document.getElementById(id));
  shown[id] = b[2] > b[0] && b[3] > b[1] && inside(b);
}
return {viewport: [W, H], inner: [innerWidth, innerHeight], scroll: [root.scrollWidth, root.scrollHeight],
        outside: outside, cut: cut, shown: shown};"""


def test_page_fits_a_1280_by_800_window(browser, tmp_path):
    """SmolLM2-135M's shape (30 layers x 9 heads), two 16-token inputs and a table: in every view every
    element lies inside the viewport, nothing scrolls, the colour bars and the maps are on screen."""
    rng = np.random.default_rng(6)
    tokens = BIG + [" It"]
    big, small = (_softmax(2.0 * rng.standard_normal((30, 9, 16, 16)), True) for _ in range(2))
    effect = rng.standard_normal((30, 9))
    effect[0, 0] = np.nan
    path = tmp_path / "smollm2.html"
    path.write_text(viz.html(big, tokens, other=small, names=("too big", "too small"), title="SmolLM2-135M, trophy pair",
                             tables={"ablation effect": effect}), encoding="utf-8")
    browser.set_window_size(1280, 800)
    try:
        _open(browser, path)
        for mode, view in (("0", "heatmap"), ("0", "lines"), ("0", "both"), ("diff", "both")):
            _switch(browser, "mode", mode)
            _switch(browser, "view", view)
            fits = browser.execute_script(FITS)
            W, H = fits["viewport"]
            assert W <= 1280 and H <= 800 and fits["inner"][0] == 1280, fits  # inside the window's 1280 x 800
            assert fits["outside"] == [] and fits["cut"] == [], (mode, view, fits)
            assert fits["scroll"] == [W, H], (mode, view, fits)  # nothing to scroll to, either way
            expected = {"legend": True, "overview-legend": True, "table-legend": True,
                        "heatmap": view != "lines", "lines": view != "heatmap"}
            assert fits["shown"] == expected, (mode, view, fits)
            shot = tmp_path / f"viz_1280x800_{mode}_{view}.png"
            assert browser.save_screenshot(str(shot))
            png = shot.read_bytes()
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and _distinct_colours(png) > 100
    finally:
        browser.set_window_size(1400, 1000)
    _no_errors_and_nothing_fetched(browser)


# ----------------------------------------------------------------------------------------------------
# PNG figures.
# ----------------------------------------------------------------------------------------------------


def _labels(ticks):
    return [t.get_text() for t in ticks]


def test_grid_figure_has_token_labels_on_both_axes_and_a_colorbar(pair):
    big, small = pair
    L, N, T, S = big.shape
    fig = viz.grid_figure(big, BIG, title="grid")
    ax = fig.axes[0]
    expected = [f"{i} {x!r}" if x.strip() != x else f"{i} {x}" for i, x in enumerate(BIG)]
    assert _labels(ax.get_yticklabels()) == expected * L  # queries beside every layer's row of blocks
    assert _labels(ax.get_xticklabels()) == expected * N  # keys under every head's column of blocks
    (bar,) = [a for a in fig.axes if a.get_ylabel() == "attention weight"]
    image = ax.get_images()[0]
    assert image.get_clim() == (0.0, 1.0)
    masked = np.asarray(image.get_array())
    assert np.sum(masked == -1.0) == L * N * T * (T - 1) // 2  # the mask's zeros, drawn below the scale (grey)

    diff = viz.grid_figure(big - small, viz.merged_labels(BIG, SMALL), difference=True)
    image = diff.axes[0].get_images()[0]
    lo, hi = image.get_clim()
    assert lo == -hi == pytest.approx(-np.abs(big - small).max()) and image.get_cmap().name.startswith("RdBu_r")
    assert "12 ' big/ small'" in _labels(diff.axes[0].get_xticklabels())
    assert [a for a in diff.axes if a.get_ylabel() == "difference of attention weights"]
    assert viz.grid_png(big[:1, :2], BIG).startswith(b"\x89PNG\r\n\x1a\n")


def test_pair_figure_shows_both_maps_and_their_difference(pair):
    big, small = pair
    fig = viz.pair_figure(big[1, 2], small[1, 2], BIG, SMALL, names=("too big", "too small"))
    images = [a for a in fig.axes if a.get_images()]
    assert [a.get_title() for a in images] == ["too big", "too small", "too big - too small"]
    for a in images:
        assert len(a.get_xticklabels()) == len(a.get_yticklabels()) == len(BIG)
    assert "12 ' small'" in _labels(images[1].get_yticklabels())
    np.testing.assert_allclose(images[2].get_images()[0].get_array(), big[1, 2] - small[1, 2])
    assert sorted(a.get_ylabel() for a in fig.axes if not a.get_images()) == ["attention weight", "attention weight",
                                                                              "difference"]
    with pytest.raises(ValueError, match=r"b: expected the shape of a, \(15, 15\), received \(14, 14\)"):
        viz.pair_figure(big[1, 2], small[1, 2, :14, :14], BIG, SMALL[:14])
    for names in ("AB", ("", "B"), ("A",)):  # as html() refuses them: a str is not two names
        with pytest.raises(ValueError, match=r"names: expected two non-empty strings"):
            viz.pair_png(big[1, 2], small[1, 2], BIG, SMALL, names=names)


def test_figures_never_touch_matplotlibs_global_state():
    """No pyplot and no ``matplotlib.use`` anywhere in the package: figures are Figure + FigureCanvasAgg."""
    offenders = []
    for path in sorted((ROOT / "jaxattn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and "pyplot" in n for n in names):
                    offenders.append(f"{path.name}: imports pyplot")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("use", "switch_backend"):
                if isinstance(node.func.value, ast.Name) and node.func.value.id in ("matplotlib", "plt", "mpl"):
                    offenders.append(f"{path.name}: {node.func.value.id}.{node.func.attr}")
    assert offenders == []


def test_overview_of_heads_alike_shows_their_value_not_an_invented_range(browser, tmp_path):
    """Every head with the same mean row entropy (one head; uniform maps): the colour bar is at that value
    (lo = hi = the entropy), not "0 to 0.000001" with every cell at the top colour."""
    T = 6
    x = np.tril(np.random.default_rng(0).random((1, 1, T, T)))
    cases = {"one": x / x.sum(-1, keepdims=True), "uniform": np.full((2, 2, T, T), 1 / T)}
    for name, maps in cases.items():
        path = tmp_path / f"{name}.html"
        path.write_text(viz.html(maps, [f"t{i}" for i in range(T)]), encoding="utf-8")
        _open(browser, path)
        lo, hi = browser.execute_script("const c = document.getElementById('overview-legend'); "
                                        "return [+c.dataset.lo, +c.dataset.hi];")
        entropy = np.unique(np.asarray(viz.page_data(path.read_text(encoding="utf-8"))["runs"][0]["entropy"]))
        assert entropy.size == 1 and lo == hi == pytest.approx(float(entropy[0]), rel=1e-6), (name, lo, hi, entropy)
