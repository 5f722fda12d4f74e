"""Convert the published Winograd Schema collection (WSCollection.xml) into jaxattn's WSC273 data.

    python tools/convert_wsc273.py data/WSCollection.xml jaxattn/data/wsc273.json

WSC273 is the first 273 problems of the collection (136 schemas) that Ernest Davis publishes at
https://cs.nyu.edu/~davise/papers/WinogradSchemas/WS.html (Levesque, Davis & Morgenstern 2012; CC BY 4.0).
The file holds 285 problems; the last 12 (WSC285's additions) are left out. Standard library only; no
network. The output is deterministic (the same XML gives the same bytes).

What comes from the collection, for each problem, in the collection's order:

- ``text``: ``<txt1> <pron> <txt2>`` with runs of whitespace collapsed to one space, the pronoun marked
  with ``[brackets]``; no space before ``<txt2>`` when it starts with punctuation (``kill [them].``).
  Wording, spelling and punctuation are the collection's (``recieved`` included);
- ``pronoun``: ``<pron>``; ``candidates``: the two ``<answer>`` phrases; ``answer``: 0 or 1 from
  ``<correctAnswer>`` (``A``/``B``, with or without a period); ``source``: ``<source>`` (who wrote it).

What this script derives (the collection does not give it):

- ``schema``: the schema's index. The collection lists each schema's sentences one after the other:
  problems 0-251 and 255-272 are consecutive pairs, 252-254 the one three-sentence schema (George's
  tickets). Every schema is checked to have both answers and sentences that differ in a few words;
- ``mentions``: where each candidate occurs in the text, as ``[phrase, k]`` (the k-th whole-word
  occurrence of ``phrase``, counted from the start of the text without brackets): the candidate without
  a leading the/a/an, first before the pronoun, else after it (two problems name the candidates after
  the pronoun: "Stretching her back, the woman smiled at the girl"); the candidates whose wording differs
  from the sentence's are in ``MENTIONS`` below, with the occurrence pinned where an earlier one names
  something else ("the mouse hole waiting for the mouse");
- ``substitutes``: what replaces the pronoun in the substitution form of Trinh & Le (2018): the
  candidate with a leading The/A/An lowercased, plus ``'s`` after a possessive pronoun (his, her: every
  "her" of WSC273 is possessive); a loader capitalises it where the pronoun starts a sentence.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

N_PROBLEMS = 273  # WSC273: the collection's first 273 problems
N_SCHEMAS = 136
THREE_SENTENCE_SCHEMA = (252, 253, 254)  # the problems of the one schema with three sentences
MAX_WORDS_CHANGED = 3  # the sentences of one schema differ in at most this many words (checked)

# Candidates whose phrase in the collection's answers is not how the sentence names them:
# answer phrase -> the words of the sentence that name it.
MENTIONS = {
    "Tina's drawing": "Tina's",
    "The younger students": "the younger ones",
    "Anne's daughter": "daughter",
    "Alice's daughter": "daughter",
    "the guy in uniform": "guy in a military uniform",
    "The teller": "tellers",
    "The juggler": "man",
    "The old house": "house",
    "The new house": "new one",
    "The piece": "pieces",
    "Mary's daughter": "daughter",
    "Kamchatka": "Kamtchatka",  # the sentence spells it with a t
    "Prehistoric humans": "humans",
    "copies of the newsletter": "copies of our newsletter",
    "Pam and Paul": "her having sex with her boyfriend, Paul",
    # The other candidate is the first word ("Joe", "Emma"): the two mentions must not overlap.
    "Joe's uncle": "uncle",
    "Emma's mother": "mother",
    # (phrase, k): the k-th occurrence, where an earlier one names something else ("the mouse hole")
    "The mouse": ("mouse", 1),
}

POSSESSIVE = {"his", "her", "its", "their"}
DETERMINERS = ("the ", "a ", "an ")

NAME = "WSC273"
SOURCE = ("Levesque, H. J., Davis, E., & Morgenstern, L. (2012). The Winograd Schema Challenge. Proceedings of "
          "the 13th International Conference on Principles of Knowledge Representation and Reasoning (KR 2012). "
          "The collection as Ernest Davis publishes it at https://cs.nyu.edu/~davise/papers/WinogradSchemas/WS.html "
          "(WSCollection.xml); WSC273 is its first 273 problems. Each problem's 'source' names its author.")
LICENSE = ("CC BY 4.0 (Creative Commons Attribution 4.0 International, https://creativecommons.org/licenses/by/4.0/), "
           "as the collection is published. Changed: whitespace collapsed, the pronoun marked, and 'schema', "
           "'mentions' and 'substitutes' added by tools/convert_wsc273.py.")
NOTE = ("All 273 problems of WSC273 in the collection's order, converted from WSCollection.xml by "
        "tools/convert_wsc273.py (do not edit by hand: rerun the script). Fields: index (the position in the "
        "collection); schema (the schema's index: 135 schemas of two sentences, one of three); text (the pronoun "
        "marked with [brackets]); pronoun; candidates (the collection's two answers); answer (the index of the "
        "correct candidate); source (the collection's credit); mentions (each candidate in the text: [phrase, k], "
        "the k-th whole-word occurrence counted from the start of the text without brackets); substitutes (what "
        "replaces the pronoun for each candidate in the substitution form of Trinh & Le 2018, lowercase where the "
        "loader capitalises it at the start of a sentence).")


class ConversionError(ValueError):
    """The XML is not the collection this script converts."""


def _norm(text: str | None) -> str:
    return " ".join((text or "").split())


def _occurrences(text: str, phrase: str) -> list[int]:
    """Starts of the whole-word matches of ``phrase`` in ``text``."""
    out, at = [], 0
    while (i := text.find(phrase, at)) >= 0:
        j = i + len(phrase)
        if (i == 0 or not text[i - 1].isalnum()) and (j == len(text) or not text[j].isalnum()):
            out.append(i)
        at = i + 1
    return out


def _strip_determiner(phrase: str) -> str:
    for d in DETERMINERS:
        if phrase.lower().startswith(d):
            return phrase[len(d):]
    return phrase


def _mention(text: str, pron: tuple[int, int], candidate: str, other: tuple[int, int] | None, where: str) -> list:
    """``[phrase, k]``: the candidate's words in the (unmarked) text, before the pronoun if it is there."""
    phrase = MENTIONS.get(candidate, _strip_determiner(candidate))
    if isinstance(phrase, tuple):  # the occurrence pinned
        phrase, k = phrase
        if len(_occurrences(text, phrase)) <= k:
            raise ConversionError(f"{where}: {phrase!r} occurs fewer than {k + 1} times in {text!r}")
        return [phrase, k]
    variants = [phrase, phrase[:1].lower() + phrase[1:], phrase[:1].upper() + phrase[1:]]
    for side in ("before", "after"):
        for v in dict.fromkeys(variants):
            starts = _occurrences(text, v)
            for k, s in enumerate(starts):
                e = s + len(v)
                if (e <= pron[0]) if side == "before" else (s >= pron[1]):
                    if other is None or e <= other[0] or s >= other[1]:
                        return [v, k]
    raise ConversionError(f"{where}: the candidate {candidate!r} ({phrase!r}) is not in the text {text!r}; "
                          f"add how the text names it to MENTIONS")


