"""Stop `make install` in one line when torchvision or torchaudio was built for another torch than the one installed.

Each of their wheels is built against one torch build: PyPI's Linux torchvision pairs with PyPI's CUDA torch, and
beside this template's `+cpu` torch its compiled operators fail to register, which surfaces later as a long
traceback from torchmetrics' import of torchvision. The build is the local version label (`+cpu`, `+cu128`; none
on PyPI), and the torch release is the one the package's metadata requires (`torch==2.13.0`).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

FAMILY = ("torchvision", "torchaudio")


def build(version: str) -> str:
    """`2.13.0+cpu` -> `cpu`; `2.13.0` -> `` (PyPI's build)."""
    return version.partition("+")[2]


def mismatch(torch: str, name: str, version: str, requires: list[str]) -> str | None:
    """Why `name` `version` (metadata `requires`) does not work with torch `torch`, or None when it does."""
    pinned = next((m.group(1) for r in requires if (m := re.match(r"torch\s*==\s*([^\s;,]+)", r))), None)
    if build(version) != build(torch) or (pinned and pinned.partition("+")[0] != torch.partition("+")[0]):
        return (
            f"error: {name} {version} ({build(version) or 'PyPI'} build, for torch {pinned or '?'}) does not match "
            f"torch {torch} ({build(torch) or 'PyPI'} build): take both from one index, pinned by "
            "`make lock TORCH=... TORCH_INDEX=...` (README, Install)"
        )
    return None


def main() -> int:
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return 0
    for name in FAMILY:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        problem = mismatch(torch, name, dist.version, dist.requires or [])
        if problem:
            print(problem, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
