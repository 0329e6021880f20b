# Every target uses the virtual environment in .venv/ and creates it when missing.
.DEFAULT_GOAL := help
SHELL := /bin/bash

VENV   ?= .venv
PY     := $(VENV)/bin/python
# Two locks, each file in them checked against its hash. LOCK is what running needs (pyproject's dependencies
# + the run extra): `make install` installs it, for train/eval/sweep/...
# feature: kubernetes
# The image (Dockerfile) installs it too.
# /feature: kubernetes
# DEV_LOCK adds the dev extra (tests, lint, notebooks): `make install-dev` installs it, for test/lint/format.
# `make lock` remakes both from pyproject.toml's ranges, DEV_LOCK constrained by LOCK, so every package in both
# has one pin; torch is pinned to the build TORCH names, found where your pip finds it or on TORCH_INDEX (then
# written into the locks, so installing needs no flag). DEV_LOCK is LOCK's name with -dev before .lock. For
# CUDA, locks of their own (requirements-cu128.lock and requirements-cu128-dev.lock):
#   make lock LOCK=requirements-cu128.lock TORCH=torch==2.13.0+cu128 TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   make install LOCK=requirements-cu128.lock    (or make install-dev LOCK=requirements-cu128.lock)
LOCK        ?= requirements.lock
DEV_LOCK    ?= $(LOCK:.lock=-dev.lock)
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?=
ARGS   ?=
# A project that depends on the machinery as a package (scripts/rename_project.py --machinery=package) has its
# wheel in vendor/ until you publish it to an index of yours: pip and uv look there too.
VENDOR := $(if $(wildcard vendor/*.whl),--find-links vendor)
# make test: pytest-xdist workers. Most tests run one single-threaded process at a time; 2 fill 2 cores.
TEST_WORKERS ?= 2
CKPT   ?=
OUT    ?= model.pt
# `make train trainer.max_epochs=3 '~logger'` works too: every form Hydra accepts (key=value, +key=value,
# ++key=value, group=[], ~group) passes on bare, in the order given, each quoted for the shell. Assignments reach
# make as variables (those that are not ours are overrides), `~group` as goals (the do-nothing rule `~%` below).
# On Linux the order comes from make's own arguments in /proc; elsewhere assignments come first (MAKEOVERRIDES
# lists them last first), then deletions. ARGS is for what make would read as its own: options such as
# `--multirun`, or `-m` (make takes -m as its own flag and ignores it). The shell splits ARGS.
OURS      = VENV LOCK DEV_LOCK TORCH TORCH_INDEX ARGS TEST_WORKERS CKPT OUT NAME EXAMPLES FEATURES MACHINERY
quote     = '$(subst ','\'',$(1))'
reverse   = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
CLI_NAMES = $(filter-out $(OURS),$(foreach w,$(call reverse,$(MAKEOVERRIDES)),$(if $(findstring =,$(w)),$(firstword $(subst =, ,$(w))))))
CLI_ARGV  = [ -r /proc/$$PPID/cmdline ] && while IFS= read -r -d '' a; do
IN_ORDER  = $(shell $(CLI_ARGV) case "$$a" in ('~'*) ;; (*=*) case ' $(CLI_NAMES) ' in (*" $${a%%=*} "*) ;; (*) continue;; esac;; \
              (*) continue;; esac; q=\'; printf "'%s' " "$${a//$$q/$$q\\$$q$$q}"; done < /proc/$$PPID/cmdline)
UNORDERED = $(foreach v,$(CLI_NAMES),$(if $(filter command line,$(origin $(v))),$(call quote,$(v)=$(value $(v))))) \
            $(foreach g,$(filter ~%,$(MAKECMDGOALS)),$(call quote,$(g)))
OVERRIDES = $(or $(strip $(IN_ORDER)),$(UNORDERED)) $(ARGS)
# `make train -m ...` would train once with -m lost: stop with the way to sweep instead.
DASH_M    = $(shell $(CLI_ARGV) [ "$$a" = -m ] && echo yes; done < /proc/$$PPID/cmdline)
no_dash_m = @$(if $(DASH_M),echo "error: make takes -m as its own flag: sweep with make sweep <overrides> (or make $@ ARGS=\"-m <overrides>\")" >&2; exit 2,:)

.PHONY: help install install-dev lock train sweep eval export test test-fast test-gpu lint format clean

help: ## show this help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes $(VENDOR) -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	$(PY) scripts/check_torch_family.py  # torchvision/torchaudio of another torch build: one line, not a traceback
	touch $@

install: $(VENV)/.installed ## create .venv and install what running needs (LOCK) and the package (idempotent)

# The dev lock holds every pin of the runtime lock (make lock constrains it so), so it installs alone; the two
# stamps are apart, and a venv with both is the dev one (installing the runtime lock there changes nothing).
$(VENV)/.installed-dev: pyproject.toml $(DEV_LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes $(VENDOR) -r $(DEV_LOCK)
	$(PY) -m pip install -q --no-deps -e .
	$(PY) scripts/check_torch_family.py
	touch $@

install-dev: $(VENV)/.installed-dev ## what install does, plus the tools for developing (DEV_LOCK: tests, lint, notebooks)

# uv reads no pip configuration: pip's find-links (a folder of local wheels, as this template's CI keeps
# torch in) are passed on, so the locks pin the files pip installs. The locks are for this Python version.
# torchvision and torchaudio are built for one torch build each: they come from torch's index (uv takes a
# package from the first index that has it, and TORCH_INDEX comes first), or from the find-links folder.
# The dev lock is compiled with the runtime lock as a constraint: a package both hold gets the same pin.
UV_COMPILE = $(VENV)/bin/uv pip compile pyproject.toml - --generate-hashes --quiet --python $(PY) \
  --custom-compile-command "make lock" $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
  $(if $(TORCH_INDEX),--index $(TORCH_INDEX) --emit-index-url) $(VENDOR)
lock: ## pin every dependency with its hashes into both locks, requirements.lock and requirements-dev.lock (see above)
	@! grep -Eq '^ *"(torchvision|torchaudio)' pyproject.toml || test -n "$(TORCH_INDEX)$(PIP_FIND_LINKS)" || { echo \
	  "error: torchvision/torchaudio must come from torch's index: make lock TORCH_INDEX=https://download.pytorch.org/whl/cpu (or .../cu128 with TORCH=torch==...+cu128)" >&2; exit 2; }
	@test "$(LOCK)" != "$(DEV_LOCK)" || { echo "error: LOCK must end in .lock (DEV_LOCK is its name with -dev)" >&2; exit 2; }
	test -x $(VENV)/bin/uv || $(MAKE) install-dev LOCK=requirements.lock DEV_LOCK=requirements-dev.lock  # uv comes with the dev extra
	echo '$(TORCH)' | $(UV_COMPILE) --extra run -o $(LOCK)
	echo '$(TORCH)' | $(UV_COMPILE) --extra dev --constraint $(LOCK) -o $(DEV_LOCK)

train: install ## train the default experiment; overrides bare or in ARGS: make train trainer.max_epochs=3 '~logger'
	$(no_dash_m)
	$(PY) -m mlproject.train $(OVERRIDES)

# feature: sweeps
# an Optuna study instead of every combination: make sweep hparams_search=digits
# /feature: sweeps
sweep: install ## a Hydra multirun, one run per combination: make sweep model.optimizer.lr=0.005,0.01
	$(PY) -m mlproject.train --multirun $(OVERRIDES)

# `~group` goals are Hydra deletions for the target before them (OVERRIDES passes them on), not files to make.
~%: ; @:

eval: install ## evaluate a checkpoint: make eval CKPT=path/to/last.ckpt [ARGS=...]
	@test -n $(call quote,$(value CKPT)) || { echo "error: give the checkpoint, e.g. make eval CKPT=logs/train/runs/<run_id>/checkpoints/last.ckpt" >&2; exit 2; }
	$(PY) -m mlproject.eval $(call quote,ckpt_path=$(value CKPT)) $(OVERRIDES)

export: install ## any checkpoint -> one plain state dict: make export CKPT=path/to/last.ckpt [OUT=model.pt]
	@test -n $(call quote,$(value CKPT)) || { echo "error: give the checkpoint, e.g. make export CKPT=logs/train/runs/<run_id>/checkpoints/last.ckpt" >&2; exit 2; }
	$(PY) -m mlproject.export $(call quote,ckpt_path=$(value CKPT)) $(call quote,out=$(value OUT)) $(OVERRIDES)

test: install-dev ## run the whole test suite
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-fast: install-dev ## the quick tests: all but those marked slow (multi-process training, long end-to-end runs)
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-gpu: install-dev ## the GPU acceptance suite (tests/gpu/) on every visible GPU; skips without one
	$(PY) -m pytest -m gpu $(ARGS)

lint: install-dev ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install-dev ## ruff auto-fix and format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

.PHONY: prepare
prepare: install ## prepare a dataset on disk ahead of training: make prepare ARGS="data=tokens data.source='texts/*.txt'"
	$(PY) -m mlproject.prepare $(OVERRIDES)

# feature: planner
.PHONY: plan
plan: install ## memory per rank of each layout, and the one to use: make plan ARGS="experiment=gpt_large trainer.num_nodes=8"
	$(PY) -m mlproject.plan $(OVERRIDES)
# /feature: planner

# feature: slurm, kubernetes
.PHONY: submit submit-dryrun
# feature: planner
# submit plans the job's memory first (make plan); ARGS="--no-plan ..." skips that
# /feature: planner
submit: install ## submit training to the cluster's scheduler: make submit ARGS="trainer=gpu cluster.gpus_per_node=8"
	$(PY) -m mlproject.submit $(OVERRIDES)

submit-dryrun: install ## print the job (the scheduler's script or manifest) `make submit` would submit
	$(PY) -m mlproject.submit --dry-run $(OVERRIDES)
# /feature: slurm, kubernetes

.PHONY: rename
rename: ## turn a plain clone into your project: make rename NAME=my_project [EXAMPLES=...] [FEATURES=...] [MACHINERY=package] (scripts/rename_project.py --help)
	@test -n "$(NAME)" || { echo "error: give the package name, e.g. make rename NAME=my_project" >&2; exit 2; }
	python3 scripts/rename_project.py $(NAME) $(if $(EXAMPLES),--examples=$(EXAMPLES)) $(if $(filter command line,$(origin FEATURES)),--features=$(FEATURES)) $(if $(MACHINERY),--machinery=$(MACHINERY))

clean: ## remove logs, caches and build files (keeps .venv; `rm -rf .venv` for a full reset)
	rm -rf logs outputs multirun .pytest_cache .ruff_cache build src/*.egg-info
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

.PHONY: cv
cv: install ## cross-validate: make cv ARGS="experiment=digits data.folds=5" runs every fold as one sweep (or seed=1,2,3); cv.json in the sweep dir
	k=$$(printf '%s\n' $(OVERRIDES) | sed -n 's/^data\.folds=\([0-9][0-9]*\)$$/\1/p' | tail -n 1); \
	$(PY) -m mlproject.train -m $${k:+"data.fold=range(0,$$k)"} $(OVERRIDES)
