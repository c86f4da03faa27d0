# Everything runs in a local virtual environment that the first target creates (about 2 minutes:
# Composer pins torch <2.7.1, so pip brings torch 2.7.0 from PyPI).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: demo test bench fuzz test-gpu bench-gpu clean

demo: $(STAMP)
	$(VENV)/bin/composer -n 2 examples/demo.py

test: $(STAMP)
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/run.py

fuzz: $(STAMP)   # hypothesis: hundreds of random uneven runs against the reference (~10 min on 2 cores)
	COMPOSER_JOIN_FUZZ=1 $(VENV)/bin/pytest tests/test_random_unevenness.py

# On GPUs (not run in CI): the distributed tests and the benchmarks with device='gpu' and NCCL, one GPU
# per rank; scenarios with more ranks than GPUs are skipped. Both stop with a message below 2 GPUs.
GPU_TESTS ?= tests/test_join_core.py tests/test_sync_strategies.py tests/test_evaluation.py \
	tests/test_collective_cost.py tests/test_inert_shadow.py $(wildcard tests/test_fsdp*.py)

test-gpu: $(STAMP)
	@$(VENV)/bin/python tests/devices.py 2 'make test-gpu'
	COMPOSER_JOIN_DEVICE=gpu $(VENV)/bin/pytest $(GPU_TESTS)

bench-gpu: $(STAMP)
	@$(VENV)/bin/python tests/devices.py 2 'make bench-gpu'
	COMPOSER_JOIN_DEVICE=gpu $(VENV)/bin/python benchmarks/run.py --out benchmarks/gpu \
		--max-ranks $$($(VENV)/bin/python tests/devices.py --count)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test,examples,bench,llmfoundry]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
