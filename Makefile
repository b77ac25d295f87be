# Every target sets up .venv itself. On a CUDA machine: make test-gpu (the CUDA build of PyTorch from PyPI,
# then the suite with its models on the GPU), or make test TORCH=torch (see docs/gpus.md).
VENV := .venv
PY := $(VENV)/bin/python
ifeq ($(MAKECMDGOALS),test-gpu)
TORCH ?= torch
endif
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH)' | tr -c 'a-zA-Z0-9.\n' _)

.PHONY: demo test test-quick test-gpu docs setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,eval]"
	touch $@

# make demo DATA_DIR=/path/to/data: the evaluation data's folder (else $ST_FASTBACKEND_DATA_DIR, else ../shared/data)
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) examples/demo.py $(if $(DATA_DIR),--data-dir $(DATA_DIR))

test: $(STAMP)
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest

# The quick lane: the core parity and API tests, everything but the tests over about a second.
test-quick: $(STAMP)
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow"

# The site under site/, warnings as errors (tests/test_docs.py runs the same build in make test).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test-gpu: $(STAMP)
	$(PY) -c "import sys, torch; sys.exit(None if torch.version.cuda else 'make test-gpu: .venv holds a CPU build of PyTorch; remove .venv and run again')"
	HF_HUB_OFFLINE=1 $(PY) -m pytest --device cuda
