# The two commands a newcomer runs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # first, so the CPU wheel is used, not a CUDA build
	$(PY) -m pip install -q -e '.[dev,aws,gcp,data,plot]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) bench/run_all.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check spotguard tests examples bench
	$(VENV)/bin/mypy spotguard

clean:
	rm -rf $(VENV) demo-run .pytest_cache
