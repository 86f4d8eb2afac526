# Set-up shared by `make demo` and `make test`: a .venv with torch pinned first (a CPU wheel is
# installed from the machine's disk; an unpinned torch would pull a multi-GB CUDA build).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[hf,plot,dev]' $(TORCH)
	touch $(STAMP)

demo: install
	$(BIN)/memfit demo

test: install
	$(BIN)/python -m pytest -q -x --durations=15

lint: install
	$(BIN)/ruff check src tests benchmarks

bench: install
	$(BIN)/python -m pip install --quiet -e '.[hf,plot,dev,bench]' $(TORCH)
	$(BIN)/python benchmarks/checkpoint_baselines.py
	$(BIN)/python benchmarks/frontier.py
	$(BIN)/python benchmarks/accumulation.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
