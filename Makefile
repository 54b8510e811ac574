# sparserl: two commands on a fresh machine.
#   make demo   set up, then run the main job (generated matrices, the default provider;
#               `sparserl demo --provider policy` asks the bundled policy) and print a table
#   make test   set up, then run the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU machines install torch from a local CPU build; a plain `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test device clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/sparserl demo

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
