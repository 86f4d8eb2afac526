# Set-up shared by every target: a .venv with torch pinned first (a CPU wheel is installed from the
# machine's disk; an unpinned torch would pull a multi-GB CUDA build).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
# The fast tier: what `make test` runs (the README's command). `make test-all` runs every tier.
FAST := not slow and not zoo and not distributed and not browser

.PHONY: install demo test test-all docs lint bench bench-real-shapes bench-real-gpt2 bench-real-llama clean browser screenshot

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[hf,plot,dev]' $(TORCH)
	touch $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[hf,plot,dev,docs]' $(TORCH)
	touch $(DOCS_STAMP)

demo: install
	$(BIN)/memfit demo

test: install
	$(BIN)/python -m pytest -q -x -m '$(FAST)' --durations=15

test-all: install browser
	$(BIN)/python -m pytest -q -x --durations=25

# Headless Chromium from Debian for the tests marked browser (the HTML report); apt only when it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-headless-shell >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

# docs/images/report.png: the demo's HTML report, drawn by the headless Chromium.
screenshot: install browser
	$(BIN)/python docs/make_screenshot.py

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

lint: install
	$(BIN)/ruff check src tests benchmarks examples docs
	$(BIN)/ruff format --check src tests benchmarks examples docs

bench: install
	$(BIN)/python -m pip install --quiet -e '.[hf,plot,dev,bench]' $(TORCH)
	$(BIN)/python benchmarks/checkpoint_baselines.py
	$(BIN)/python benchmarks/frontier.py
	$(BIN)/python benchmarks/accumulation.py

# Shapes where compute dominates (each model its own run, about 40 minutes on 2 idle cores; run
# nothing else beside it): GPT-2 small at 2 x 512 tokens and a Llama-shaped 8 x 1024 model with a
# 32000 vocabulary at 1 x 1024 tokens. Writes frontier_real_gpt2.json and frontier_real_llama.json.
REAL_GPT2 := 'hf:gpt2?n_layer=12&n_embd=768&n_head=12&vocab_size=50257&n_positions=1024&seq_len=512'
REAL_LLAMA := 'hf:llama?num_hidden_layers=8&hidden_size=1024&num_attention_heads=16&num_key_value_heads=8&intermediate_size=2816&vocab_size=32000&max_position_embeddings=2048&seq_len=1024'
REAL_ARGS := --budgets 4 --repeats 3 --fractions 0.3 --compiled-plans 0 --compiled-mode 0 --policies sqrt

bench-real-shapes: bench-real-gpt2 bench-real-llama

bench-real-gpt2: install
	$(BIN)/python benchmarks/frontier.py --models $(REAL_GPT2) --batch-size 2 $(REAL_ARGS) \
		--out benchmarks/results/frontier_real_gpt2.json

bench-real-llama: install
	$(BIN)/python benchmarks/frontier.py --models $(REAL_LLAMA) --batch-size 1 $(REAL_ARGS) \
		--out benchmarks/results/frontier_real_llama.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
