"""Turn a copy of the template into your project: rename the package everywhere, drop unwanted examples and features.

    python scripts/rename_project.py my_project [--examples digits] [--features slurm,wandb] [--project-name ...]

The one step behind `make rename NAME=...`, copier's task and cookiecutter's hook, so all three give the
same tree. It is deterministic and idempotent because `copier update` replays it on the old and the new
template version and merges the difference: renaming an already renamed tree changes nothing, and a
freshly rendered template package is merged into the renamed one. Standard library only: it runs
before anything is installed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import keyword
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

# Not walked outside git: version control, environments, run outputs, caches, the old install's metadata.
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "logs", "outputs", "multirun", "wandb", "__pycache__"}
SKIP_SUFFIXES = (".egg-info", "_cache")
# The template's own starter machinery, meaningless in a project made from it, its development log of
# measurements (benchmarks/README.md, how to measure, goes along) and its test-speed infrastructure.
TEMPLATE_ONLY = (
    "copier.yml",
    ".copier-answers.yml.jinja",
    "starters",
    "tests/test_starter.py",
    "benchmarks/RESULTS.md",
    ".github/workflows/projects.yml",  # CI of the projects the template generates
    "tests/helpers/warm.py",  # the template's test speed-up: a project's tests run as its users' processes do
    "tests/test_warm.py",
)
# copier's record of the template's address and version: renaming in it would break `copier update`.
ANSWERS_FILE = ".copier-answers.yml"
# Markdown between these lines is about the template itself (e.g. how to start a project from it).
TEMPLATE_ONLY_BLOCK = re.compile(r"^<!-- template-only -->\n.*?^<!-- /template-only -->\n", re.M | re.S)
ENTRY_CONFIGS = ("configs/train.yaml", "configs/eval.yaml")


@dataclass(frozen=True)
class Example:
    paths: tuple[str, ...]  # globs relative to the project root; {pkg} is the package name
    defaults: dict[str, str]  # the entry configs' defaults (group -> option) when this example is the default
    # How README, docs and config comments name this example; aligned across examples by key. Where an
    # example is dropped, each phrase becomes the same-keyed phrase of the kept default example.
    prose: dict[str, str]
    extras: tuple[str, ...] = ()  # pyproject extras only this example needs: they go with it


# Tests that prove a feature on both examples go with either (they import both examples' test helpers).
BOTH = (
    "tests/distributed/test_bf16.py",
    "tests/gpu/test_gpu.py",
    "tests/test_plan.py",
    "tests/test_search_spaces.py",  # one example's search space for the other's model
    "tests/checkpoint/test_trust.py",  # a GPT checkpoint refused by the digits model
    "tests/data/test_trust_data.py",  # label checks of the digits and images, shard checks of the tokens
)
# Add an example's files here when you add them, so that dropping the example drops them too
# (tests/test_starter.py fails when a kept file still imports a dropped module).
EXAMPLES = {
    "digits": Example(
        paths=(
            "src/{pkg}/data/digits.py",
            "src/{pkg}/data/images.py",  # an image folder, with the digits written as PNGs
            "src/{pkg}/models/classifier.py",
            "src/{pkg}/models/components/cnn.py",
            "configs/data/digits.yaml",
            "configs/data/images.yaml",
            "tests/data/test_images.py",
            "configs/model/digits.yaml",
            "configs/experiment/digits*.yaml",
            "configs/hparams_search/digits.yaml",
            "tests/test_sweep.py",  # sweeps, pruning and k-fold, proven on digits trials
            "tests/cluster/test_slurm_sweep.py",
            "tests/**/test_*digits*.py",
            "tests/test_train.py",  # the shipped default run: >= 95% on digits
            "tests/distributed/test_exact_eval.py",  # exact evaluation, proven on digits splits
            "tests/distributed/eval_worker.py",
            "tests/distributed/conftest.py",  # strategies against a single process, on the digits CNN
            "tests/distributed/test_ddp.py",
            "tests/distributed/test_deepspeed.py",
            "tests/distributed/test_fsdp_any_model.py",  # FSDP/HSDP without a plan, with SyncBN, on the digits CNN
            "notebooks/inspect_run.ipynb",  # confusion matrix of a classifier run
            "tests/test_notebook.py",
            "tests/test_lr_schedule.py",  # the LR schedule of a real digits run
            "tests/test_add_your_own.py",  # the README's walkthrough copies the digits files
            "tests/test_move_in.py",  # an LHT project beside the digits example's configs
            *BOTH,
        ),
        defaults={"data": "digits", "model": "digits"},
        prose={
            "run": "the digits CNN (~15 s on 2 CPU cores, ~99% test accuracy)",
            "recipe": "the digits CNN, wider and longer",
            "data": "the 1,797 handwritten digits that ship with scikit-learn",
            "data_file": "data/digits.py",
            "data_config": "data/digits.yaml",
            "model_config": "model/digits.yaml",
            "experiment_file": "experiment/digits.yaml",
            "experiment": "experiment=digits",
            "search": "hparams_search=digits",
            "search_file": "hparams_search/digits.yaml",
            "prepare": 'ARGS="data=images"',
            "plan": 'ARGS="experiment=digits trainer.num_nodes=8"',
        },
    ),
    "gpt": Example(
        paths=(
            "src/{pkg}/models/gpt.py",
            "src/{pkg}/models/components/gpt.py",
            "src/{pkg}/models/components/moe.py",  # model=gpt_moe's experts
            "src/{pkg}/data/text.py",
            "src/{pkg}/data/tokens.py",  # a token corpus on disk, for the GPT
            "configs/data/text.yaml",
            "configs/data/tokens.yaml",
            "tests/data/test_tokens.py",
            "configs/model/gpt*.yaml",
            "configs/experiment/gpt*.yaml",
            "configs/hparams_search/gpt.yaml",
            "tests/**/test_*gpt*.py",
            "tests/distributed/test_model_parallel.py",  # FSDP / TP against a single process, on the GPT
            "tests/helpers/gpt.py",  # the tiny GPT of the strategy proofs
            "tests/distributed/test_pipeline.py",  # pipeline parallelism against a single process, on the GPT
            "tests/distributed/test_collectives.py",  # per-step collectives counted under ddp and fsdp (GPT)
            "tests/distributed/test_ema.py",  # EMA under fsdp, on the GPT
            "tests/test_compile.py",  # compile per block under fsdp, on the GPT
            "tests/test_throughput.py",  # tokens/s and MFU of the GPT
            "tests/distributed/test_moe.py",  # MoE and expert parallelism against a single process
            "tests/test_moe.py",
            "tests/checkpoint/test_sharded.py",  # sharded (FSDP) checkpoints, on the GPT
            "tests/checkpoint/test_reshard_memory.py",  # what each rank reads when resuming, on a larger GPT
            "tests/distributed/test_transformer_moves_in.py",  # a nanoGPT-shaped project on the GPT's text data
            "tests/fixtures/nanogpt",
            "notebooks/*gpt*",
            "scripts/gpu_check.py",  # every strategy on the GPUs, on the GPT's recipes
            "benchmarks/checkpoint_blocking.py",  # how long a save holds the loop, on the GPT
            *BOTH,
        ),
        defaults={"data": "text", "model": "gpt"},
        prose={
            "run": "a small GPT on Python's documentation (a few minutes on 2 CPU cores)",
            "recipe": "a small GPT on text",
            "data": "Python's own documentation that ships with every CPython",
            "data_file": "data/text.py",
            "data_config": "data/text.yaml",
            "model_config": "model/gpt.yaml",
            "experiment_file": "experiment/gpt.yaml",
            "experiment": "experiment=gpt",
            "search": "hparams_search=gpt",
            "search_file": "hparams_search/gpt.yaml",
            "prepare": "ARGS=\"data=tokens data.source='texts/*.txt'\"",
            "plan": 'ARGS="experiment=gpt_large trainer.num_nodes=8"',
        },
        extras=("tokens",),
    ),
}


@dataclass(frozen=True)
class Feature:
    paths: tuple[str, ...]  # globs of the files that are this feature's alone: they go when it is left out
    extras: tuple[str, ...] = ()  # pyproject extras it needs; one goes (with its locked packages) when no kept
    # feature needs it


# What a project may leave out. Code, configs, tests and docs that several features share mark a feature's lines
# with whole-line comments, `# feature: NAME` ... `# /feature: NAME` (`<!-- ... -->` in Markdown; `NAME, NAME`:
# kept when either is; an example's name marks what only that example's docs say): a left-out feature's lines go, a
# kept one's markers go. Nothing the template runs reads them.
FEATURES = {
    "slurm": Feature(
        paths=(
            "src/{pkg}/cluster/slurm*.py",  # the sbatch script and checks; Requeue, SLURM's side of the signals
            "configs/cluster/slurm.yaml",
            "configs/hydra/launcher/slurm.yaml",  # sweeps' trials as SLURM jobs
            "tests/cluster/conftest.py",  # a real SLURM on this host
            "tests/cluster/test_ci_rule.py",
            "tests/cluster/test_slurm*.py",
            "tests/cluster/test_submit.py",
            "docs/slurm.md",
        ),
        extras=("slurm",),
    ),
    "kubernetes": Feature(
        paths=(
            "src/{pkg}/cluster/kubernetes.py",
            "configs/cluster/kubernetes.yaml",
            "tests/cluster/test_kubernetes*.py",
            "tests/cluster/kubeflow_crds",
            "docs/kubernetes.md",
            "Dockerfile",  # the pods' image
            ".dockerignore",
        ),
    ),
    "sweeps": Feature(  # Optuna studies, and trials in parallel processes (submitit's local launcher)
        paths=(
            "src/hydra_plugins",
            "src/{pkg}/callbacks/pruning.py",
            "configs/hparams_search",
            "configs/hydra/sweeper",
            "configs/hydra/launcher/local.yaml",
            "tests/test_sweep.py",
            "tests/test_search_spaces.py",
            "tests/test_study_sweeper.py",
            "tests/cluster/test_slurm_sweep.py",
        ),
        extras=("optuna", "slurm"),
    ),
    "wandb": Feature(
        paths=("src/{pkg}/loggers/wandb.py", "configs/logger/wandb.yaml", "tests/helpers/wandb_records.py"),
        extras=("wandb",),
    ),
    "mlflow": Feature(paths=("src/{pkg}/loggers/mlflow.py", "configs/logger/mlflow.yaml"), extras=("mlflow",)),
    "deepspeed": Feature(  # strategy=deepspeed_stage_*: ZeRO 1/2/3, its CPU shims and its checkpoints
        paths=(
            "src/{pkg}/distributed/zero.py",
            "src/{pkg}/checkpoint/zero_shards.py",
            "configs/strategy/deepspeed*.yaml",
            "tests/distributed/test_deepspeed*.py",
            "tests/checkpoint/test_deepspeed.py",
        ),
        extras=("deepspeed",),
    ),
    "tensor": Feature(  # strategy=tp, fsdp_tp: each block's layers split over a group of ranks (Megatron-style)
        paths=("configs/strategy/tp.yaml", "configs/strategy/fsdp_tp.yaml"),
    ),
    "expert": Feature(  # strategy.expert_parallel_size: an MoE layer's experts split over the ranks of a shard group
        paths=("src/{pkg}/distributed/experts.py",),
    ),
    "pipeline": Feature(  # strategy=pp: the model's blocks split into stages over groups of ranks, on a schedule
        paths=("src/{pkg}/distributed/pipeline.py", "configs/strategy/pp.yaml", "tests/distributed/test_pipeline.py"),
    ),
    "object_storage": Feature(  # checkpoints under an s3:// paths.ckpt_dir, through fsspec and s3fs
        paths=(
            "src/{pkg}/checkpoint/object_storage.py",
            "tests/checkpoint/conftest.py",  # the S3 endpoint: moto's server
            "tests/checkpoint/test_s3*.py",
        ),
        extras=("s3",),
    ),
    "planner": Feature(  # make plan: memory per rank of each layout; runs and jobs refused before they cannot fit
        paths=("src/{pkg}/plan.py", "tests/test_plan.py", "tests/test_preflight_memory_gpt.py", "docs/planning.md"),
    ),
}
# --machinery=package: the project owns its models, data, configs and tests; the rest of src/ (train, eval, strategies,
# checkpoints, ...) is the template's package, a pinned dependency as litgpt's and torchtitan's users have theirs,
# proven by the template's own suite. It comes as a wheel in vendor/ (the locks find it there, by its hash) until
# you publish it to an index of yours. --machinery=source keeps it all in src/, yours to edit, with its proofs.
MACHINERY_MODES = ("source", "package")
OWN = ("models", "data")  # of src/<package>/: what a package-mode project keeps
VENDOR = "vendor"
PROJECT_TESTS = (  # what proves the project, not the machinery: a package-mode project keeps these
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/helpers/**",
    "tests/checkpoint/__init__.py",
    "tests/checkpoint/helpers.py",  # train, kill and compare: the resume proofs below use them
    "tests/fixtures/**",
    "tests/data/**",  # the examples' data
    "tests/gpu/**",  # make test-gpu, on the project's recipes
    "tests/test_train.py",
    "tests/test_configs.py",
    "tests/test_docs.py",
    "tests/test_errors.py",
    "tests/test_add_your_own.py",  # a plain module and datamodule under every strategy, resumed, evaluated
    "tests/test_readme.py",
    "tests/test_first_day.py",
    "tests/test_make.py",
    "tests/test_lock.py",
    "tests/test_ci.py",
    "tests/test_lr_schedule.py",
    "tests/test_notebook.py",
)
MARKER = re.compile(r"^[ \t]*(?:#|<!--)[ \t]*(/?)feature:[ \t]*([\w, ]+?)[ \t]*(?:-->)?[ \t]*$")
LOCKS = "requirements*.lock"


def fail(msg: str) -> None:
    print(f"rename_project: {msg}", file=sys.stderr)
    raise SystemExit(2)


def project_files(root: Path) -> list[Path]:
    """The project's files: git's view (tracked or not ignored) at a repository's top, else all outside SKIP_DIRS.

    Git's view keeps an update from reading a large git-ignored data folder; the walk is for a fresh copy.
    """
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, check=True)
        if Path(top.stdout.decode().strip()).resolve() == root:
            out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True)
            return [root / f for f in sorted(set(out.stdout.decode().split("\0"))) if f and (root / f).is_file()]
    files = []
    for top, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.endswith(SKIP_SUFFIXES))
        files += [Path(top, n) for n in sorted(names)]
    return files


def old_package(root: Path, new: str) -> str | None:
    """The package in src/ that is not yet called `new` (None: already renamed)."""
    others = sorted(p.parent.name for p in (root / "src").glob("*/__init__.py") if p.parent.name != new)
    if len(others) > 1:
        fail(f"several packages in src/ ({', '.join(others)}); keep only the one to rename")
    return others[0] if others else None


def rename(root: Path, old: str, new: str) -> None:
    """old -> new and OLD -> NEW (env var prefixes) in every text file and every path."""
    emptied = set()
    for path in project_files(root):
        if path.is_symlink() or path.name == ANSWERS_FILE:
            continue
        data = path.read_bytes()
        if b"\0" not in data and (old.encode() in data or old.upper().encode() in data):
            with contextlib.suppress(UnicodeDecodeError):  # not text: left alone
                path.write_text(data.decode().replace(old, new).replace(old.upper(), new.upper()))
        rel = path.relative_to(root)
        if old in str(rel):
            target = root / Path(*(part.replace(old, new) for part in rel.parts))
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)  # overwrites: the freshly rendered template file wins, as copier update expects
            emptied.update(root / parent for parent in rel.parents if old in str(parent))
    for path in sorted(emptied, key=lambda p: -len(p.parts)):
        shutil.rmtree(path / "__pycache__", ignore_errors=True)
        if path.exists() and not any(path.iterdir()):
            path.rmdir()


def build_machinery_wheel(root: Path, pkg: str, sweeps: bool) -> Path:
    """src/<pkg>/ without the user's modules (OWN), and with sweeps the Hydra plugins, as a wheel in vendor/.

    Standard library only (this runs before anything is installed) and byte-for-byte reproducible (sorted entries,
    fixed times), so the locks' hash of it holds for every replay by `copier update`."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        fail("--machinery=package reads pyproject.toml with tomllib: run this with Python 3.11 or later")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    requires = [f"Requires-Dist: {r}" for r in project["dependencies"]]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        requires += [f"Provides-Extra: {extra}", *(f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs)]
    files = [
        p for p in sorted((root / "src" / pkg).rglob("*.py")) if p.relative_to(root / "src" / pkg).parts[0] not in OWN
    ]
    files += [p for p in (root / "src").glob(f"hydra_plugins/{pkg}_*/*.py") if sweeps]
    entries = [(str(p.relative_to(root / "src")), p.read_bytes()) for p in sorted(files)]
    # The version names the content (as torch's +cpu names a build): a template update changes it, so pip replaces
    # the installed machinery instead of keeping the old one as "already satisfied"; pyproject's ==X.Y.Z matches it.
    content = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in entries)).hexdigest()
    version = f"{project['version']}+{content[:8]}"
    dist = f"{pkg}-{version}.dist-info"
    entries += [
        (
            f"{dist}/METADATA",
            "\n".join(
                [
                    "Metadata-Version: 2.1",
                    f"Name: {pkg}",
                    f"Version: {version}",
                    f"Requires-Python: {project['requires-python']}",
                    *requires,
                    "",
                ]
            ).encode(),
        ),
        (f"{dist}/WHEEL", b"Wheel-Version: 1.0\nGenerator: rename_project\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
    ]

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in entries) + f"{dist}/RECORD,,\n"
    wheel = root / VENDOR / f"{pkg}-{version}-py3-none-any.whl"
    wheel.parent.mkdir(exist_ok=True)
    for stale in wheel.parent.glob(f"{pkg}-*.whl"):
        stale.unlink()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in [*entries, (f"{dist}/RECORD", record.encode())]:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, zipfile.ZIP_DEFLATED)
    return wheel


