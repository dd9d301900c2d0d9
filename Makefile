# moelab: `make demo` and `make test` each set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Local wheels (torch's CPU build for the test extras, see pyproject.toml), used when the folder exists.
WHEELS ?= /opt/wheels

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/moelab demo

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