def _span(text: str, mention: list) -> tuple[int, int]:
    s = _occurrences(text, mention[0])[mention[1]]
    return s, s + len(mention[0])


def _substitute(candidate: str, pronoun: str) -> str:
    s = candidate
    if s.split(" ", 1)[0] in ("The", "A", "An"):
        s = s[0].lower() + s[1:]
    if pronoun.lower() in POSSESSIVE:
        s += "'s"
    return s


def _answer(raw: str | None, where: str) -> int:
    letter = _norm(raw).rstrip(".").strip()
    if letter not in ("A", "B"):
        raise ConversionError(f"{where}: correctAnswer must be A or B (a period allowed), received {raw!r}")
    return "AB".index(letter)


def _words_changed(a: str, b: str) -> int:
    ops = difflib.SequenceMatcher(a=a.split(), b=b.split(), autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops if op != "equal")


def read_collection(path: str | Path) -> list[dict]:
    """Every problem of the XML (all of them, WSC285's additions included), in order, as read."""
    root = ET.parse(path).getroot()
    out = []
    for i, s in enumerate(root.findall("schema")):
        where = f"problem {i}"
        text = s.find("text")
        answers = s.find("answers")
        if text is None or answers is None:
            raise ConversionError(f"{where}: a <schema> needs <text> and <answers>")
        candidates = [_norm(a.text) for a in answers.findall("answer")]
        if len(candidates) != 2 or not all(candidates):
            raise ConversionError(f"{where}: two non-empty <answer> expected, received {candidates!r}")
        out.append({"txt1": _norm(text.findtext("txt1")), "pron": _norm(text.findtext("pron")),
                    "txt2": _norm(text.findtext("txt2")), "candidates": candidates,
                    "answer": _answer(s.findtext("correctAnswer"), where), "source": _norm(s.findtext("source"))})
    return out


def schema_groups(n: int = N_PROBLEMS) -> list[tuple[int, ...]]:
    """The problems of each schema: consecutive pairs, and the one three-sentence schema."""
    groups, i = [], 0
    while i < n:
        size = len(THREE_SENTENCE_SCHEMA) if i == THREE_SENTENCE_SCHEMA[0] else 2
        groups.append(tuple(range(i, i + size)))
        i += size
    return groups