def keep_own(root: Path, old: str, new: str) -> None:
    """The package-mode rename: the user's modules (OWN) move to src/<new>/ and every reference to them follows;
    the project's name changes in pyproject.toml and the locks; every other `old` names the machinery, which
    keeps its name as a dependency. The machinery's source and tests leave the project."""
    # src/old/models/..., old.data, src/old/ itself; the project's names: its image (registry/old:tag), W&B project
    own = re.compile(rf"(?<=project: ){old}\b|\b{old}(?=[./](?:{'|'.join(OWN)})\b|/(?![\w.])|:)")
    for path in project_files(root):
        rel = path.relative_to(root)
        if path.is_symlink() or path.name == ANSWERS_FILE:
            continue
        machinery = rel.parts[:2] == ("src", "hydra_plugins") or (
            rel.parts[:2] == ("src", old) and rel.parts[2] not in (*OWN, "__init__.py")
        )
        if machinery or (rel.parts[0] == "tests" and not any(fnmatch(str(rel), g) for g in PROJECT_TESTS)):
            path.unlink()
            continue
        data = path.read_bytes()
        if b"\0" not in data and old.encode() in data:
            with contextlib.suppress(UnicodeDecodeError):
                text = data.decode()
                if path.name == "pyproject.toml" or path.match(LOCKS):  # the project's own name
                    text = re.sub(rf'^name = "{old}"', f'name = "{new}"', text, flags=re.M)
                    text = text.replace(f'"{old}[', f'"{new}[').replace(
                        f"{old} (pyproject.toml)", f"{new} (pyproject.toml)"
                    )
                path.write_text(own.sub(new, text))
        if rel.parts[:2] == ("src", old):
            target = root / "src" / new / Path(*rel.parts[2:])
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)
    for top in (root / "src" / old, root / "src" / "hydra_plugins", root / "tests"):  # the folders left empty
        folders = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if top.exists() else []
        for folder in [*folders, top]:
            shutil.rmtree(folder / "__pycache__", ignore_errors=True)
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def depend_on_machinery(root: Path, pkg: str, wheel: Path) -> None:
    """pyproject.toml requires the machinery at its version, and each lock pins it by the wheel's hash (the Makefile
    finds it in vendor/)."""
    name, version = wheel.name.split("-")[:2]
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    if f'"{name}==' not in text:
        release = version.split("+")[0]  # the locks pin the build (+content)
        pin = f'    "{name}=={release}",  # the machinery: {VENDOR}/, or your index once published\n'
        pyproject.write_text(text.replace("dependencies = [\n", "dependencies = [\n" + pin, 1))
    entry = f"{name}=={version} \\\n    --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n"
    entry += f"    # via {pkg} (pyproject.toml)"
    docker = root / "Dockerfile"  # the pods' image: the wheel is there before the lock is installed
    install = "COPY ${LOCK} /tmp/requirements.lock\n"
    if docker.exists() and install in (text := docker.read_text()) and VENDOR not in text:
        docker.write_text(
            text.replace(install, f"{install}COPY {VENDOR} /tmp/{VENDOR}\nENV PIP_FIND_LINKS=/tmp/{VENDOR}\n")
        )
    for lock in sorted(root.glob(LOCKS)):
        lines = lock.read_text().rstrip("\n").split("\n")
        header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]  # uv's comment
        body = "\n".join(lines[len(header) :])
        blocks = [b for b in re.split(r"\n(?=[A-Za-z0-9])", body) if not b.startswith(f"{name}==")] + [entry]
        blocks.sort(key=lambda b: canonical(b.split("==")[0]))
        lock.write_text("\n".join([*header, *blocks]) + "\n")


