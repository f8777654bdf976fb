# make up    — the whole stack on this machine (tiny built-in model, OpenAI API on :8000)
# make test  — the test suite
# Both create .venv first when needed. Variables: PYTHON, TORCH, ARGS (to `epd up`), PYTEST_ARGS, TEST_WORKERS
# (pytest-xdist processes; each test file runs whole on one of them, so its module's stack is started once).

ifndef PYTHON
PYTHON := $(shell command -v python3.11 || command -v python3)
endif
# Installed pinned and first: an unpinned torch (or the package's `torch>=` range on its own) pulls a
# multi-GB CUDA build. For a GPU machine, e.g. `make venv TORCH="torch==2.13.0 --index-url <CUDA wheel index>"`.
TORCH ?= torch==2.13.0
VENV := .venv
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: venv up test clean

venv: $(STAMP)

# Reinstalls when pyproject.toml changes; otherwise a no-op.
$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "no python3.11 or python3 on PATH (set PYTHON=...)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install $(TORCH)
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $@

up: venv
	$(VENV)/bin/epd up $(ARGS)

test: venv
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
