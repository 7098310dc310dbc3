# The two set-up commands of README.md. Both create .venv when missing and install
# meshserve (with its dev tools) into it first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.meshserve-installed
PYTEST_ARGS ?=

.PHONY: up test lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/meshserve up

# pytest exits 5 when it ran no test: that is a failure here, never a green run.
test: $(STAMP)
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest ran no tests: failing"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .meshserve .pytest_cache .mypy_cache .ruff_cache
