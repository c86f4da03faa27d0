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

# On GPUs (not run in CI): tests/gpu_suite.py picks the tests (one GPU per rank with NCCL; on one GPU,
# all ranks share it over gloo) and prints a one-line summary; see docs/gpu.md.

test-gpu: $(STAMP)
	$(VENV)/bin/python tests/gpu_suite.py test

bench-gpu: $(STAMP)
	$(VENV)/bin/python tests/gpu_suite.py bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test,examples,bench,llmfoundry]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