def present(root: Path, pkg: str, example: Example | Feature) -> bool:
    return any(any(root.glob(p.format(pkg=pkg))) for p in example.paths)


def kept_examples(root: Path, pkg: str, keep: list[str]) -> list[str]:
    """The examples to keep that this template has; refuses none (train.yaml needs a default)."""
    unknown = sorted(set(keep) - set(EXAMPLES))
    if unknown:
        fail(f"unknown example(s) {', '.join(unknown)}; choose from {', '.join(EXAMPLES)}")
    kept = [name for name in keep if present(root, pkg, EXAMPLES[name])]
    if not kept:
        have = [name for name, example in EXAMPLES.items() if present(root, pkg, example)]
        fail(f"keep at least one example this template has ({', '.join(have)}): train.yaml needs a default")
    return kept


def drop_examples(root: Path, pkg: str, kept: list[str]) -> None:
    for name, example in EXAMPLES.items():
        if name in kept:
            continue
        for pattern in example.paths:
            for path in sorted(root.glob(pattern.format(pkg=pkg))):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        # The entry configs' defaults point at the first kept example instead.
        for entry in ENTRY_CONFIGS:
            path = root / entry
            if path.exists():
                text = path.read_text()
                for group, option in example.defaults.items():
                    default = EXAMPLES[kept[0]].defaults[group]
                    text = re.sub(rf"^(\s*- {group}: ){option}\b", rf"\g<1>{default}", text, flags=re.M)
                path.write_text(text)


