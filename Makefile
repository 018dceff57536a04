# Nightjar: `make serve` and `make test` each bootstrap .venv (idempotent) on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nightjar-installed
PYTEST_ARGS ?=

.PHONY: test lint serve venv models bench clean

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
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(PY) -m nightjar models pull
	$(PY) -m nightjar serve

bench: $(STAMP)
	$(PY) -m nightjar models pull
	$(PY) -m nightjar bench serve --launch --policy nightjar --trace spike --output-json bench.json --plot bench.png

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
