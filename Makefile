PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): setup.py | $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info
