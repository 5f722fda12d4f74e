"""jaxattn.winograd is the home of the Winograd data and scorers; jaxattn.interventions keeps their names as
the same objects, whichever of the two modules is imported first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxattn import interventions, winograd

ROOT = Path(__file__).resolve().parent.parent

# The Winograd names jaxattn.interventions exported before jaxattn.winograd existed.
INTERVENTIONS_NAMES = [
    "Problem", "Schema", "accuracy", "best_head", "evaluate", "evaluate_sentences", "flatten_pairs",
    "head_predictions", "lm_scorer", "load_metadata", "load_pairs", "load_wsc273", "max_attention_predictions",
    "model_maps", "parse_pairs", "parse_wsc273", "pronoun_attention", "special_after_pronoun", "split_pairs",
    "substitution_scores", "to_schemas", "wsc273_pairs",
]


@pytest.mark.parametrize("name", INTERVENTIONS_NAMES)
def test_each_interventions_winograd_name_is_the_winograd_modules_own(name):
    assert name in winograd.__all__
    assert getattr(interventions, name) is getattr(winograd, name)
    assert getattr(winograd, name).__module__ == "jaxattn.winograd"
    assert name in dir(interventions)
    assert name not in interventions.__all__  # documented in one place: jaxattn.winograd


def test_from_interventions_import_a_winograd_name_works():
    from jaxattn.interventions import Schema, load_wsc273

    assert Schema is winograd.Schema and load_wsc273 is winograd.load_wsc273


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'load_wsc274'"):
        interventions.load_wsc274  # noqa: B018


@pytest.mark.parametrize("first", ["jaxattn.winograd", "jaxattn.interventions"])
def test_either_module_imports_first(first):
    code = (f"import {first}\n"
            "import jaxattn.interventions as I, jaxattn.winograd as W\n"
            "assert I.load_wsc273 is W.load_wsc273\n"
            "print(len(I.load_wsc273()), len(W.load_pairs()))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["273", "136"]