def retell(root: Path, kept: list[str]) -> None:
    """Prose (Markdown, config comments, make's help) names the kept default example where it named a dropped one."""
    default = EXAMPLES[kept[0]].prose
    phrases = {p: default[k] for name, ex in EXAMPLES.items() if name not in kept for k, p in ex.prose.items()}
    for path in project_files(root):
        if path.suffix in (".md", ".yaml") or path.name == "Makefile":
            text = path.read_text()
            for phrase in sorted(phrases, key=len, reverse=True):  # whole phrases: not gpt of `experiment=gpt_124m`
                text = re.sub(rf"{re.escape(phrase)}(?![\w-])", lambda _, p=phrase: phrases[p], text)
            path.write_text(text)


TABLE_REFERENCE = re.compile(r"([,;] )?`([^`\s:]+)(::[^`]*)?`")


def prune_table_references(root: Path, removed: set[str]) -> None:
    """In Markdown tables, a cell's `file` reference to a file this step removed goes with it (a whole-line marker
    would end the table); a cell left empty reads "-"."""
    names = removed | {Path(rel).name for rel in removed}
    for path in project_files(root):
        if path.suffix != ".md":
            continue
        lines = path.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            pruned = TABLE_REFERENCE.sub(lambda m: "" if m.group(2) in names else m.group(0), line)
            if line.startswith("|") and pruned != line:
                lines[i] = re.sub(r"\|(\s*\|)", r"| -\1", re.sub(r"\| [,;] ", "| ", pruned))
        path.write_text("".join(lines))


