"""requirements.lock agrees with pyproject.toml: a dependency added, dropped or re-ranged there fails here
until `make lock` is run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mlproject.core.constants import PROJECT_ROOT

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
LOCKS = sorted(PROJECT_ROOT.glob("requirements*.lock"))
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)", re.M)


def pyproject_requirements() -> tuple[str, list[Requirement]]:
    """The package's name and its requirements with the dev extra, self-references (`pkg[a,b]`) expanded."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    name, extras = canonicalize_name(project["name"]), project["optional-dependencies"]
    reqs, todo, seen = [], [Requirement(r) for r in project["dependencies"]] + [Requirement(f"{name}[dev]")], set()
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) != name:
            reqs.append(req)
        for extra in req.extras - seen if canonicalize_name(req.name) == name else ():
            seen.add(extra)
            todo += [Requirement(r) for r in extras[extra]]
    return name, reqs


def parse_lock(path: Path) -> tuple[dict[str, Version], dict[str, set[str]], list[str]]:
    """name -> pinned version; name -> what needs it (uv's `# via` lines); the pins without a hash."""
    pins, via, unhashed = {}, {}, []
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        match = PIN.match(block)
        if not match:
            continue
        name = canonicalize_name(match.group(1))
        pins[name] = Version(match.group(2))
        needers = re.findall(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9._-]+)", block, re.M)
        via[name] = {canonicalize_name(n) for n in needers if n != "via"}
        if "--hash=sha256:" not in block:
            unhashed.append(name)
    return pins, via, unhashed


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_lock_matches_pyproject(lock):
    name, reqs = pyproject_requirements()
    pins, via, unhashed = parse_lock(lock)
    assert not unhashed, f"{lock.name}: pinned without a hash: {unhashed}"
    wanted = [r for r in reqs if r.marker is None or r.marker.evaluate()]
    stale = [
        f"{r} (locked: {pins.get(canonicalize_name(r.name), 'missing')})"
        for r in wanted
        if not r.specifier.contains(pins.get(canonicalize_name(r.name), Version("0")), prereleases=True)
    ]
    assert not stale, f"{lock.name} does not satisfy pyproject.toml: {stale}; run `make lock`"
    # Everything pinned is needed: reachable from pyproject's requirements through what needs what.
    needed, todo = set(), [canonicalize_name(r.name) for r in wanted]
    while todo:
        dep = todo.pop()
        if dep not in needed:
            needed.add(dep)
            todo += [p for p, needers in via.items() if dep in needers]
    assert not set(pins) - needed, f"{lock.name} pins what nothing needs: {sorted(set(pins) - needed)}"


def test_lock_covers_the_install():
    """`make install` reads requirements.lock with hash checking; the lock pins the CPU torch build."""
    pins, _, _ = parse_lock(PROJECT_ROOT / "requirements.lock")
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert "--require-hashes -r $(LOCK)" in makefile and "LOCK        ?= requirements.lock" in makefile
    torch = re.search(r"^TORCH\s+\?= torch==(\S+)", makefile, re.M).group(1)
    assert pins["torch"] == Version(torch)


def test_torch_floor_has_the_apis_the_code_calls():
    """DeviceMesh._unflatten (distributed/parallel.py) is torch >= 2.9; an older torch the range allowed would fail
    at the first mesh."""
    _, reqs = pyproject_requirements()
    torch = next(r for r in reqs if r.name == "torch")
    assert Version("2.8.99") not in torch.specifier and Version("2.9") in torch.specifier
