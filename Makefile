# Quickstart targets. Everything installs into .venv; nothing is installed by hand.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-slow lint format bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mmyatt demo

test: $(STAMP)
	$(BIN)/ruff check mmyatt models rewards datasets tests
	$(BIN)/ruff format --check mmyatt models rewards datasets tests
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

format: $(STAMP)
	$(BIN)/ruff format mmyatt models rewards datasets tests
	$(BIN)/ruff check --fix mmyatt models rewards datasets tests
	$(BIN)/python -m mmyatt.config.reference --write  # docs/configuration.md (tests/test_docs.py)

clean:
	rm -rf $(VENV) build *.egg-info