def kept_features(keep: list[str]) -> list[str]:
    unknown = sorted(set(keep) - set(FEATURES))
    if unknown:
        fail(f"unknown feature(s) {', '.join(unknown)}; choose from {', '.join(FEATURES)}")
    return [name for name in FEATURES if name in keep]


def keep_feature_lines(text: str, kept: list[str], where: str) -> str:
    """`text` without the lines marked for a left-out feature or example, and without the markers."""
    lines, open_blocks = [], []
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        marker = MARKER.match(line)
        if not marker:
            if all(set(names) & set(kept) for names in open_blocks):
                lines.append(line)
            continue
        names = [name.strip() for name in marker.group(2).split(",")]
        if unknown := sorted(set(names) - set(FEATURES) - set(EXAMPLES) - set(MACHINERY_MODES)):
            fail(
                f"{where}:{n}: unknown feature {', '.join(unknown)} (FEATURES or EXAMPLES in scripts/rename_project.py)"
            )
        if not marker.group(1):
            open_blocks.append(names)
        elif not open_blocks or open_blocks.pop() != names:
            fail(f"{where}:{n}: closes feature {', '.join(names)}, which is not the open block")
    if open_blocks:
        fail(f"{where}: feature {', '.join(open_blocks[-1])} is never closed")
    kept_text = "".join(lines)
    return kept_text.rstrip("\n") + "\n" if text.endswith("\n") and kept_text.strip() else kept_text  # no blank tail


