# Two commands set up everything on a fresh machine and are safe to repeat:
#   make train   -> venv + CPU torch + paft, then `paft train` on its default (gpt, 4 workers)
#   make test    -> the same set-up, then the lint checks (ruff, mypy) and the test suite
# TORCH_SPEC picks the torch build. The default pin takes the CPU wheel where pip finds it
# locally (as on this project's machines); from plain PyPI on Linux it is the CUDA build. On a GPU machine:
#   make TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126' test
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.paft-installed
# The torch build installed, rewritten only when TORCH_SPEC changes: the set-up reruns then.
SPEC := $(VENV)/.torch-spec

.PHONY: setup train lint test clean FORCE

setup: $(STAMP)

$(SPEC): FORCE
	@mkdir -p $(VENV)
	@test "$$(cat $@ 2>/dev/null)" = '$(TORCH_SPEC)' || echo '$(TORCH_SPEC)' > $@

$(STAMP): pyproject.toml $(SPEC)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: setup
	$(BIN)/paft train $(ARGS)

# ruff, then mypy (its settings, files included, are pyproject.toml's [tool.mypy]).
lint: setup
	$(BIN)/ruff check src && $(BIN)/mypy

# The slowest tests are listed at the end: the suite is kept under ~15 minutes on 2 cores.
test: lint
	$(BIN)/python -m pytest --durations=15 $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info
