# The two commands a newcomer runs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_MACHINE ?=
ONLY ?=
# What ruff checks and formats; mypy checks the package.
PYSRC := spotguard tests examples bench

.PHONY: demo test test-fast bench gpu-check lint fmt clean checkov-venv

$(VENV)/.installed: pyproject.toml tests/azurite/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # first, so the CPU wheel is used, not a CUDA build
	$(PY) -m pip install -q -e '.[dev,aws,gcp,azure,data,plot,metrics,hf,lightning]'
	# Azurite (the Azure Storage emulator the az:// tests start) from the npm registry, pinned by its lock file.
	npm ci --prefix tests/azurite --no-audit --no-fund --loglevel=error
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30  # 2 workers: most tests wait on child processes; a file stays on one worker; the slowest tests printed

# The edit loop's tier: the test files that take seconds (tests/fast_tier.py), not their slow tests.
# Not a substitute for `make test`, which CI runs.
test-fast: $(VENV)/.installed
	$(PY) -m tests.fast_tier -q -n 2

bench: $(VENV)/.installed
	$(PY) bench/run_all.py $(ONLY) --machine "$(BENCH_MACHINE)"

# On a CUDA machine (torch==2.13.0 with CUDA in the venv): the tests marked gpu, the loop's stall per
# checkpoint against the device-to-host copy, then a real-size state (~9 GB) with every figure beside
# its baseline. Without CUDA the tests skip and the real-size rows are measured on the CPU (0.5 GB).
gpu-check: $(VENV)/.installed
	$(PY) -m pytest -m gpu -v -rs
	$(PY) bench/checkpoint_stall.py --device cuda --size-mb 1024
	$(PY) bench/gpu_real_size.py

# checkov in a venv of its own: its bc-python-hcl2 installs a module `hcl2` that clashes with python-hcl2.
# tests/terraform/test_checkov.py runs it (skipped when missing, failed when missing in CI).
checkov-venv: .venv-checkov/bin/checkov
.venv-checkov/bin/checkov:
	$(PYTHON) -m venv .venv-checkov
	SKIP_PACKAGE_UPDATE_CHECK=true .venv-checkov/bin/pip install -q 'checkov>=3.2,<4'

# lint: what .ci/run checks before the tests. fmt: fixes what ruff can (import order ...) and formats.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(PYSRC)
	$(VENV)/bin/ruff format --check $(PYSRC)
	$(VENV)/bin/mypy spotguard

fmt: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix $(PYSRC)
	$(VENV)/bin/ruff format $(PYSRC)

clean:
	rm -rf $(VENV) .venv-checkov demo-run .pytest_cache tests/azurite/node_modules
