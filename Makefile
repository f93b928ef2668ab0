# `make demo` and `make test` work on a fresh machine with Python 3.11 and pip: they create .venv and
# install t5forge (editable) with the test extras. constraints.txt pins the CPU build of torch for
# development and CI; pyproject.toml itself asks for torch>=2.13 so GPU users get their CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: install test demo clean

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(INSTALLED)

install: $(INSTALLED)

test: $(INSTALLED)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q tests

demo: $(INSTALLED)
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) runs
