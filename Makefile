# `make demo` and `make test` work on a fresh machine with Python 3.11 and pip: they create .venv and
# install t5forge (editable) with the test extras. constraints.txt pins the CPU build of torch for
# development and CI; pyproject.toml itself asks for torch>=2.8 so GPU users keep their CUDA build.
# `make test-floor` runs the same suite on that oldest supported torch (.venv-floor; on PyPI it is a
# CUDA build of ~5 GB installed, which runs on the CPU as well).
# `make docs` adds the docs extras to the same .venv and builds the documentation site (docs/, mkdocs.yml)
# into site/ with --strict, so a broken link or a page missing from the nav fails it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PYTEST_WORKERS ?= 2
TORCH_FLOOR := 2.8.0
FLOOR_VENV := .venv-floor
DOCS_INSTALLED := $(VENV)/.docs-installed

.PHONY: install test test-e2e test-floor demo docs clean slurm-deps browser-deps

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(INSTALLED)

install: $(INSTALLED)

# `make test` skips the tests marked e2e (slow end-to-end runs); `make test-e2e` runs only those.
# --dist loadscope keeps each module on one worker: xdist's default spreads a module's tests over both, and
# each worker then builds the module's fixtures (the launches of many layouts) once more.
test: $(INSTALLED)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope -q -m "not e2e" --durations=10 tests

test-e2e: $(INSTALLED)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope -q -m e2e --durations=10 tests

# The local Slurm cluster of tests/distributed/test_slurm.py (e2e) needs Debian's Slurm and munge; as root with
# apt, installed once; elsewhere nothing is done and that test says why it skips.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm-deps:
	@if command -v slurmctld >/dev/null 2>&1 || test -x /usr/sbin/slurmctld; then echo "slurm: installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SLURM_PACKAGES)) >/dev/null \
		&& echo "slurm: installed $(SLURM_PACKAGES)" || echo "slurm: apt-get could not install $(SLURM_PACKAGES)"; \
	else echo "slurm: not installed (needs root and apt-get: apt-get install $(SLURM_PACKAGES))"; fi

# The report's browser test (tests/report) opens pages in the system's Chromium through Playwright, which cannot
# download a browser of its own here: Debian's chromium, as root with apt; elsewhere the test says why it skips.
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then echo "chromium: installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null \
		&& echo "chromium: installed" || echo "chromium: apt-get could not install chromium"; \
	else echo "chromium: not installed (needs root and apt-get: apt-get install chromium)"; fi

$(FLOOR_VENV)/.installed: pyproject.toml
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	echo "torch==$(TORCH_FLOOR)" > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c $(FLOOR_VENV)/constraints.txt -e '.[test]'
	touch $(FLOOR_VENV)/.installed

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope -q -m "not e2e" tests

demo: $(INSTALLED)
	$(PY) scripts/demo.py

$(DOCS_INSTALLED): $(INSTALLED) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[docs]'
	touch $(DOCS_INSTALLED)

# NO_MKDOCS_2_WARNING: mkdocs-material >= 9.7 prints a banner on every build (its end of life in 2027,
# Zensical as successor); the pinned range builds the site as it is.
docs: $(DOCS_INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs site
