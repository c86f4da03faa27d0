# Everything runs in a local virtual environment (.venv) that the first target creates. Each target installs
# only what it needs, once, and records it in a stamp file ($(VENV)/.installed-<what>):
#   make demo    the package alone (Composer, torch): about 2 min the first time (torch 2.7.0 and its CUDA
#                libraries come from PyPI: Composer pins torch <2.7.1)
#   make test    every extra (tests, Composer's tests, examples, benchmarks, llm-foundry, docs, lint): about 10 min the first time
#   make test-torch26  a second environment (.venv-torch26) with torch 2.6.0 and the test extra: ~6 GB from PyPI
#                (torch 2.6.0's CUDA build, the only Linux one there), then a smoke subset; docs/compatibility.md
VENV ?= .venv
PYTHON ?= python3
PIP := $(VENV)/bin/pip --disable-pip-version-check
ALL_EXTRAS := test,composer-tests,examples,bench,llmfoundry,docs,lint,package

.PHONY: demo test test-detail test-failover test-composer test-torch26 lint format docs bench fuzz fuzz-scenarios fuzz-hypothesis llmfoundry test-llmfoundry test-gpu bench-gpu wheel clean

demo: $(VENV)/.installed-core
	$(VENV)/bin/composer -n 2 examples/demo.py

test: $(VENV)/.installed-all
	$(VENV)/bin/pytest

# A subset of the suite with TORCH_DISTRIBUTED_DEBUG=DETAIL in the ranks (torch compares every collective's
# operation, shapes and dtypes on every rank first): tests/test_detail.py alone, ~1 min; make test runs it too.
# FSDP2 is left out (gloo's checking wrapper lacks allgather_into_tensor_coalesced); docs/reliability.md.
test-detail: $(VENV)/.installed-test
	$(VENV)/bin/pytest tests/test_detail.py

# Failover under real launchers, not in `make test` (about a minute per run): two torchrun agents on this machine as
# two nodes, node B killed with SIGKILL mid-epoch, node A going on alone, every sample once, COMPOSER_JOIN_FAILOVER_TRIES
# times in a row (default 10); one node under torchrun restarting its workers; `composer -n 3` killed, then `-n 2`;
# examples/train.py under torchrun with autoresume. 8-13 min on 2 cores; docs/reliability.md, "Failover".
test-failover: $(VENV)/.installed-test
	$(VENV)/bin/pytest -p no:cacheprovider -m agents tests/test_failover_agents.py

# The lowest torch Composer 0.32.1 accepts (2.6.0), in a second environment of its own: a smoke subset of the
# suite (DDP and its reducer hooks, every sync strategy, FSDP1, rebalancing, resumption); docs/compatibility.md.
VENV_TORCH26 ?= .venv-torch26
TORCH26_TESTS ?= tests/test_sync_strategies.py tests/test_resumption.py tests/test_rebalance.py tests/test_fsdp.py

test-torch26: $(VENV_TORCH26)/.installed-test
	$(VENV_TORCH26)/bin/pytest -p no:cacheprovider $(TORCH26_TESTS)

# Composer's own tests (../shared/peers/composer-v0.32.1, not copied here) with UnevenJoin injected into every
# Trainer, in one process and in two, against stock Composer (docs/contributing.md); fails on any regression.
test-composer: $(VENV)/.installed-test $(VENV)/.installed-composer-tests
	$(VENV)/bin/python tests/composer_suite/run_composer_suite.py

lint: $(VENV)/.installed-lint   # what CI runs: ruff (lint and format check), mypy, the import contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

format: $(VENV)/.installed-lint   # fixes first: they can change what the formatter sees
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

docs: $(VENV)/.installed-docs   # the site, into docs/_build/html (warnings are errors, as in CI)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

bench: $(VENV)/.installed-bench
	$(VENV)/bin/python benchmarks/run.py

# The scenario fuzzer (tests/scenario_fuzz.py): N scenarios drawn from every documented feature from seed SEED (default:
# from the clock; the seed is printed first), each run on 2-3 real ranks against tests/fuzz_reference.py; failures are
# confirmed alone, shrunk, and printed as one command each. About 4 s per scenario on 2 cores. Then the hypothesis fuzz.
N ?= 200
SEED ?=
fuzz: fuzz-scenarios fuzz-hypothesis

fuzz-scenarios: $(VENV)/.installed-test
	PYTHONPATH=. $(VENV)/bin/python tests/scenario_fuzz.py --n $(N) $(if $(SEED),--seed $(SEED))

fuzz-hypothesis: $(VENV)/.installed-test   # hypothesis: 750 random uneven runs (DDP, FSDP, rebalancing, evaluation) against the reference (~4 min)
	COMPOSER_JOIN_FUZZ=1 $(VENV)/bin/pytest tests/test_random_unevenness.py

llmfoundry: $(VENV)/.installed-llmfoundry   # the llm-foundry example (docs/integrations.md): a tiny MPT, offline
	$(VENV)/bin/python examples/llmfoundry/prepare.py /tmp/uneven-mpt
	$(VENV)/bin/composer -n 2 examples/llmfoundry/train.py examples/llmfoundry/uneven_mpt.yaml \
		variables.data_dir=/tmp/uneven-mpt

test-llmfoundry: $(VENV)/.installed-test $(VENV)/.installed-llmfoundry   # its test alone (make test runs it too)
	$(VENV)/bin/pytest tests/test_llmfoundry.py

wheel: $(VENV)/.installed-package   # wheel and sdist into dist/, checked by twine; CI installs the wheel alone
	rm -rf dist
	$(VENV)/bin/python -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

# On GPUs (not run in CI): tests/gpu_suite.py picks the tests (one GPU per rank with NCCL; on one GPU,
# all ranks share it over gloo) and prints a one-line summary; see docs/gpu.md.
test-gpu: $(VENV)/.installed-test
	$(VENV)/bin/python tests/gpu_suite.py test

bench-gpu: $(VENV)/.installed-test $(VENV)/.installed-bench
	$(VENV)/bin/python tests/gpu_suite.py bench

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras; installing everything also satisfies every other target.
$(VENV)/.installed-core: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-all: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e '.[$(ALL_EXTRAS)]'
	touch $(VENV)/.installed-core $(foreach extra,$(subst $(comma), ,$(ALL_EXTRAS)),$(VENV)/.installed-$(extra)) $@

$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e '.[$*]'
	touch $(VENV)/.installed-core $@

# torch 2.6.0 and its torchvision; the rest as Composer 0.32.1 and the test extra resolve it.
$(VENV_TORCH26)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV_TORCH26)
	$(VENV_TORCH26)/bin/pip --disable-pip-version-check install --quiet torch==2.6.0 torchvision==0.21.0 -e '.[test]'
	touch $@

comma := ,

clean:
	rm -rf $(VENV) $(VENV_TORCH26) .pytest_cache .hypothesis .mypy_cache .ruff_cache docs/_build dist build
