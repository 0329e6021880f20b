# Every target uses the virtual environment in .venv/ and creates it when missing.
.DEFAULT_GOAL := help
SHELL := /bin/bash

VENV   ?= .venv
PY     := $(VENV)/bin/python
# `make install` installs exactly what LOCK pins, each file checked against its hash. `make lock` remakes
# LOCK from pyproject.toml's ranges, with torch pinned to the build TORCH names, found where your pip finds
# it or on TORCH_INDEX (then written into the lock, so installing needs no flag). For CUDA, a lock of its own:
#   make lock LOCK=requirements-cu128.lock TORCH=torch==2.13.0+cu128 TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   make install LOCK=requirements-cu128.lock
LOCK        ?= requirements.lock
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?=
ARGS   ?=
CKPT   ?=
OUT    ?= model.pt
# `make train trainer.max_epochs=3` works too: command-line variables that are not ours are Hydra overrides,
# passed on in their order (MAKEOVERRIDES lists them last first), each quoted for the shell. MAKEOVERRIDES
# itself escapes spaces its own way, which split `ARGS="a=1 b=2 c=3"` wrongly; the shell splits ARGS.
OURS      = VENV LOCK TORCH TORCH_INDEX ARGS CKPT OUT NAME EXAMPLES
quote     = '$(subst ','\'',$(1))'
reverse   = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
CLI_NAMES = $(filter-out $(OURS),$(foreach w,$(call reverse,$(MAKEOVERRIDES)),$(if $(findstring =,$(w)),$(firstword $(subst =, ,$(w))))))
OVERRIDES = $(foreach v,$(CLI_NAMES),$(if $(filter command line,$(origin $(v))),$(call quote,$(v)=$(value $(v))))) $(ARGS)

.PHONY: help install lock train eval export test test-fast test-gpu lint format clean

help: ## show this help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed ## create .venv and install the locked dependencies and the package (idempotent)

# uv reads no pip configuration: pip's find-links (a folder of local wheels, as this template's CI keeps
# torch in) are passed on, so the lock pins the files pip installs. The lock is for this Python version.
lock: ## pin every dependency with its hashes into requirements.lock (LOCK, TORCH, TORCH_INDEX: see above)
	test -x $(VENV)/bin/uv || $(MAKE) install LOCK=requirements.lock  # uv comes with the dev extra
	echo '$(TORCH)' | $(VENV)/bin/uv pip compile pyproject.toml - --extra dev --generate-hashes --quiet \
	  --python $(PY) --custom-compile-command "make lock" -o $(LOCK) \
	  $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) $(if $(TORCH_INDEX),--index $(TORCH_INDEX) --emit-index-url)

train: install ## train the default experiment; overrides: make train ARGS="trainer.max_epochs=3" (or bare)
	$(PY) -m mlproject.train $(OVERRIDES)

eval: install ## evaluate a checkpoint: make eval CKPT=path/to/last.ckpt [ARGS=...]
	@test -n $(call quote,$(value CKPT)) || { echo "error: give the checkpoint, e.g. make eval CKPT=logs/train/runs/<run_id>/checkpoints/last.ckpt" >&2; exit 2; }
	$(PY) -m mlproject.eval $(call quote,ckpt_path=$(value CKPT)) $(OVERRIDES)

export: install ## any checkpoint -> one plain state dict: make export CKPT=path/to/last.ckpt [OUT=model.pt]
	@test -n $(call quote,$(value CKPT)) || { echo "error: give the checkpoint, e.g. make export CKPT=logs/train/runs/<run_id>/checkpoints/last.ckpt" >&2; exit 2; }
	$(PY) -m mlproject.export $(call quote,ckpt_path=$(value CKPT)) $(call quote,out=$(value OUT)) $(OVERRIDES)

test: install ## run the whole test suite
	$(PY) -m pytest $(ARGS)

test-fast: install ## the quick tests: all but those marked slow (multi-process training, long end-to-end runs)
	$(PY) -m pytest -m "not slow" $(ARGS)

test-gpu: install ## the GPU acceptance suite (tests/gpu/) on every visible GPU; skips without one
	$(PY) -m pytest -m gpu $(ARGS)

lint: install ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install ## ruff auto-fix and format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

.PHONY: prepare
prepare: install ## prepare a dataset on disk ahead of training: make prepare ARGS="data=tokens data.source='texts/*.txt'"
	$(PY) -m mlproject.prepare $(OVERRIDES)

.PHONY: plan submit submit-dryrun
plan: install ## memory per rank of each layout, and the one to use: make plan ARGS="experiment=gpt_large trainer.num_nodes=8"
	$(PY) -m mlproject.plan $(OVERRIDES)

submit: install ## submit training to SLURM (plans first; ARGS="--no-plan ..." skips it): make submit ARGS="cluster.nodes=2 trainer=gpu"
	$(PY) -m mlproject.submit $(OVERRIDES)

submit-dryrun: install ## print the sbatch script `make submit` would submit, without submitting
	$(PY) -m mlproject.submit --dry-run $(OVERRIDES)

.PHONY: rename
rename: ## turn a plain clone into your project: make rename NAME=my_project [EXAMPLES=digits] (see README)
	@test -n "$(NAME)" || { echo "error: give the package name, e.g. make rename NAME=my_project" >&2; exit 2; }
	python3 scripts/rename_project.py $(NAME) $(if $(EXAMPLES),--examples=$(EXAMPLES))

clean: ## remove logs, caches and build files (keeps .venv; `rm -rf .venv` for a full reset)
	rm -rf logs outputs multirun .pytest_cache .ruff_cache build src/*.egg-info
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

.PHONY: cv
cv: install ## cross-validate: make cv ARGS="experiment=digits data.folds=5" runs every fold as one sweep (or seed=1,2,3); cv.json in the sweep dir
	k=$$(printf '%s\n' $(OVERRIDES) | sed -n 's/^data\.folds=\([0-9][0-9]*\)$$/\1/p' | tail -n 1); \
	$(PY) -m mlproject.train -m $${k:+"data.fold=range(0,$$k)"} $(OVERRIDES)
