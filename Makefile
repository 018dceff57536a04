# Nightjar: `make serve` and `make test` each bootstrap .venv (idempotent) on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nightjar-installed
PYTEST_ARGS ?=

.PHONY: test lint serve venv models bench clean draft-head
# `python -m nightjar.models.cpu_fused` builds the fused CPU ops once per machine (~20 s; a no-op after)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $(STAMP)

venv: $(STAMP)

models: $(STAMP)
	$(PY) -m nightjar models pull

lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP)
	$(PY) -m nightjar models pull --quiet
	$(PY) -m nightjar.models.cpu_fused
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(PY) -m nightjar models pull
	$(PY) -m nightjar.models.cpu_fused
	$(PY) -m nightjar serve

bench: $(STAMP)
	$(PY) -m nightjar models pull
	$(PY) -m nightjar bench serve --launch --policy nightjar --trace spike --output-json bench.json --plot bench.png

# The draft head for the default target, from scratch, resumable (rerun after a stop): the target's answers to
# the training prompts (~1.7M tokens, 42-55 min here), their features captured into the head's feature cache as
# they are generated, then EAGLE-3-style training (110 min).
# Outputs under TRAIN_DIR, never in the repo.
TRAIN_DIR ?= .distill/head
HEAD_MINUTES ?= 110
draft-head: $(STAMP)
	$(PY) -m nightjar models pull
	mkdir -p $(TRAIN_DIR)
	$(PY) -m nightjar.training.answers --out $(TRAIN_DIR)/answers.jsonl --templated 4000 --samples 6 --seed 0 \
	    --features $(TRAIN_DIR)/run/cache
	$(PY) -m nightjar.training.eagle --corpus $(TRAIN_DIR)/answers.jsonl --out $(TRAIN_DIR)/run \
	    --minutes $(HEAD_MINUTES) --vocab 8192 --ttt 4 --seed 0

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
