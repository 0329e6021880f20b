"""The two locks agree with pyproject.toml: requirements.lock (what running needs: dependencies + the run extra) and
requirements-dev.lock (+ the dev extra). A dependency added, dropped or re-ranged there fails here until `make lock`
is run; a package both locks hold has one pin."""

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
RUNTIME_LOCKS = [p for p in LOCKS if not p.name.endswith("-dev.lock")]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)", re.M)


def dev_lock(lock: Path) -> Path:
    """The Makefile's DEV_LOCK for a LOCK: its name with -dev before .lock."""
    return lock.with_name(f"{lock.stem}-dev.lock")


def pyproject_requirements(extra: str) -> tuple[str, list[Requirement]]:
    """The package's name and its requirements with one extra, self-references (`pkg[a,b]`) expanded."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    name, extras = canonicalize_name(project["name"]), project["optional-dependencies"]
    reqs, todo, seen = [], [Requirement(r) for r in project["dependencies"]] + [Requirement(f"{name}[{extra}]")], set()
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) != name:
            reqs.append(req)
        for extra in req.extras - seen if canonicalize_name(req.name) == name else ():
            seen.add(extra)
            todo += [Requirement(r) for r in extras[extra]]
    return name, reqs


def parse_lock(path: Path) -> tuple[dict[str, Version], dict[str, set[str]], dict[str, set[str]]]:
    """name -> pinned version; name -> what needs it (uv's `# via` lines); name -> its hashes."""
    pins, via, hashes = {}, {}, {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        match = PIN.match(block)
        if not match:
            continue
        name = canonicalize_name(match.group(1))
        pins[name] = Version(match.group(2))
        needers = re.findall(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9._-]+)", block, re.M)
        via[name] = {canonicalize_name(n) for n in needers if n != "via"}
        hashes[name] = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return pins, via, hashes


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_lock_matches_pyproject(lock):
    name, reqs = pyproject_requirements("dev" if lock.name.endswith("-dev.lock") else "run")
    pins, via, hashes = parse_lock(lock)
    unhashed = [dep for dep, found in hashes.items() if not found]
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


@pytest.mark.parametrize("lock", RUNTIME_LOCKS, ids=[p.name for p in RUNTIME_LOCKS])
def test_dev_lock_holds_the_runtime_lock_as_pinned(lock):
    """Each runtime lock has its dev lock, which pins every package of it to the same version and files: a
    venv made from either runs the same code, and the dev one installs alone."""
    assert dev_lock(lock).exists(), f"{dev_lock(lock).name} is missing: make lock LOCK={lock.name} ..."
    pins, _, hashes = parse_lock(lock)
    dev_pins, _, dev_hashes = parse_lock(dev_lock(lock))
    assert not set(pins) - set(dev_pins), f"{dev_lock(lock).name} lacks {sorted(set(pins) - set(dev_pins))}"
    differ = {dep: (str(pins[dep]), str(dev_pins[dep])) for dep in pins if pins[dep] != dev_pins[dep]}
    assert differ == {}, f"{lock.name} and {dev_lock(lock).name} pin these apart; run `make lock`"
    assert [dep for dep in pins if hashes[dep] != dev_hashes[dep]] == []
    # Running needs neither the test tools nor the notebooks: the split is real.
    assert {"pytest", "ruff", "ipykernel"} <= set(dev_pins) - set(pins)


def test_locks_cover_the_installs():
    """`make install` reads requirements.lock, `make install-dev` requirements-dev.lock, both with hash checking;
    both locks pin the CPU torch build; running targets install the runtime lock, developing ones the dev lock."""
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert "LOCK        ?= requirements.lock" in makefile and "DEV_LOCK    ?= $(LOCK:.lock=-dev.lock)" in makefile
    for stamp, lock in ((".installed", "LOCK"), (".installed-dev", "DEV_LOCK")):
        install = rf"--require-hashes \$\(VENDOR\) -r \$\({lock}\)"
        pattern = rf"^\$\(VENV\)/\{stamp}: pyproject\.toml \$\({lock}\)\n.*\n.*{install}\n"
        assert re.search(pattern, makefile, re.M), stamp
    torch = Version(re.search(r"^TORCH\s+\?= torch==(\S+)", makefile, re.M).group(1))
    locks = ("requirements.lock", "requirements-dev.lock")
    assert {name: parse_lock(PROJECT_ROOT / name)[0]["torch"] for name in locks} == dict.fromkeys(locks, torch)
    needs = dict(re.findall(r"^([a-z-]+): (install|install-dev) ##", makefile, re.M))
    running = ("train", "sweep", "eval", "export", "prepare", "cv")
    # feature: planner
    running += ("plan",)
    # /feature: planner
    # feature: slurm, kubernetes
    running += ("submit", "submit-dryrun")
    # /feature: slurm, kubernetes
    assert {t: needs.get(t) for t in running} == dict.fromkeys(running, "install")
    developing = ("test", "test-fast", "test-gpu", "lint", "format")
    assert {t: needs.get(t) for t in developing} == dict.fromkeys(developing, "install-dev")
    # make lock remakes both, the dev lock constrained by the runtime one (same pin for a package both hold).
    assert "--extra run -o $(LOCK)" in makefile and "--extra dev --constraint $(LOCK) -o $(DEV_LOCK)" in makefile


def test_torch_floor_has_the_apis_the_code_calls():
    """DeviceMesh._unflatten (distributed/parallel.py) is torch >= 2.9; an older torch the range allowed would fail
    at the first mesh."""
    _, reqs = pyproject_requirements("run")
    torch = next(r for r in reqs if r.name == "torch")
    assert Version("2.8.99") not in torch.specifier and Version("2.9") in torch.specifier
