# trl-dta developer targets. `make test` is the test command (CI runs it via .ci/run).
# Everything runs in .venv, built from nothing but $(PYTHON); override e.g. `make test PYTHON=python3.11`.
# (A `make demo` target will be added with the trainer recipe.)

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# torch goes in FIRST: an unpinned torch would pull the multi-GB CUDA build. 2.13.0 is a CPU build on the
# project's machines. Set TORCH_SPEC= (empty) to keep whatever torch the venv already has.
TORCH_SPEC ?= torch==2.13.0
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k trie -x"`.
PYTEST_ARGS ?=

# Stamp inside the venv: deleting .venv also drops the stamp; editing pyproject.toml triggers a reinstall.
STAMP := $(VENV)/.trl-dta-installed

.PHONY: venv test test-slow test-all bench clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(if $(TORCH_SPEC),$(VPY) -m pip install "$(TORCH_SPEC)")
	$(VPY) -m pip install -e ".[dev]"
	touch $@

# Fast suite (the README's test command).
test: venv
	$(VPY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Only the heavier tests. pytest exits 5 when none are collected; .ci/run tolerates that, this target does not.
test-slow: venv
	$(VPY) -m pytest -q -m slow $(PYTEST_ARGS)

# Everything, slow tests included.
test-all: venv
	$(VPY) -m pytest -q $(PYTEST_ARGS)

bench: venv
	$(VPY) benchmarks/executor.py

# Build/test artefacts; keeps .venv (distclean removes it) and benchmarks/out (results).
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
