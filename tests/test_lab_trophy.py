"""Lab parts 3-4: the " it" row under a causal mask, the trophy/suitcase flip, the renderers."""

import json

import numpy as np
import pytest

from jaxattn import gpt2, viz
from jaxattn import lab as trophy
from jaxattn.checkpoint import TextTokenizer, flatten


TEXTS = [t + trophy.RESOLUTION_PROMPT + r for t in trophy.SENTENCES.values() for r in trophy.RESOLUTIONS.values()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny GPT-2 with a byte-level BPE trained here, saved and loaded back as a checkpoint."""
    params, config, tokenizer = gpt2.random_model("tiny", seed=1, texts=TEXTS)
    directory = gpt2.save(tmp_path_factory.mktemp("tiny"), params, config, tokenizer)
    loaded = gpt2.load(directory)
    return trophy.lab_model(gpt2, *loaded, name="tiny"), loaded, (params, config, tokenizer)


@pytest.fixture(scope="module")
def compared(tiny):
    """The comparison, and the calls it made to its progress callback."""
    calls = []
    return trophy.compare(tiny[0], progress=lambda *a: calls.append(a)), calls


@pytest.fixture(scope="module")
def comparison(compared):
    return compared[0]


def test_compare_says_which_model_run_comes_next(compared):
    calls = compared[1]
    assert [c[:2] for c in calls] == [(i, 11) for i in range(12)]  # 3 maps + 4 + 4 scores, then done
    assert calls[0][2] == "maps of 'too big'" and calls[2][2] == "log p(' trophy' | 'too big')"
    assert calls[-2][2] == "maps of 'too big' with scale=1.0" and calls[-1][2] == "done"


def test_save_load_round_trip(tiny):
    _, (params, config, tokenizer), (p0, c0, t0) = tiny
    assert config == c0
    flat, flat0 = flatten(params), flatten(p0)
    assert flat.keys() == flat0.keys()
    for key in flat0:
        np.testing.assert_array_equal(flat[key], flat0[key])
    text = trophy.SENTENCES["small"]
    assert tokenizer.encode(text).tolist() == t0.encode(text).tolist()


def test_it_row_is_bit_identical_under_the_causal_mask(comparison):
    big, small = comparison.maps["big"], comparison.maps["small"]
    it = comparison.it_index
    assert big.labels[it] == " it" and small.labels[it] == " it"
    assert comparison.first_difference > it  # the sentences differ only after " it"
    assert comparison.it_row_max_abs_diff.shape == big.attentions.shape[:2]
    assert np.all(comparison.it_row_max_abs_diff == 0.0)
    np.testing.assert_array_equal(big.attentions[:, :, : it + 1], small.attentions[:, :, : it + 1])
    # ...while rows that can see the adjective do change: the test can fail.
    assert np.abs(comparison.flip["period"]).max() > 0.0
    assert np.all(comparison.flip["it"] == 0.0)
    assert comparison.to_json()["it_row_identical"] is True


def test_shared_prefix_rows_identical_for_raw_ids():
    """The same property without any tokenizer: ids that share a prefix, one length."""
    config = gpt2.GPT2Config.make(vocab_size=50, n_positions=16, n_embd=16, n_layer=3, n_head=2)
    params = gpt2.init_params(2, config)
    a = np.array([3, 14, 15, 9, 2, 6, 5, 35], np.int32)
    b = a.copy()
    b[5:] = [49, 1, 0]
    wa = np.asarray(gpt2.forward(params, config, a).attentions)
    wb = np.asarray(gpt2.forward(params, config, b).attentions)
    np.testing.assert_array_equal(wa[:, :, :5], wb[:, :, :5])
    assert np.abs(wa[:, :, 5:] - wb[:, :, 5:]).max() > 0.0


def test_preference_and_flip_are_what_they_say(comparison):
    big = comparison.maps["big"]
    t = trophy.word_span(big.labels, "trophy")
    s = trophy.word_span(big.labels, "suitcase")
    row = len(big.labels) - 1
    expect = big.attentions[:, :, row, t[0]:t[1]].sum(-1) - big.attentions[:, :, row, s[0]:s[1]].sum(-1)
    np.testing.assert_allclose(comparison.preference["period"]["big"], expect)
    ranking = comparison.ranking("adjective")
    flips = [r["flip"] for r in ranking]
    assert flips == sorted(flips, reverse=True) and len(ranking) == big.attentions.shape[0] * big.attentions.shape[1]
    top = ranking[0]
    assert top["flip"] == pytest.approx(top["big"] - top["small"])


def test_log_probs_are_the_models(tiny, comparison):
    _, (params, config, tokenizer), _ = tiny
    prefix = trophy.SENTENCES["small"] + trophy.RESOLUTION_PROMPT
    p, c = tokenizer.encode(prefix), tokenizer.encode(" suitcase")
    direct = gpt2.log_prob(params, config, np.concatenate([p, c]), start=len(p))
    assert comparison.log_probs["small"]["suitcase"] == pytest.approx(float(direct), abs=1e-6)
    assert all(v < 0 for d in comparison.log_probs.values() for v in d.values())


def test_substitution_scores_are_the_sentences_log_probabilities(tiny, comparison):
    """Trinh & Le's scoring: each candidate in place of "it"; the shared prefix cancels in the comparison."""
    _, (params, config, tokenizer), _ = tiny
    prefix, rests = trophy.substitutions(trophy.SENTENCES["big"])
    assert prefix + rests["suitcase"] == "The trophy didn't fit in the suitcase because the suitcase was too big."
    p, c = tokenizer.encode(prefix), tokenizer.encode(rests["trophy"])
    direct = gpt2.log_prob(params, config, np.concatenate([p, c]), start=len(p))
    assert comparison.substitution["big"]["trophy"] == pytest.approx(float(direct), abs=1e-5)
    assert "its verdict by substitution (Trinh & Le 2018)" in trophy.render_part4(comparison)
    with pytest.raises(ValueError, match="must contain ' it ' after 'because'"):
        trophy.substitutions("The trophy didn't fit because that was too big.")


def test_the_causal_it_row_beside_a_bidirectional_one(comparison):
    encoder = trophy.compare(_toy_bidirectional())
    text = trophy.render_contrast(comparison, encoder)
    lines = text.splitlines()
    L = comparison.it_row_max_abs_diff.shape[0]
    assert len([x for x in lines if x.strip()[:1].isdigit()]) == max(L, encoder.it_row_max_abs_diff.shape[0])
    assert "(bit-identical)" in lines[-1] and f"{encoder.it_row_max_abs_diff.max():.3g}" in lines[-1]
    with pytest.raises(ValueError, match="causal model's Comparison first"):
        trophy.render_contrast(encoder, comparison)


def _entropy_f64(p):
    """Independent float64 row entropy with 0 log 0 = 0."""
    p = np.asarray(p, np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def test_entropy_scaled_vs_unscaled(tiny, comparison):
    model = tiny[0]
    unscaled = trophy.sentence_maps(model, trophy.SENTENCES["big"], scale=1.0).attentions
    np.testing.assert_allclose(comparison.entropy["unscaled"], _entropy_f64(unscaled).mean(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        comparison.entropy["scaled"], _entropy_f64(comparison.maps["big"].attentions).mean(-1), rtol=1e-5, atol=1e-6
    )
    assert np.all(comparison.entropy["unscaled"] <= comparison.entropy["scaled"] + 1e-6)


def _toy_bidirectional() -> trophy.LabModel:
    """A bidirectional toy, tokenized like an encoder ([CLS] ... [SEP]): each query attends by the
    similarity of made-up token vectors, with no mask."""
    tok = TextTokenizer.train_byte_level_bpe(list(trophy.SENTENCES.values()), vocab_size=300)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((tok.vocab_size + 2, 8))

    cls_id, sep_id = tok.vocab_size, tok.vocab_size + 1

    def tokenize(text):
        ids = tok.encode(text)
        return np.concatenate([[cls_id], ids, [sep_id]]), ["[CLS]"] + tok.labels(ids) + ["[SEP]"]

    def attentions(ids, scale):
        x = emb[ids]  # [T, 8]
        logits = x @ x.T * (1 / np.sqrt(8) if scale is None else scale)  # [T, T]
        w = np.exp(logits - logits.max(-1, keepdims=True))
        return (w / w.sum(-1, keepdims=True))[None, None]  # [1, 1, T, T]

    return trophy.LabModel("toy", causal=False, tokenize=tokenize, attentions=attentions)


def test_bidirectional_model_it_row_may_change():
    c = trophy.compare(_toy_bidirectional())
    labels = c.maps["big"].labels
    assert labels[0] == "[CLS]" and labels[-1] == "[SEP]"
    assert c.it_row_max_abs_diff.max() > 0.0
    assert c.log_probs is None
    assert np.abs(c.flip["it"]).max() > 0.0
    text = trophy.render_part4(c)
    assert "bidirectional" in text and "row of the it token" in text
    with pytest.raises(ValueError, match="not causal: padding would change"):
        trophy.sentence_maps(_toy_bidirectional(), trophy.SENTENCES["big"], run_length=40)


def test_sentence_maps_refuses_maps_of_another_shape_and_compare_refuses_one_sentence_twice():
    base = _toy_bidirectional()
    for shape in ("wide", "flat"):  # maps wider than the ids (cropping would hide it), or [N, T, T]
        def attentions(ids, scale, shape=shape):
            a = base.attentions(ids, scale)  # [1, 1, T, T]
            return np.pad(a, ((0, 0), (0, 0), (0, 2), (0, 2))) if shape == "wide" else a[0]

        model = trophy.LabModel("odd", causal=False, tokenize=base.tokenize, attentions=attentions)
        with pytest.raises(ValueError, match=r"odd: attentions must have shape \[L, N, T, T\] with T=\d+ \(the ids "
                                             r"it was given\), received \("):
            trophy.sentence_maps(model, trophy.SENTENCES["big"])
    with pytest.raises(ValueError, match="the 'big' and 'small' sentences tokenize to the same ids"):
        trophy.compare(base, {"big": trophy.SENTENCES["big"], "small": trophy.SENTENCES["big"]})


def test_render_ascii_numbers_columns_past_nine_downwards():
    S = 14
    text = trophy.render_ascii(np.full((S, S), 1 / S), [f"t{i}" for i in range(S)])
    tens, units = text.splitlines()[:2]
    start = units.index("0") - 1  # each column is a 2-character cell, its digit on the right
    for j in range(S):
        cell = slice(start + 2 * j, start + 2 * j + 2)
        assert (tens[cell] + units[cell]).replace(" ", "") == str(j)
    assert units[start:].startswith(" 0 1 2 3 4 5 6 7 8 9 0 1 2 3") and tens[start:] == " " * 20 + " 1" * 4
    wide = trophy.render_ascii(np.full((1, 101), 1 / 101), ["x"]).splitlines()
    assert wide[0].endswith(" 1") and wide[1].endswith(" 0") and wide[2].endswith(" 0")  # column 100, three lines
    with pytest.raises(ValueError, match=r"labels must have one entry per query row \(T=2\), received 1"):
        trophy.render_ascii(np.zeros((2, 2)), ["a"])
    with pytest.raises(ValueError, match=r"^weights must be finite \(a weight in \[0, 1\] per cell\), received nan at "
                                         r"row 1, column 0$"):
        trophy.render_ascii(np.array([[1.0, 0.0], [np.nan, 0.5]]), ["a", "b"])
    rows = trophy.render_ascii(np.full((101, 2), 0.5), [f"t{i}" for i in range(101)]).splitlines()
    cells = {line.index("'  ") + 3 for line in rows[1:-1]}  # rows 0 .. 100: the cells start in one column
    assert len(cells) == 1 and rows[0].index("0") == cells.pop() + 1  # column 0's digit on its cell's right


def test_render_ascii_closed_form():
    w = np.array([[1.0, 0.0], [0.55, 0.45]])
    text = trophy.render_ascii(w, ["a", "bb"], title="t")
    assert text.splitlines()[:4] == [
        "t",
        "          0 1",
        " 0  'a'  @@ ·",
        " 1 'bb'  ++==",
    ]


def test_renderers_and_json(tiny, comparison):
    maps = comparison.maps["big"]
    layer, head = trophy.focus_head(maps, "it", ["trophy", "suitcase"])
    text = trophy.render_part3(maps, layer, head)
    assert f"layer {layer}, head {head}" in text and "' suitcase'" in text and "averaged over its 4 heads" in text
    with pytest.raises(ValueError, match=r"layer/head must lie in \[0, 2\) x \[0, 4\), received \(2, 0\)"):
        trophy.render_part3(maps, 2, 0)
    part4 = trophy.render_part4(comparison)
    assert "bit-identical (exactly 0)" in part4 and "causal mask" in part4
    assert trophy.png_grid(maps).startswith(b"\x89PNG\r\n\x1a\n")
    assert trophy.png_pair(comparison, layer, head).startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match=r"layer/head must lie in \[0, 2\) x \[0, 4\), received \(0, 4\)"):
        trophy.png_pair(comparison, 0, 4)
    data = json.loads(json.dumps(comparison.to_json()))
    assert data["it_row_max_abs_diff"] == [[0.0] * 4] * 2


def test_word_span():
    labels = ["The", " suit", "case", " it", " was", " it"]
    assert trophy.word_span(labels, "suitcase") == (1, 3)
    assert trophy.word_span(labels, "it") == (3, 4)
    assert trophy.word_span(labels, "it", after=4) == (5, 6)
    with pytest.raises(ValueError, match=r"word 'trophy' not found among the tokens"):
        trophy.word_span(labels, "trophy")


def test_experiment_script_on_a_local_checkpoint_runs_past_an_unusable_cache_folder(tiny, comparison, tmp_path, capsys,
                                                                                  monkeypatch):
    import runpy

    from jaxattn import io as jio

    _, (params, config, tokenizer), _ = tiny
    directory = gpt2.save(tmp_path / "ckpt", params, config, tokenizer)
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "jaxattn").write_text("a file where the cache folder goes")  # the cache cannot be used
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(jio.NO_CACHE_VARIABLE, raising=False)
    main = runpy.run_path("experiments/trophy.py")["main"]
    with pytest.warns(RuntimeWarning, match=r"compiled programs are not kept across runs") as warned:
        assert main(["--model", str(directory), "--out", str(tmp_path / "out")]) == 0
    assert len(warned) == 1  # one warning, and the run goes on
    captured = capsys.readouterr()
    out = captured.out
    assert "== Part 3" in out and "== Part 4" in out and "bit-identical" in out
    data = json.loads((tmp_path / "out" / "trophy.json").read_text())
    assert data["part4"]["it_row_identical"] is True
    for name in ("trophy_small.png", "trophy_difference.png", "trophy_focus.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(b"\x89PNG")
    # progress on stderr: every step that runs a model or draws a picture says so
    for what in ("loading ", "part 3: every attention map", "part 4: model runs [", "drawing trophy_big.png (2 x 4 maps)"):
        assert what in captured.err, what
    # the page holds both sentences' maps, and their difference view
    page = viz.page_data((tmp_path / "out" / "trophy.html").read_text(encoding="utf-8"))
    c = comparison
    assert page["difference"] is True and [r["name"] for r in page["runs"]] == list(trophy.PAIR_NAMES)
    for run, key in zip(page["runs"], ("big", "small")):
        assert run["keys"] == c.maps[key].labels and run["causal"] is True
        np.testing.assert_allclose(run["weights"], c.maps[key].attentions, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# experiments/trophy.py: --model, and the bundled encoder when GPT-2 cannot be reached.
# ----------------------------------------------------------------------------------------------------

FALLBACK_LINE = ("GPT-2 unavailable (offline, not cached): running parts 3-4 on the bundled SmolLM2-135M-Instruct "
                 "(Q4_1) (causal), with all-MiniLM-L6-v2 beside it; pass --model to choose")


@pytest.fixture(scope="module")
def script_main():
    import runpy

    return runpy.run_path("experiments/trophy.py")["main"]


@pytest.mark.slow
def test_experiment_falls_back_to_the_bundled_smollm2_in_one_line_with_the_encoder_beside_it(
        offline_hub, script_main, tmp_path, capsys):
    assert script_main(["--out", str(tmp_path / "out"), "--no-cache"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == FALLBACK_LINE
    assert sum("GPT-2" in line for line in lines) == 1  # said once, nothing else about GPT-2
    assert lines[1].startswith("model: SmolLM2-135M-Instruct (Q4_1) (bundled Llama-family LM, causal): 30 layers x "
                               "9 query heads (3 key/value heads)")
    assert "== Part 3" in captured.out and "== Part 4" in captured.out
    assert "over all 270 heads: max = 0  -> bit-identical (exactly 0)" in captured.out  # trained weights, causal
    assert "its verdict by substitution (Trinh & Le 2018)" in captured.out
    assert "== The ' it' row, causal beside bidirectional: SmolLM2-135M-Instruct (Q4_1) | all-MiniLM-L6-v2" in captured.out
    data = json.loads((tmp_path / "out" / "trophy.json").read_text())
    assert data["model"] == "SmolLM2-135M-Instruct (Q4_1)" and data["part4"]["causal"] is True
    assert data["part4"]["it_row_identical"] is True
    for k in ("big", "small"):
        assert set(data["part4"]["substitution"][k]) == {"trophy", "suitcase"}
        assert all(v < 0 for v in data["part4"]["substitution"][k].values())
    assert data["contrast"]["model"] == "all-MiniLM-L6-v2" and data["contrast"]["it_row_identical"] is False
    page = viz.page_data((tmp_path / "out" / "trophy.html").read_text(encoding="utf-8"))
    assert [r["causal"] for r in page["runs"]] == [True, True]


@pytest.mark.slow  # the whole experiment on the real encoder; make test runs it on a tiny local checkpoint
def test_experiment_on_the_bundled_encoder(script_main, tmp_path, capsys):
    assert script_main(["--model", "minilm", "--out", str(tmp_path / "out"), "--no-cache"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("model: all-MiniLM-L6-v2 (bundled BERT encoder, bidirectional): 6 layers x 12 heads")
    assert "== Part 3" in captured.out and "== Part 4" in captured.out and "no language-model head" in captured.out
    data = json.loads((tmp_path / "out" / "trophy.json").read_text())
    assert data["model"] == "all-MiniLM-L6-v2" and data["part4"]["causal"] is False
    assert data["part4"]["it_row_identical"] is False and data["part4"]["log_probs"] is None
    assert data["part4"]["substitution"] is None and "contrast" not in data
    assert (tmp_path / "out" / "trophy_big.png").read_bytes().startswith(b"\x89PNG")
    page = viz.page_data((tmp_path / "out" / "trophy.html").read_text(encoding="utf-8"))
    assert [r["causal"] for r in page["runs"]] == [False, False]  # bidirectional: every key visible


@pytest.mark.parametrize(
    "model, message",
    [
        ("gpt2", "cannot fetch 'gpt2' from the Hugging Face hub and it is not in the local cache"),
        ("./no/such/dir", r"./no/such/dir: no such directory"),
    ],
)
def test_explicit_model_that_cannot_load_fails_without_substitution(offline_hub, script_main, tmp_path, capsys,
                                                                    model, message):
    assert script_main(["--model", model, "--out", str(tmp_path / "out"), "--no-cache"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no fallback line, no part 3
    step, error = captured.err.split("\n", 1)
    assert step.startswith(f"loading {model} ... failed after ")  # the progress line, then the error
    assert error.startswith("error: ") and message in error and "--model smollm2 or --model minilm" in error
    assert not (tmp_path / "out").exists()


def test_default_gpt2_that_is_broken_is_an_error_not_a_fallback(script_main, tmp_path, capsys, monkeypatch):
    """Only an unreachable hub switches to the encoder; a GPT-2 that is there but broken fails loudly."""
    broken = tmp_path / "gpt2"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    monkeypatch.setitem(script_main.__globals__, "DEFAULT_GPT2", str(broken))
    assert script_main(["--out", str(tmp_path / "out"), "--no-cache"]) == 2
    captured = capsys.readouterr()
    assert "GPT-2 unavailable" not in captured.out
    assert captured.err.split("\n", 1)[1].startswith(f"error: {broken}: ")


def test_script_removes_an_earlier_runs_difference_maps_when_the_sentences_differ_in_length(
        tiny, script_main, tmp_path, capsys, monkeypatch):
    _, (params, config, tokenizer), _ = tiny
    directory = gpt2.save(tmp_path / "ckpt", params, config, tokenizer)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("trophy_difference.png", "trophy_focus.png"):  # an earlier run's, of other sentences
        (out / name).write_bytes(b"\x89PNG old")
    small = trophy.SENTENCES["small"].replace("too small", "far too small")
    assert len(tokenizer.encode(small)) != len(tokenizer.encode(trophy.SENTENCES["big"]))
    monkeypatch.setitem(trophy.SENTENCES, "small", small)
    assert script_main(["--model", str(directory), "--out", str(out), "--no-cache"]) == 0
    printed = capsys.readouterr().out
    assert "no difference maps: the two sentences have different token counts (removed an earlier run's " \
           "trophy_difference.png, trophy_focus.png)" in printed
    assert not (out / "trophy_difference.png").exists() and not (out / "trophy_focus.png").exists()
    assert (out / "trophy_small.png").read_bytes().startswith(b"\x89PNG\r\n")