def drop_features(root: Path, pkg: str, kept: list[str], examples: list[str], machinery: str = "source") -> None:
    """Remove left-out features' files and marked lines (and those of the other machinery mode), their (and dropped
    examples') pyproject extras and the packages only those need."""
    for name, feature in FEATURES.items():
        for pattern in feature.paths if name not in kept else ():
            for path in sorted(root.glob(pattern.format(pkg=pkg))):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in project_files(root):
        data = path.read_bytes()
        if b"feature:" in data and b"\0" not in data:
            text = data.decode()
            if (
                kept_text := keep_feature_lines(text, [*kept, *examples, machinery], str(path.relative_to(root)))
            ) != text:
                path.write_text(kept_text)
            if not kept_text.strip():  # every line marked (e.g. what two features share): it goes with them
                path.unlink()
    kept_owners = [FEATURES[name] for name in kept] + [EXAMPLES[name] for name in examples]
    needed = {extra for owner in kept_owners for extra in owner.extras}
    dropped = {extra for owner in [*FEATURES.values(), *EXAMPLES.values()] for extra in owner.extras} - needed
    pyproject = root / "pyproject.toml"
    if pyproject.exists():  # also when only marked lines went (a feature's dev requirements)
        text = pyproject.read_text()
        for extra in dropped:
            text = re.sub(rf"^{re.escape(extra)} = \[.*\n", "", text, flags=re.M)

        def without_dropped(ref: re.Match) -> str:  # "pkg[wandb,s3]" -> "pkg[s3]"; none left: the reference goes
            extras = [e for e in ref.group(1).split(",") if e.strip() not in dropped]
            return f'"{pkg}[{",".join(extras)}]"' if extras else ""

        text = re.sub(rf'"{re.escape(pkg)}\[([^\]]*)\]"', without_dropped, text)
        pyproject.write_text(text)
        for lock in sorted(root.glob(LOCKS)):
            prune_lock(lock, text)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
