# llmbook: `make book` builds the website, `make test` runs every test. Both set up .venv first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch that lies on these machines' disk; a GPU or Colab user keeps their own.
TORCH_SPEC ?= torch==2.13.0

# The site's JavaScript (MathJax 3, require.js, the ipywidgets embed manager) is installed from the npm
# registry into _static/vendor, so the built site works offline and widgets need no CDN.
VENDOR := _build/vendor-static/vendor
NPM_PACKAGES := mathjax@3.2.2 requirejs@2.3.7 @jupyter-widgets/html-manager@1.0.15

.PHONY: help env vendor browser book notebooks pages test lint unit nbval site-test serve clean

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

vendor: $(VENDOR)/.stamp

$(VENDOR)/.stamp: Makefile
	mkdir -p _build/npm $(VENDOR)
	cd _build/npm && npm install --no-audit --no-fund --no-save --silent $(NPM_PACKAGES)
	rm -rf $(VENDOR)/mathjax && cp -r _build/npm/node_modules/mathjax/es5 $(VENDOR)/mathjax
	cp _build/npm/node_modules/requirejs/require.js $(VENDOR)/require.js
	cp _build/npm/node_modules/@jupyter-widgets/html-manager/dist/embed-amd.js $(VENDOR)/embed-amd.js
	mkdir -p _build/vendor-extra/book/@jupyter-widgets/html-manager/dist
	cp _build/npm/node_modules/@jupyter-widgets/html-manager/dist/*.{woff,woff2,ttf,eot,svg} \
	   _build/vendor-extra/book/@jupyter-widgets/html-manager/dist/
	touch $(VENDOR)/.stamp

pages: env
	$(BIN)/python -m llmbook pages

book: env vendor pages
	rm -rf _build/html
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The site is in _build/html (open _build/html/index.html, or run 'make serve')."

notebooks: env
	$(BIN)/python -m llmbook notebooks

lint: env
	$(BIN)/ruff check llmbook tests benchmarks

unit: env
	$(BIN)/pytest -q -n 2 --ignore=tests/site llmbook tests

nbval: env
	$(BIN)/pytest -q -o addopts="-p no:cacheprovider" --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg book

test: lint unit nbval

# Debian's Chromium for the browser tests (Playwright cannot download its own browser here).
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium > /dev/null)

site-test: env browser
	LLMBOOK_SITE_TESTS=1 $(BIN)/pytest -q -o addopts="-p no:cacheprovider" tests/site

serve:
	$(BIN)/python -m http.server 8000 --bind 127.0.0.1 --directory _build/html

clean:
	rm -rf _build book/equation-index.md book/status.md book/api.md book/notation.md