def convert(xml_path: str | Path) -> dict:
    """The WSC273 data dict (what ``jaxattn/data/wsc273.json`` holds) from the collection's XML."""
    raw = read_collection(xml_path)
    if len(raw) < N_PROBLEMS:
        raise ConversionError(f"the collection must hold at least {N_PROBLEMS} problems, found {len(raw)}")
    groups = schema_groups()
    if len(groups) != N_SCHEMAS:
        raise ConversionError(f"{len(groups)} schemas, expected {N_SCHEMAS}")
    schema_of = {i: g for g, members in enumerate(groups) for i in members}
    problems = []
    for i, r in enumerate(raw[:N_PROBLEMS]):
        where = f"problem {i}"
        if not r["txt1"] or not r["pron"] or not r["txt2"]:
            raise ConversionError(f"{where}: txt1, pron and txt2 must be non-empty, received {r!r}")
        glue = "" if r["txt2"][0] in ".,;:!?" else " "
        marked = f"{r['txt1']} [{r['pron']}]{glue}{r['txt2']}"
        text = f"{r['txt1']} {r['pron']}{glue}{r['txt2']}"
        pron = (len(r["txt1"]) + 1, len(r["txt1"]) + 1 + len(r["pron"]))
        m0 = _mention(text, pron, r["candidates"][0], None, where)
        m1 = _mention(text, pron, r["candidates"][1], _span(text, m0), where)
        problems.append({
            "index": i, "schema": schema_of[i], "text": marked, "pronoun": r["pron"],
            "candidates": r["candidates"], "answer": r["answer"], "source": r["source"],
            "mentions": [m0, m1], "substitutes": [_substitute(c, r["pron"]) for c in r["candidates"]],
        })
    for g, members in enumerate(groups):
        answers = {problems[i]["answer"] for i in members}
        if answers != {0, 1}:
            raise ConversionError(f"schema {g} (problems {members}): its sentences must have both answers")
        for a, b in zip(members, members[1:]):
            n = _words_changed(raw[a]["txt1"] + " " + raw[a]["txt2"], raw[b]["txt1"] + " " + raw[b]["txt2"])
            if n > MAX_WORDS_CHANGED:
                raise ConversionError(f"schema {g}: problems {a} and {b} differ in {n} words, not one schema")
    digest = hashlib.sha256(Path(xml_path).read_bytes()).hexdigest()
    return {"name": NAME, "source": SOURCE, "license": LICENSE, "note": NOTE,
            "xml": {"file": "WSCollection.xml", "sha256": digest, "problems_in_file": len(raw)},
            "problems": problems}


def dumps(data: dict) -> str:
    """The JSON text the script writes (one problem per line)."""
    head = {k: v for k, v in data.items() if k != "problems"}
    lines = json.dumps(head, indent=1, ensure_ascii=False)[:-2]
    rows = ",\n  ".join(json.dumps(p, ensure_ascii=False) for p in data["problems"])
    return f'{lines},\n "problems": [\n  {rows}\n ]\n}}\n'


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` so that a reader sees the old file or the whole new one, never a
    part: into a temporary file in the same folder, which then replaces ``path`` (``os.replace``). On
    failure the temporary file is removed and ``path`` is as it was. (:func:`jaxattn.io.atomic_write`
    does the same; this script keeps to the standard library.)"""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the data is meant to be read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _out_problem(out: str) -> str | None:
    """Why ``out`` cannot be the JSON file to write (checked before converting), or None."""
    path = Path(out)
    if out == "":
        return "out is empty; give the JSON file to write (e.g. jaxattn/data/wsc273.json)"
    if path.is_dir():
        return f"out {out!r} is a folder; give the JSON file to write there (e.g. jaxattn/data/wsc273.json)"
    if not path.parent.is_dir():
        return f"out {out!r}: its folder {str(path.parent)!r} does not exist"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("xml", help="WSCollection.xml (the repository keeps a copy in data/)")
    parser.add_argument("out", help="the JSON file to write (jaxattn/data/wsc273.json), replaced atomically")
    args = parser.parse_args(argv)
    problem = _out_problem(args.out)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        data = convert(args.xml)
    except (ConversionError, ET.ParseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        write_atomically(args.out, dumps(data))
    except OSError as e:
        reason = e.strerror or str(e)
        print(f"error: out {args.out!r}: cannot write there ({reason}); nothing was changed", file=sys.stderr)
        return 2
    n = len(data["problems"])
    print(f"wrote {n} problems in {len({p['schema'] for p in data['problems']})} schemas to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
