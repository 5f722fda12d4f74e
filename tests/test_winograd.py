"""The Winograd data and scorers: a hand-made two-pair set with known answers, and the bundled WSC273 pairs."""

import numpy as np
import pytest

from jaxattn import bert, gpt2, interventions
from jaxattn.checkpoint import TextTokenizer

# Two schemas written here; the answers are known: big -> trophy, small -> suitcase; feared -> councilmen,
# advocated -> demonstrators.
HAND = {
    "pairs": [
        {"texts": ["The trophy didn't fit in the suitcase because [it] was too big.",
                   "The trophy didn't fit in the suitcase because [it] was too small."],
         "candidates": ["trophy", "suitcase"], "substitutes": ["the trophy", "the suitcase"], "answers": [0, 1]},
        {"texts": ["The councilmen refused the demonstrators a permit because [they] advocated violence.",
                   "The councilmen refused the demonstrators a permit because [they] feared violence."],
         "candidates": ["councilmen", "demonstrators"], "substitutes": ["the councilmen", "the demonstrators"],
         "answers": [1, 0]},
    ]
}

# What a language model that knows the answers would find likely, written out by hand.
RIGHT_SENTENCES = {
    "The trophy didn't fit in the suitcase because the trophy was too big.",
    "The trophy didn't fit in the suitcase because the suitcase was too small.",
    "The councilmen refused the demonstrators a permit because the demonstrators advocated violence.",
    "The councilmen refused the demonstrators a permit because the councilmen feared violence.",
}


def words(text):
    """A whitespace tokenizer with offsets (the test's own): ids are word indices."""
    spans, at = [], 0
    for w in text.split(" "):
        spans.append((at, at + len(w)))
        at += len(w) + 1
    return np.arange(len(spans)), np.asarray(spans)


def test_hand_made_pairs_parse_to_known_spans_and_substitutions():
    pairs = interventions.parse_pairs(HAND)
    trophy = pairs[0][0]
    assert trophy.span_text(trophy.pronoun) == "it"
    assert [trophy.span_text(c) for c in trophy.candidates] == ["trophy", "suitcase"]
    assert trophy.substitutions == ("The trophy didn't fit in the suitcase because the trophy was too big.",
                                    "The trophy didn't fit in the suitcase because the suitcase was too big.")
    assert trophy.substitutions[1][: trophy.substitute_ends[1]].endswith("the suitcase")
    assert [s.answer for s in interventions.flatten_pairs(pairs)] == [0, 1, 1, 0]


def test_substitution_scorer_gets_the_hand_made_pairs_right():
    schemas = interventions.flatten_pairs(interventions.parse_pairs(HAND))
    answers = np.array([s.answer for s in schemas])

    def score(context, continuation):  # a scorer that knows the answers, by the whole sentence
        return 0.0 if context + continuation in RIGHT_SENTENCES else -5.0

    scores = interventions.substitution_scores(schemas, score)
    np.testing.assert_array_equal(scores["full"].argmax(1), answers)
    np.testing.assert_array_equal(scores["partial"].argmax(1), answers)

    def partial_only(context, continuation):  # knows only which candidate the words after it follow
        right = {"the trophy": " was too big.", "the suitcase": " was too small.",
                 "the demonstrators": " advocated violence.", "the councilmen": " feared violence."}
        return 0.0 if any(context.endswith(c) and continuation == r for c, r in right.items()) else -5.0

    np.testing.assert_array_equal(interventions.substitution_scores(schemas, partial_only)["partial"].argmax(1), answers)


def test_attention_scorers_get_the_hand_made_pairs_right():
    schemas = interventions.flatten_pairs(interventions.parse_pairs(HAND))
    answers = np.array([s.answer for s in schemas])

    def maps(text):  # head (1, 2) attends from the pronoun to the right candidate; the others, weakly, wrong
        ids, offsets = words(text)
        s = next(x for x in schemas if x.text == text)
        p = int(np.flatnonzero(offsets[:, 0] == s.pronoun[0])[0])
        cand = [int(np.flatnonzero(offsets[:, 0] == c[0])[0]) for c in s.candidates]
        att = np.full((2, 3, len(ids), len(ids)), 0.01)
        att[:, :, p, cand[1 - s.answer]] = 0.1
        att[1, 2, p, cand[s.answer]] = 0.9
        return att, offsets

    attention = interventions.pronoun_attention(schemas, maps)
    assert attention.shape == (4, 2, 3, 2)
    np.testing.assert_array_equal(interventions.max_attention_predictions(attention), answers)
    folds = interventions.best_head(attention, answers, [s.pair for s in schemas])
    for fold in folds:
        assert fold["head"] == (1, 2) and fold["select_accuracy"] == 1.0
        assert (fold["correct"], fold["total"]) == (2, 2)
    result = interventions.accuracy(interventions.max_attention_predictions(attention) == answers)
    assert result["accuracy"] == 1.0 and result["low"] == pytest.approx(0.5101, abs=1e-4)


