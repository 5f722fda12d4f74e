"""WSC273 as published: the committed WSCollection.xml, its converter, the shipped JSON and load_wsc273()."""

import hashlib
import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from jaxattn import interventions

ROOT = Path(__file__).resolve().parents[1]
XML = ROOT / "data" / "WSCollection.xml"
SHIPPED = resources.files("jaxattn").joinpath("data", "wsc273.json")


def _converter():
    spec = importlib.util.spec_from_file_location("convert_wsc273", ROOT / "tools" / "convert_wsc273.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _converter()


@pytest.fixture(scope="module")
def converted():
    return convert.convert(XML)


@pytest.fixture(scope="module")
def xml_schemas():
    """The collection's <schema> elements, read here with ElementTree alone."""
    return ET.parse(XML).getroot().findall("schema")


def _plain(text):
    """A text without brackets and whitespace (to compare wording and order, not spacing)."""
    return re.sub(r"\s+", "", text.replace("[", "").replace("]", ""))


def _xml_text(schema):
    t = schema.find("text")
    return "".join((t.findtext(k) or "") for k in ("txt1", "pron", "txt2"))


def test_the_committed_xml_is_wsc285_and_its_notice_cites_it(xml_schemas):
    assert len(xml_schemas) == 285  # WSC285: WSC273 and 12 problems added later
    notice = (ROOT / "data" / "README.md").read_text(encoding="utf-8")
    assert "CC BY 4.0" in notice and "Levesque" in notice and "Davis" in notice and "Morgenstern" in notice
    assert hashlib.sha256(XML.read_bytes()).hexdigest() in notice


def test_converter_gives_the_first_273_problems_in_the_collections_order(converted, xml_schemas):
    problems = converted["problems"]
    assert len(problems) == 273 and [p["index"] for p in problems] == list(range(273))
    assert [_plain(p["text"]) for p in problems] == [re.sub(r"\s+", "", _xml_text(s)) for s in xml_schemas[:273]]
    later = {re.sub(r"\s+", "", _xml_text(s)) for s in xml_schemas[273:]}
    assert not later & {_plain(p["text"]) for p in problems}  # nothing of WSC285's additions
    assert converted["xml"] == {"file": "WSCollection.xml", "sha256": hashlib.sha256(XML.read_bytes()).hexdigest(),
                                "problems_in_file": 285}


def test_answers_and_candidates_are_the_collections(converted, xml_schemas):
    raw = [" ".join(s.findtext("correctAnswer").split()) for s in xml_schemas[:273]]
    assert {"A", "B", "A.", "B."} <= set(raw)  # both spellings occur: the period is dropped
    assert [p["answer"] for p in converted["problems"]] == [{"A": 0, "A.": 0, "B": 1, "B.": 1}[r] for r in raw]
    for p, s in zip(converted["problems"], xml_schemas):
        assert p["candidates"] == [" ".join(a.text.split()) for a in s.find("answers").findall("answer")]
        assert p["pronoun"] == " ".join(s.find("text").findtext("pron").split())
        assert p["source"] == " ".join(s.findtext("source").split())


def test_every_text_marks_its_pronoun_once(converted):
    for p in converted["problems"]:
        text = p["text"]
        assert text.count("[") == 1 and text.count("]") == 1, text
        assert text[text.index("[") + 1:text.index("]")] == p["pronoun"]


def test_schemas_pairs_one_triple_and_two_whose_candidates_change(converted):
    groups = {}
    for p in converted["problems"]:
        groups.setdefault(p["schema"], []).append(p)
    assert sorted(groups) == list(range(136))
    sizes = sorted(len(g) for g in groups.values())
    assert sizes == [2] * 135 + [3]
    triple = next(g for g in groups.values() if len(g) == 3)
    assert [p["index"] for p in triple] == [252, 253, 254] and [p["answer"] for p in triple] == [0, 1, 0]
    assert all(p["text"].startswith("George got free tickets to the play") for p in triple)
    changing = [[p["index"] for p in g] for g in groups.values() if len({tuple(p["candidates"]) for p in g}) > 1]
    assert changing == [[172, 173], [265, 266]]  # a minnow / a shark below a duck; a butterfly wing / a heavy book
    assert all({p["answer"] for p in g} == {0, 1} for g in groups.values())


def test_mentions_and_substitutes_name_the_candidates(converted):
    for problem in interventions.parse_wsc273(converted):
        s = problem.to_schema()
        for j in range(2):
            assert s.span_text(s.candidates[j]) == problem.mentions[j][0]
            assert s.substitutions[j] == (s.text[:s.pronoun[0]] + s.substitutions[j][s.pronoun[0]:s.substitute_ends[j]]
                                          + s.text[s.pronoun[1]:])
        if problem.pronoun.lower() in ("his", "her"):  # every "her" of WSC273 is possessive
            assert all(x.endswith("'s") for x in problem.substitutes)
        else:
            assert [x.lower() for x in problem.substitutes] == [c.lower() for c in problem.candidates]
    stretch = interventions.parse_wsc273(converted)[232].to_schema()  # the candidates follow the pronoun
    assert stretch.pronoun[1] <= min(stretch.candidates)[0]
    for index in (88, 89):  # "by the mouse hole waiting for the mouse": the animal, not the hole's modifier
        s = interventions.parse_wsc273(converted)[index].to_schema()
        assert s.text[:s.candidates[1][1]].endswith("waiting for the mouse"), s.text[:s.candidates[1][1]]


def test_a_damaged_bundled_file_is_refused_with_what_to_do(tmp_path, monkeypatch):
    from jaxattn import winograd

    (tmp_path / "data").mkdir()
    shipped = SHIPPED.read_text(encoding="utf-8")
    monkeypatch.setattr(winograd.resources, "files", lambda package: tmp_path)
    (tmp_path / "data" / "wsc273.json").write_text(shipped[:50_000], encoding="utf-8")  # cut mid-file
    with pytest.raises(ValueError, match=r"wsc273\.json: not a Winograd data file: not UTF-8 JSON .*reinstall jaxattn"):
        interventions.load_wsc273()
    data = json.loads(shipped)
    data["problems"] = data["problems"][:100]  # whole problems, but not all of them
    (tmp_path / "data" / "wsc273.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match=r"the bundled wsc273\.json holds 100 problems in 50 schemas, not WSC273's 273 "
                                         r"in 136"):
        interventions.load_wsc273()


def test_the_shipped_json_is_the_converters_output(tmp_path):
    out = tmp_path / "wsc273.json"
    assert convert.main([str(XML), str(out)]) == 0
    assert out.read_text(encoding="utf-8") == SHIPPED.read_text(encoding="utf-8")
    assert interventions.load_wsc273(out) == interventions.load_wsc273()


def test_load_wsc273_returns_the_problems_as_records(converted):
    problems = interventions.load_wsc273()
    assert len(problems) == 273 and all(isinstance(p, interventions.Problem) for p in problems)
    for p, raw in zip(problems, converted["problems"]):
        assert (p.index, p.schema, p.text, p.pronoun, p.answer, p.source) == (
            raw["index"], raw["schema"], raw["text"], raw["pronoun"], raw["answer"], raw["source"])
        assert p.candidates == tuple(raw["candidates"]) and p.substitutes == tuple(raw["substitutes"])
        assert p.mentions == tuple(tuple(m) for m in raw["mentions"])
    trophy = problems[2]
    assert trophy.text == "The trophy doesn't fit into the brown suitcase because [it] is too large."
    assert trophy.candidates == ("the trophy", "the suitcase") and trophy.answer == 0
    meta = interventions.load_metadata()
    assert meta["name"] == "WSC273" and "Levesque" in meta["source"] and "CC BY 4.0" in meta["license"]


def test_load_pairs_pairs_each_schemas_sentences_with_different_answers():
    problems = interventions.load_wsc273()
    pairs = interventions.load_pairs()
    assert len(pairs) == 136 and [(a.pair, b.pair) for a, b in pairs] == [(i, i) for i in range(136)]
    by_text = {(p.to_schema().text, p.to_schema().pronoun): p for p in problems}
    used = [by_text[(s.text, s.pronoun)].index for pair in pairs for s in pair]
    assert len(used) == len(set(used)) == 272
    assert set(range(273)) - set(used) == {254}  # the triple gives its first two sentences
    for a, b in pairs:
        assert {a.answer, b.answer} == {0, 1}
        assert by_text[(a.text, a.pronoun)].schema == by_text[(b.text, b.pronoun)].schema


def test_evaluate_sentences_groups_by_schema():
    problems = interventions.load_wsc273()
    schemas = interventions.to_schemas(problems)
    right = {s.substitutions[s.answer] for s in schemas}

    def score(context, continuation):  # knows the answers
        return 0.0 if context + continuation in right else -1.0

    def maps(text):  # words as tokens; head (1, 2) attends from the pronoun to the right candidate
        spans, at = [], 0
        for w in text.split(" "):
            spans.append((at, at + len(w)))
            at += len(w) + 1
        offsets = np.asarray(spans)
        s = next(x for x in schemas if x.text == text)
        p = interventions.char_span_to_tokens(offsets, *s.pronoun)[0]
        att = np.full((2, 3, len(spans), len(spans)), 0.01)
        for c, span in enumerate(s.candidates):
            a, b = interventions.char_span_to_tokens(offsets, *span)
            att[:, :, p, a:b] = 0.02 if c != s.answer else 0.01
            att[1, 2, p, a:b] = 0.9 if c == s.answer else 0.0
        return att, offsets

    few = [s for s in schemas if s.pair < 10]
    result = interventions.evaluate_sentences(few, score=score, maps=maps)
    assert (result["sentences"], result["groups"]) == (20, 10)
    for key in ("substitution_full", "substitution_partial", "max_attention", "best_head"):
        assert result[key]["accuracy"] == 1.0, key
    assert all(f["head"] == (1, 2) for f in result["best_head"]["folds"])
    assert sorted(f["total"] % 2 for f in result["best_head"]["folds"]) == [0, 0]  # whole schemas on each side

    expected = 0
    for g in range(136):
        prefixes = {p.text[:p.text.index("]")] for p in problems if p.schema == g}
        expected += len(prefixes) == 1
    assert interventions.evaluate_sentences(schemas)["special_after_pronoun"] == expected


def test_bad_wsc273_data_names_the_problem_and_field(converted, tmp_path):
    good = json.loads(json.dumps(converted))
    bad = json.loads(json.dumps(good))
    bad["problems"][5]["text"] = bad["problems"][5]["text"].replace("[", "")
    with pytest.raises(ValueError, match="problem 5: the text must mark the pronoun"):
        interventions.parse_wsc273(bad)
    bad = json.loads(json.dumps(good))
    bad["problems"][7]["answer"] = 2
    with pytest.raises(ValueError, match="problem 7: 'answer' must be 0 or 1"):
        interventions.parse_wsc273(bad)
    bad = json.loads(json.dumps(good))
    bad["problems"][9]["mentions"][1] = ["nowhere", 0]
    with pytest.raises(ValueError, match=r"problem 9: 'mentions'\[1\] 'nowhere'"):
        interventions.parse_wsc273(bad)
    bad = json.loads(json.dumps(good))
    bad["problems"][3]["pronoun"] = "she"
    with pytest.raises(ValueError, match="problem 3: 'pronoun' must be the marked word"):
        interventions.parse_wsc273(bad)
    short = tmp_path / "short.xml"
    root = ET.parse(XML).getroot()
    for s in root.findall("schema")[10:]:
        root.remove(s)
    ET.ElementTree(root).write(short)
    with pytest.raises(convert.ConversionError, match="at least 273 problems, found 10"):
        convert.convert(short)
