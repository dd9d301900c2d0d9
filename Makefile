# moelab: `make demo` and `make test` each set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Local wheels (torch's CPU build for the test extras, see pyproject.toml), used when the folder exists.
WHEELS ?= /opt/wheels

# Two pytest-xdist workers, one test file each at a time: module fixtures (a trained run, a Ray cluster, an S3
# server) stay in one process, and the 2-core CI machine runs two files side by side (see README "Tests").
# Files go out in the order tests/conftest.py gives them (the heaviest first), not xdist's by test count.
# PYTEST_ARGS adds to every target's pytest line (benchmarks/suite_time.py adds its durations table there).
PYTEST = $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

.PHONY: demo test test-slow test-all check clean browser

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/moelab demo

# Headless Chromium for the report and site tests: installed once where the machine can (root, apt-get), else one
# line saying what to install and a stop before the first test (tools/need-chromium).
browser:
	@tools/need-chromium

test: $(STAMP) browser
	$(PYTEST)

# The `slow` tier alone: what `make test` leaves out to stay inside 8 minutes (each such test says why in its
# docstring). CI runs it after `make test`, so every test runs on every submission but the `network` one
# (a fresh venv's pip install of the package, minutes and the package index), which only `make test-all` runs.
test-slow: $(STAMP) browser
	$(PYTEST) -m 'slow and not network'

# Every test, the `slow` ones too, in one run.
test-all: $(STAMP) browser
	$(PYTEST) -m 'slow or not slow'

# The inner loop between two changes: each module's core logic, no Ray, S3 or browser and no trained run.
CHECK_TESTS := tests/test_config.py tests/test_layers.py tests/test_ledger.py tests/test_ladder_fit.py \
	tests/test_ladder_checks.py tests/test_contingency.py tests/test_registry.py tests/test_model.py

check: $(STAMP)
	$(PYTEST) -m 'not slow' $(CHECK_TESTS)

clean:
	rm -rf $(VENV) runs .pytest_cache
