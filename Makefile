# `make demo` and `make test` work on a fresh machine with Python 3.11 and pip: they create .venv and
# install t5forge (editable) with the test extras. constraints.txt pins the CPU build of torch for
# development and CI; pyproject.toml itself asks for torch>=2.8 so GPU users keep their CUDA build.
# `make test-floor` runs the same suite on that oldest supported torch (.venv-floor; on PyPI it is a
# CUDA build of ~5 GB installed, which runs on the CPU as well).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PYTEST_WORKERS ?= 2
TORCH_FLOOR := 2.8.0
FLOOR_VENV := .venv-floor

.PHONY: install test test-floor demo clean

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(INSTALLED)

install: $(INSTALLED)

test: $(INSTALLED)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q tests

$(FLOOR_VENV)/.installed: pyproject.toml
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	echo "torch==$(TORCH_FLOOR)" > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c $(FLOOR_VENV)/constraints.txt -e '.[test]'
	touch $(FLOOR_VENV)/.installed

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) -q tests

demo: $(INSTALLED)
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs
