# llmbook: `make book` builds the website, `make test` runs every test. Both set up .venv first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch that lies on these machines' disk; a GPU or Colab user keeps their own.
TORCH_SPEC ?= torch==2.13.0

.PHONY: help env book notebooks pages test lint unit nbval serve clean

help:
	@echo "make book       build the website into _build/html (executes every notebook, warnings are errors)"
	@echo "make test       ruff + unit tests + doctests + nbval over book/"
	@echo "make notebooks  re-execute the notebooks in place (refreshes the outputs nbval compares)"
	@echo "make serve      serve _build/html on http://127.0.0.1:8000"

env: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(STAMP)

pages: env
	$(BIN)/python -m llmbook pages

book: env pages
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The site is in _build/html (open _build/html/index.html, or run 'make serve')."

notebooks: env
	$(BIN)/python -m llmbook notebooks

lint: env
	$(BIN)/ruff check llmbook tests benchmarks

unit: env
	$(BIN)/pytest -q -n 2 llmbook tests

nbval: env
	$(BIN)/pytest -q -o addopts="-p no:cacheprovider" --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg book

test: lint unit nbval

serve:
	$(BIN)/python -m http.server 8000 --bind 127.0.0.1 --directory _build/html

clean:
	rm -rf _build book/equation-index.md book/status.md book/api.md
