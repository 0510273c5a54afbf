# rankwise: every target creates .venv on first use (idempotent) and installs into it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rankwise demo --out runs/demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/step_time.py

clean:
	rm -rf $(VENV) runs .pytest_cache