@pytest.mark.slow
def test_lm_scorer_and_maps_on_a_small_gpt2():
    schemas = interventions.flatten_pairs(interventions.parse_pairs(HAND))
    texts = [x for s in schemas for x in (s.text, *s.substitutions)]
    params, config, tok = gpt2.random_model("tiny", texts=texts)
    score = interventions.lm_scorer(gpt2, params, config, tok)
    s = schemas[0]
    ids = tok.encode(s.substitutions[0])
    cut = len(tok.encode(s.substitutions[0][: s.substitute_ends[0]]))  # the candidate ends a word: same tokens
    assert score("", s.substitutions[0]) == pytest.approx(float(gpt2.log_prob(params, config, ids, start=1)), abs=1e-4)
    assert score(s.substitutions[0][: s.substitute_ends[0]], s.substitutions[0][s.substitute_ends[0]:]) == pytest.approx(
        float(gpt2.log_prob(params, config, ids, start=cut)), abs=1e-4)
    att, offsets = interventions.model_maps(gpt2, params, config, tok)(s.substitutions[0])  # the same program
    np.testing.assert_allclose(att, gpt2.forward(params, config, ids).attentions, atol=1e-5)
    assert offsets.shape == (len(ids), 2)


def test_offsets_spans_and_special_tokens():
    tok = TextTokenizer.from_file(bert.bundled_model_dir() / "tokenizer.json")
    text = "The trophy didn't fit in the suitcase."
    ids, offsets = interventions.encode_with_offsets(tok, text)
    assert tok.labels(ids[:1]) == ["[CLS]"] and offsets[0, 0] == offsets[0, 1]  # an added token: empty span
    a, b = interventions.char_span_to_tokens(offsets, *interventions.find_span(text, "suitcase"))
    assert "".join(tok.labels(ids[a:b])).replace("##", "") == "suitcase"

    class Plain:  # a tokenizer with only encode and decode: offsets from decoded prefixes
        backend = None

        def __init__(self, t):
            self.t = t

        def encode(self, text):
            return self.t.encode(text)

        def decode(self, ids):
            return self.t.decode(ids)

    _, _, gtok = gpt2.random_model("tiny")
    ids, offsets = interventions.encode_with_offsets(Plain(gtok), text)
    ids2, offsets2 = interventions.encode_with_offsets(gtok, text)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(offsets[:, 1], offsets2[:, 1])
    assert interventions.find_span("a cat, the cat", "cat", occurrence=1) == (11, 14)
    with pytest.raises(ValueError, match="not found"):
        interventions.find_span("the scatter", "cat")
    with pytest.raises(ValueError, match="no token overlaps"):
        interventions.char_span_to_tokens(np.array([[0, 3], [3, 3]]), 5, 6)


def test_the_bundled_wsc273_pairs():
    pairs = interventions.load_pairs()
    assert len(pairs) == 136  # one per WSC273 schema (tests/test_wsc273.py checks the data itself)
    meta = interventions.load_metadata()
    assert "Levesque" in meta["source"] and "CC BY 4.0" in meta["license"]
    after = 0
    for a, b in pairs:
        assert {a.answer, b.answer} == {0, 1} and a.pair == b.pair
        for s in (a, b):
            before = [c[1] <= s.pronoun[0] for c in s.candidates]
            assert all(before) or not any(before)
            after += not any(before)  # "Stretching [her] back, the woman smiled at the girl."
            assert s.text[s.pronoun[0]:s.pronoun[1]].lower() in {"it", "he", "she", "they", "them", "him", "her", "his"}
    assert after == 2
    # A sentence is in one pair at most; two problems share a sentence and mark different pronouns in it.
    sentences = [(s.text, s.pronoun) for s in interventions.flatten_pairs(pairs)]
    assert len(set(sentences)) == len(sentences)


def test_bad_data_names_the_pair_and_field():
    bad = {"pairs": [dict(HAND["pairs"][0], texts=["no pronoun marked here.", HAND["pairs"][0]["texts"][1]])]}
    with pytest.raises(ValueError, match="pair 0: the text must mark the pronoun"):
        interventions.parse_pairs(bad)
    bad = {"pairs": [dict(HAND["pairs"][0], answers=[0, 0])]}
    with pytest.raises(ValueError, match="pair 0: the two sentences must have different answers"):
        interventions.parse_pairs(bad)
    bad = {"pairs": [dict(HAND["pairs"][0], candidates=["trophy", "box"])]}
    with pytest.raises(ValueError, match="'box'"):
        interventions.parse_pairs(bad)
    with pytest.raises(ValueError, match="attention must have shape"):
        interventions.max_attention_predictions(np.zeros((4, 2, 3)))


def test_best_head_splits_the_pairs_present_whatever_their_ids():
    """A subset of pairs whose ids do not start at 0 splits into halves of its own pairs (it split
    range(max id + 1), so most subsets of late pairs were refused or unbalanced)."""
    rng = np.random.default_rng(0)
    attention, answers = rng.random((40, 2, 3, 2)), np.tile([0, 1], 20)
    late = np.repeat(np.arange(100, 120), 2)  # 20 pairs, ids 100..119
    folds = interventions.best_head(attention, answers, late)
    assert [f["total"] for f in folds] == [20, 20]  # 10 pairs a side
    assert folds == interventions.best_head(attention, answers, late - 100)  # the same split as ids 0..19
    two = interventions.best_head(attention[:4], answers[:4], [126, 126, 127, 127])
    assert [f["total"] for f in two] == [2, 2]
