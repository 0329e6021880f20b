"""README.md, docs/ and make's help name only what the project has: every `group=option` is a config of that group
and every file they point at exists, in the template and in each project made from it (where a left-out feature's
or example's paragraphs went with it)."""

from __future__ import annotations

import importlib
import itertools
import re
from pathlib import Path

import pytest

from mlproject.core.constants import CONFIG_DIR, PROJECT_ROOT

DOCS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md")), PROJECT_ROOT / "Makefile"]
GROUPS = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())
# `strategy=fsdp`, `strategy=deepspeed_stage_{1,2,3}` or `_*`; not `trainer.devices=2`
OPTION = re.compile(rf"(?<![\w./+-])({'|'.join(GROUPS)})=([A-Za-z_][\w-]*(?:\{{[\w,]+\}}|\*)?)")
FILE = re.compile(r"`([\w./-]+\.(?:py|yaml|md|ipynb|toml))`")
# The machinery's modules and the examples': in src/, or where the project depends on the machinery as a package
# (scripts/rename_project.py --machinery=package), the machinery in that package and the examples in src/
MACHINERY = Path(importlib.import_module("mlproject.core").__file__).parents[1]
OWN = Path(importlib.import_module("mlproject.models").__file__).parents[1]
PACKAGED = MACHINERY != OWN  # then the machinery's proofs (tests/...) are the template's suite
# Where a named file may live: the project, its package(s), its configs and docs, and the LHT project that
# docs/migrating.md moves in (tests/fixtures/lht).
FOLDERS = ("", str(MACHINERY), str(OWN), "configs", "docs", "tests/fixtures/lht", "tests/fixtures/lht/configs")
# Files a run or the user writes, not the project: named in docs, never shipped.
WRITTEN = {"configs/local/default.yaml"}


def expand(option: str) -> list[str]:  # deepspeed_stage_{1,2,3} -> deepspeed_stage_1, ..._2, ..._3
    head, _, rest = option.partition("{")
    return [head + alt for alt in rest.rstrip("}").split(",")] if rest else [option]


def exists(rel: str) -> bool:
    if PACKAGED and (rel.startswith("tests/") or re.fullmatch(r"test_\w+\.py", rel)):
        return True  # a proof of the machinery, in the template's suite
    rel = rel.removeprefix(f"src/{MACHINERY.name}/") if PACKAGED else rel
    if "/" not in rel:  # a bare file name (`test_resume.py`): anywhere in the project
        return any(itertools.islice(PROJECT_ROOT.glob(f"[!.]*/**/{rel}"), 1)) or (PROJECT_ROOT / rel).exists()
    return rel in WRITTEN or any((PROJECT_ROOT / folder / rel).exists() for folder in FOLDERS)


def option_exists(group: str, option: str) -> bool:
    return any(any((folder / group).glob(f"{option}.yaml")) for folder in (CONFIG_DIR, PROJECT_ROOT / FOLDERS[-1]))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_only_configs_and_files_the_project_has(doc):
    text = doc.read_text()
    theirs = doc.name == "migrating.md"  # also names the options and files of the project that moves in (LHT's)
    if theirs:
        text = re.sub(r"^\|.*\|$", "", text, flags=re.M)  # its tables: their file -> ours
    missing = [
        f"{doc.name}:{n}: {found}"
        for n, line in enumerate(text.splitlines(), 1)
        for found in [
            *(
                f"{g}={o}"
                for g, opt in OPTION.findall(line)
                for o in expand(opt)
                if not theirs and not option_exists(g, o)
            ),
            *(ref for ref in FILE.findall(line) if not exists(ref)),
        ]
    ]
    assert not missing, "\n".join(missing)