VIA = re.compile(rf"^\s+#\s+(?:via\s+)?({NAME})", re.M)  # uv's `# via x` or, one a line, `#   x`
REQUIREMENT = re.compile(rf'"({NAME})\s*(?:\[[^\]]*\])?\s*(?:[<>=!~;][^"]*)?"')  # a quoted one in pyproject


def prune_lock(lock: Path, pyproject: str) -> None:
    """Keep the pins that pyproject's remaining requirements reach through uv's `# via` lines: the lock stays
    hash-checked and in step with pyproject without a resolver (or the network) at generation time."""
    header, *blocks = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    names = [canonical(re.match(NAME, block).group()) for block in blocks]
    via = {name: {canonical(v) for v in VIA.findall(block)} for name, block in zip(names, blocks, strict=True)}
    required = {canonical(r) for r in REQUIREMENT.findall(pyproject)}
    project = canonical(re.search(r'^name = "([^"]+)"', pyproject, re.M).group(1))
    needed, todo = set(), [name for name in names if project in via[name] and name in required]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo += [n for n in names if name in via[n]]
    gone = set(names) - needed

    def still_needed_by(line: str) -> bool:  # a `#   x` line naming a package that went
        return not re.fullmatch(rf"\s+#\s+{NAME}", line) or canonical(line.split()[-1]) not in gone

    kept = [
        "\n".join(filter(still_needed_by, block.split("\n")))
        for name, block in zip(names, blocks, strict=True)
        if name in needed
    ]
    lock.write_text("\n".join([header, *kept]))


