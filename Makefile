# llmbook: `make book` builds the website, `make test` runs every test. Both set up .venv first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch that lies on these machines' disk; a GPU or Colab user keeps their own.
TORCH_SPEC ?= torch==2.13.0
# Exact versions the stored notebook outputs were recorded with (requirements*.txt keep ranges).
PIN := -c constraints.txt

# The site's JavaScript (MathJax 3, require.js, the ipywidgets embed manager) comes from the npm
# registry, pinned by the committed lockfile in book/_ext/npm, so the built site needs no CDN.
VENDOR := _build/vendor-static/vendor
NPM_LOCK := book/_ext/npm
# Notebooks record no progress bars (tqdm writes to stderr, which Colab and GitHub show).
NB_ENV := TQDM_DISABLE=1 PYTHONHASHSEED=0
# Another CPU code path than this machine's own (llmbook/cpu.py), to prove that no stored output depends on the
# last bits of floating point: `make test CPU_PATH=avx2` or `make nbval CPU_PATH=generic`.
#   avx2     what an AVX2-only CPU (an AMD Zen laptop, many cloud VMs) takes, forced on an AVX-512 machine
#   generic  torch's plain C++ kernels, MKL's SSE2-compatible path, oneDNN at SSE4.1, OpenBLAS's Nehalem kernels
#            and NumPy without its AVX2/AVX-512 loops: unlike any machine's own default (slower; CI runs
#            it on machines without AVX-512, avx2 on the others)
CPU_PATH ?=
CPU_ENV_avx2 := ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \
	NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL"
CPU_ENV_generic := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 OPENBLAS_CORETYPE=Nehalem \
	NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL"
CPU_ENV := $(CPU_ENV_$(CPU_PATH))
STAGE_SUFFIX := $(if $(CPU_PATH),-$(CPU_PATH))
ifneq ($(CPU_PATH),)
ifeq ($(CPU_ENV),)
$(error CPU_PATH must be avx2 or generic (or empty: this machine's own paths), not '$(CPU_PATH)')
endif
endif
# Every stage appends "stage<TAB>seconds" here; .ci/run prints the table.
TIMINGS := _build/timings.tsv
timed = @mkdir -p _build; s=$$(date +%s%N); $(2); rc=$$?; \
	printf '%s\t%s\n' "$(1)" "$$(( ($$(date +%s%N) - s) / 1000000 ))" >> $(TIMINGS); exit $$rc

.PHONY: help env vendor browser book notebooks pages test lint unit nbval site-test serve clean constraints

help:
	@echo "make book       build the website into _build/html (renders outputs nbval proved current, executes the rest)"
	@echo "make test       ruff + unit tests + doctests + fuzz + nbval over book/ (both cores)"
	@echo "make test CPU_PATH=avx2|generic   the same under another CPU code path (the outputs must not change)"
	@echo "make notebooks  re-execute the notebooks in place (refreshes the outputs nbval compares)"
	@echo "make serve      serve _build/html on http://127.0.0.1:8000"
	@echo "make constraints  re-pin constraints.txt from .venv (then make notebooks)"

env: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIN) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q $(PIN) -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(STAMP)

constraints: env
	{ sed -n '1,/^# Refresh/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^llmbook' \
	  | sed 's/+cpu$$//'; } > constraints.tmp && mv constraints.tmp constraints.txt

vendor: $(VENDOR)/.stamp

$(VENDOR)/.stamp: $(NPM_LOCK)/package.json $(NPM_LOCK)/package-lock.json
	rm -rf _build/npm && mkdir -p _build/npm $(VENDOR)
	cp $(NPM_LOCK)/package.json $(NPM_LOCK)/package-lock.json _build/npm/
	cd _build/npm && npm ci --no-audit --no-fund --silent
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
	$(call timed,book,$(NB_ENV) $(BIN)/jupyter-book build . -W -n --keep-going)
	@echo "The site is in _build/html (open _build/html/index.html, or run 'make serve')."

notebooks: env
	$(BIN)/python -m llmbook corpus  # the retrieval corpus is the book's prose (and its embeddings): first, as Part II's chapters read it
	$(NB_ENV) $(BIN)/python -m llmbook notebooks

lint: env
	$(call timed,lint,$(BIN)/ruff check llmbook tests benchmarks book/_ext)

unit: env
	$(call timed,unit$(STAGE_SUFFIX),$(CPU_ENV) $(BIN)/pytest -q -n 2 --ignore=tests/site llmbook tests)

# Both cores; --dist loadscope keeps each notebook's cells on one worker (one kernel per notebook).
# llmbook.freshness writes a proof for each notebook that passes, so `make book` renders it as stored, and
# reports each notebook's time against the 20 s budget (LLMBOOK_NOTEBOOK_BUDGET_STRICT=1 makes it a failure).
nbval: env
	@$(CPU_ENV) $(BIN)/python -m llmbook cpu
	$(call timed,nbval$(STAGE_SUFFIX),$(CPU_ENV) $(NB_ENV) $(BIN)/pytest -q -n 2 --dist loadscope \
	  -o addopts="-p no:cacheprovider" -p llmbook.freshness --nbval --nbval-current-env \
	  --nbval-sanitize-with tests/nbval_sanitize.cfg book)

test: lint unit nbval

# Debian's Chromium for the browser tests (Playwright cannot download its own browser here).
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium > /dev/null)

site-test: env browser
	$(call timed,site-test,LLMBOOK_SITE_TESTS=1 $(BIN)/pytest -q -n 2 -o addopts="-p no:cacheprovider" tests/site)

serve:
	$(BIN)/python -m http.server 8000 --bind 127.0.0.1 --directory _build/html

clean:
	rm -rf _build book/equation-index.md book/status.md book/api.md book/notation.md
