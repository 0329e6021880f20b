"""Turn a copy of the template into your project: rename the package everywhere and drop unwanted examples.

    python scripts/rename_project.py my_project [--examples digits] [--project-name ...] [--author ...]

The one step behind `make rename NAME=...`, copier's task and cookiecutter's hook, so all three give the
same tree. It is deterministic and idempotent because `copier update` replays it on the old and the new
template version and merges the difference: renaming an already renamed tree changes nothing, and a
freshly rendered template package is merged into the renamed one. Standard library only: it runs
before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import keyword
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Not walked outside git: version control, environments, run outputs, caches, the old install's metadata.
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "logs", "outputs", "multirun", "wandb", "__pycache__"}
SKIP_SUFFIXES = (".egg-info", "_cache")
# The template's own starter machinery, meaningless in a project made from it, and its development log of
# measurements (benchmarks/README.md, how to measure, goes along).
TEMPLATE_ONLY = (
    "copier.yml",
    ".copier-answers.yml.jinja",
    "starters",
    "tests/test_starter.py",
    "benchmarks/RESULTS.md",
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
            "scripts/bench.py",  # template vs plain loop on the digits CNN
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
        },
    ),
}


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


def present(root: Path, pkg: str, example: Example) -> bool:
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
    """Prose (Markdown, config comments) names the kept default example where it named a dropped one."""
    default = EXAMPLES[kept[0]].prose
    phrases = {p: default[k] for name, ex in EXAMPLES.items() if name not in kept for k, p in ex.prose.items()}
    for path in project_files(root):
        if path.suffix in (".md", ".yaml"):
            text = path.read_text()
            for phrase in sorted(phrases, key=len, reverse=True):
                text = text.replace(phrase, phrases[phrase])
            path.write_text(text)


def strip_template_only(root: Path) -> None:
    for path in project_files(root):
        if path.suffix == ".md":
            text = path.read_text()
            if TEMPLATE_ONLY_BLOCK.search(text):
                path.write_text(TEMPLATE_ONLY_BLOCK.sub("", text))


def set_metadata(root: Path, project_name: str, description: str, author: str, license: str) -> None:
    """pyproject's description, licence and authors; README's title."""

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
    if project_name and readme.exists():
        text = re.sub(r"\A# .*$", lambda _: f"# {project_name}", readme.read_text(), count=1, flags=re.M)
        readme.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the new package name: a lower-case Python identifier, e.g. my_project")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the project to change (default: here)")
    parser.add_argument("--examples", default=",".join(EXAMPLES), help=f"comma-separated, of {', '.join(EXAMPLES)}")
    parser.add_argument("--project-name", default="", help="human-readable name: README title")
    parser.add_argument("--description", default="", help="one line for pyproject.toml")
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
    for rel in TEMPLATE_ONLY:
        path = root / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    strip_template_only(root)
    if old is not None:
        rename(root, old, new)
    drop_examples(root, new, kept)
    retell(root, kept)
    set_metadata(root, args.project_name, args.description, args.author, args.license)
    print(f"rename_project: package {new}, examples {', '.join(kept)}" + (f" (was {old})" if old else ""))


if __name__ == "__main__":
    main()