def strip_template_only(root: Path) -> None:
    for path in project_files(root):
        if path.suffix == ".md":
            text = path.read_text()
            if TEMPLATE_ONLY_BLOCK.search(text):
                path.write_text(TEMPLATE_ONLY_BLOCK.sub("", text))


def set_metadata(root: Path, project_name: str, description: str, author: str, license: str) -> None:
    """pyproject's description, licence and authors; README's title, and the description under it (where the
    template's introduction was)."""

    def toml(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    path = root / "pyproject.toml"
    text = path.read_text()
    lines = {  # a function as replacement: re.sub would read the backslashes in a value as escapes
        r"^description = .*$": description and f"description = {toml(description)}",
        r"^license = .*$": license and f"license = {{ text = {toml(license)} }}",
        r"^authors = .*$": author and f"authors = [{{ name = {toml(author)} }}]",
    }
    if author and not re.search(r"^authors = ", text, flags=re.M):
        text = re.sub(r"^(license = .*)$", r"\1\nauthors = []", text, count=1, flags=re.M)
    for pattern, line in lines.items():
        if line:
            text = re.sub(pattern, lambda _, line=line: line, text, count=1, flags=re.M)
    path.write_text(text)
    readme = root / "README.md"
    if readme.exists():
        text = readme.read_text()
        if project_name:
            text = re.sub(r"\A# .*$", lambda _: f"# {project_name}", text, count=1, flags=re.M)
        title, _, rest = text.partition("\n\n")
        rest = rest.lstrip("\n")  # the template's introduction (template-only) leaves a blank line
        if description and not rest.startswith(description):
            rest = f"{description}\n\n{rest}"
        readme.write_text(f"{title}\n\n{rest}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the new package name: a lower-case Python identifier, e.g. my_project")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the project to change (default: here)")
    parser.add_argument("--examples", default=",".join(EXAMPLES), help=f"comma-separated, of {', '.join(EXAMPLES)}")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"comma-separated, of {', '.join(FEATURES)}")
    parser.add_argument(
        "--machinery",
        choices=MACHINERY_MODES,
        default="source",
        help="source: all of src/ stays yours to edit; package: keep models/ and data/, and depend on the rest",
    )
    parser.add_argument("--project-name", default="", help="human-readable name: README title")
    parser.add_argument("--description", default="", help="one line for pyproject.toml and under README's title")
    parser.add_argument("--author", default="", help="pyproject.toml's author")
    parser.add_argument("--license", default="", help="pyproject.toml's licence, e.g. MIT")
    args = parser.parse_args(argv)
    root, new = args.root.resolve(), args.name
    if not re.fullmatch(r"[a-z][a-z0-9_]*", new) or keyword.iskeyword(new):
        fail(f"{new!r} is not a lower-case Python identifier (letters, digits, _), e.g. my_project")
    if not (root / "src").is_dir():
        fail(f"{root} has no src/ folder; run this from the project root or pass --root")
    old = old_package(root, new)
    if old is not None and old in new:
        fail(f"{new!r} contains the old name {old!r}, which would stay in every file; choose another")
    kept = kept_examples(root, old or new, [e.strip() for e in args.examples.split(",") if e.strip()])
    features = kept_features([f.strip() for f in args.features.split(",") if f.strip()])
    for rel in TEMPLATE_ONLY:
        path = root / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    strip_template_only(root)
    package = args.machinery == "package"
    # a package-mode project renamed again has no machinery in src/ to build: its wheel and pins stay
    build = package and old is not None and (root / "src" / old / "train.py").is_file()
    wheel = build_machinery_wheel(root, old, sweeps="sweeps" in features) if build else None
    if old is not None:
        (keep_own if package else rename)(root, old, new)
    before = {str(p.relative_to(root)) for p in project_files(root)}
    drop_examples(root, new, kept)
    drop_features(root, new, features, kept, args.machinery)
    if wheel is not None:
        depend_on_machinery(root, new, wheel)
    prune_table_references(root, before - {str(p.relative_to(root)) for p in project_files(root)})
    retell(root, kept)
    set_metadata(root, args.project_name, args.description, args.author, args.license)
    chosen = f"examples {', '.join(kept)}, features {', '.join(features) or 'none'}"
    print(f"rename_project: package {new}, {chosen}" + (f" (was {old})" if old else ""))


if __name__ == "__main__":
    main()
