"""Starting a project from the template (copier, cookiecutter, `make rename`) and updating it later.

Everything is offline: the template is this working tree, committed into a temporary git repository.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from fnmatch import fnmatch
from itertools import combinations
from pathlib import Path

import pytest
import yaml

from mlproject.core.constants import PROJECT_ROOT
from tests.helpers.processes import clean_env

spec = importlib.util.spec_from_file_location("rename_project", PROJECT_ROOT / "scripts" / "rename_project.py")
rename_project = sys.modules["rename_project"] = importlib.util.module_from_spec(spec)  # scripts/ is no package
spec.loader.exec_module(rename_project)

OLD = "mlproject"
ANSWERS = {
    "project_name": "Cool Net",
    "author": "Ada Lovelace",
    "description": 'Nets that are "cool" \\o/',  # quotes and a backslash survive into TOML
    "license": "Apache-2.0",
}


@pytest.fixture(scope="module")
def tool_env(tmp_path_factory) -> dict[str, str]:
    """git, copier and cookiecutter with a throw-away HOME: no user config in, no replay files out."""
    home = tmp_path_factory.mktemp("home")
    git_id = dict(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return clean_env(HOME=str(home), GIT_CONFIG_NOSYSTEM="1", **git_id)


def sh(*cmd, cwd: Path, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    """Run a command; fails with the tail of its output, on a timeout too. Its output goes to files, not pipes: a
    process it leaves behind would hold a pipe open, and the wait for its end with it, until the timeout."""
    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            code = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"nothing: it ran past {timeout} s"
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(cmd, code, out.read(), err.read())
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def copy_tree(src: Path, dst: Path) -> None:
    """This working tree as git sees it (tracked or not ignored): what copier takes from a dirty template."""
    for path in rename_project.project_files(src):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


@pytest.fixture(scope="module")
def template(tmp_path_factory, tool_env) -> Path:
    """The template as a local git repository tagged v1."""
    repo = tmp_path_factory.mktemp("tpl") / "template"
    copy_tree(PROJECT_ROOT, repo)
    sh("git", "init", "-q", "-b", "main", cwd=repo, env=tool_env)
    sh("git", "add", "-A", cwd=repo, env=tool_env)
    sh("git", "commit", "-qm", "v1", cwd=repo, env=tool_env)
    sh("git", "tag", "v1", cwd=repo, env=tool_env)
    return repo


def copier_copy(template: Path, dst: Path, env: dict, **answers: str | None) -> Path:
    """copier copy of the template's v1 with --defaults; `answers` override ANSWERS (None: copier's default)."""
    answers = {k: v for k, v in {**ANSWERS, "examples": '["digits"]', **answers}.items() if v is not None}
    data = [f"--data={key}={value}" for key, value in answers.items()]
    cmd = [sys.executable, "-m", "copier", "copy", "--trust", "--defaults", "--vcs-ref=v1", *data, template, dst]
    sh(*cmd, cwd=dst.parent, env=env)
    return dst


@pytest.fixture(scope="module")
def copier_project(template, tmp_path_factory, tool_env) -> Path:
    return copier_copy(template, tmp_path_factory.mktemp("copier") / "cool-net", tool_env)


def tree(root: Path) -> dict[str, tuple[bytes, bool]]:
    """path -> (content, executable) for every file outside .git."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), bool(p.stat().st_mode & stat.S_IXUSR))
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def leftovers(root: Path, word: str = OLD) -> list[str]:
    found = []
    for rel, (data, _) in tree(root).items():
        if word in rel.lower():
            found.append(rel)
        found += [f"{rel}:{i + 1}" for i, line in enumerate(data.splitlines()) if word.encode() in line.lower()]
    return found


def test_copier_renames_everything(copier_project):
    root = copier_project
    assert not leftovers(root), leftovers(root)
    assert (root / "src/cool_net/train.py").is_file() and not (root / "src" / OLD).exists()
    # The template's starter machinery stays behind; copier records what it needs for updates.
    for rel in rename_project.TEMPLATE_ONLY:
        assert not (root / rel).exists(), rel
    dropped = [ex for name, ex in rename_project.EXAMPLES.items() if name != "digits"]
    assert not any(rename_project.present(root, "cool_net", ex) for ex in dropped)
    readmes = [p for p in root.rglob("*.md") if "template-only" in p.read_text()]
    assert not readmes  # the README sections about starting a project from the template are gone
    # the project's title and description where the template introduced itself
    assert (root / "README.md").read_text().startswith('# Cool Net\n\nNets that are "cool" \\o/\n\n```bash\n')
    answers = (root / ".copier-answers.yml").read_text()
    assert "_commit: v1" in answers and "package_name: cool_net" in answers
    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "cool_net"' in pyproject
    assert r'description = "Nets that are \"cool\" \\o/"' in pyproject
    assert 'license = { text = "Apache-2.0" }' in pyproject
    assert 'authors = [{ name = "Ada Lovelace" }]' in pyproject
    assert "COOL_NET_RUN_ID" in (root / "src/cool_net/core/resolvers.py").read_text()
    assert "project: cool_net" in (root / "configs/logger/wandb.yaml").read_text()
    assert "-m cool_net.train" in (root / "Makefile").read_text()
    # The locked install, its target and the CI workflow come along (copier update keeps them current).
    assert "cool_net (pyproject.toml)" in (root / "requirements.lock").read_text()
    assert "\nlock: " in (root / "Makefile").read_text()
    assert (root / ".github/workflows/ci.yml").read_bytes() == (PROJECT_ROOT / ".github/workflows/ci.yml").read_bytes()


@pytest.mark.slow
def test_copier_project_passes_its_tests_and_trains(copier_project, tmp_path):
    """The generated project's config tests for its example (compose, instantiate, comments) and a 1-epoch train."""
    root = copier_project
    env = clean_env(PYTHONPATH=str(root / "src"), COOL_NET_RUN_ID="first")
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_configs.py"]
    sh(*pytest_cmd, "-k", "digits or comment or eval", cwd=root, env=env, timeout=300)
    limits = [f"trainer.limit_{s}_batches=2" for s in ("train", "val", "test")]
    overrides = [
        "trainer=cpu",
        "trainer.max_epochs=1",
        "extras.print_config=false",
        f"paths.log_dir={tmp_path}",
        *limits,
    ]
    sh(sys.executable, "-m", "cool_net.train", *overrides, cwd=root, env=env, timeout=300)
    metrics = json.loads((tmp_path / "train/runs/first/metrics.json").read_text())  # the renamed env var names the run
    assert metrics["test/samples"] == 2 * 64  # 2 test batches of the global batch, each sample once
    names = ("acc", "f1", "auroc", "loss", "samples")
    assert set(metrics) == {f"{stage}/{name}" for stage in ("val", "test") for name in names}


def test_cookiecutter_gives_the_same_project(template, copier_project, tmp_path, tool_env):
    context = [f"{key}={value}" for key, value in {**ANSWERS, "examples": "digits"}.items()]
    cmd = [sys.executable, "-m", "cookiecutter", "--no-input", template, "--directory=starters/cookiecutter", *context]
    sh(*cmd, cwd=tmp_path, env=tool_env)
    made = tree(tmp_path / "cool_net")
    expected = tree(copier_project)
    expected.pop(".copier-answers.yml")
    assert sorted(made) == sorted(expected)
    assert [rel for rel in made if made[rel] != expected[rel]] == []


def test_copier_update_brings_template_changes_and_keeps_user_edits(template, tmp_path, tool_env):
    env = tool_env
    sh("git", "clone", "-q", template, tmp_path / "template", cwd=tmp_path, env=env)  # v2 goes on a copy
    template = tmp_path / "template"
    root = copier_copy(template, tmp_path / "proj", env)
    sh("git", "init", "-q", "-b", "main", cwd=root, env=env)
    sh("git", "add", "-A", cwd=root, env=env)
    sh("git", "commit", "-qm", "start from the template", cwd=root, env=env)
    # The user's own edits: one line the template will not touch, one it will.
    optim = root / "src/cool_net/training/optim.py"
    optim.write_text(optim.read_text() + "# tuned for my data\n")
    train_yaml = root / "configs/train.yaml"
    train_yaml.write_text(re.sub(r"^seed:.*$", "seed: 7  # mine", train_yaml.read_text(), count=1, flags=re.M))
    sh("git", "commit", "-qam", "my edits", cwd=root, env=env)
    # The template's v2: a new module that imports the package, and the same seed line changed.
    (template / "src/mlproject/utils/news.py").write_text(
        f'"""New in v2."""\n\nfrom {OLD}.core.errors import ConfigError\n'
    )
    tpl_train = template / "configs/train.yaml"
    tpl_train.write_text(re.sub(r"^seed:.*$", "seed: 0  # v2", tpl_train.read_text(), count=1, flags=re.M))
    workflow = ".github/workflows/ci.yml"  # and its CI workflow changed: the project's follows
    (template / workflow).write_text((template / workflow).read_text() + "# v2: a new step would go here\n")
    sh("git", "add", "-A", cwd=template, env=env)
    sh("git", "commit", "-qm", "v2", cwd=template, env=env)
    sh("git", "tag", "v2", cwd=template, env=env)

    sh(sys.executable, "-m", "copier", "update", "--trust", "--defaults", cwd=root, env=env)

    assert "_commit: v2" in (root / ".copier-answers.yml").read_text()
    assert (root / "src/cool_net/utils/news.py").read_text().endswith("from cool_net.core.errors import ConfigError\n")
    assert optim.read_text().endswith("# tuned for my data\n")
    assert (root / workflow).read_text() == (template / workflow).read_text()
    merged = train_yaml.read_text()  # both sides changed the line: a conflict, not a silent overwrite
    assert "<<<<<<< before updating" in merged and "seed: 7  # mine" in merged and "seed: 0  # v2" in merged
    unmerged = sh("git", "diff", "--name-only", "--diff-filter=U", cwd=root, env=env).stdout.split()
    assert unmerged == ["configs/train.yaml"]
    assert not leftovers(root), leftovers(root)
    assert not (root / "src" / OLD).exists()
    dropped = [ex for name, ex in rename_project.EXAMPLES.items() if name != "digits"]
    assert not any(rename_project.present(root, "cool_net", ex) for ex in dropped)  # stay dropped


def test_copier_update_turns_a_feature_on_and_keeps_user_edits(template, tmp_path, tool_env):
    root = copier_copy(template, tmp_path / "proj", tool_env, examples=None, preset="minimal")
    sh("git", "init", "-q", "-b", "main", cwd=root, env=tool_env)
    sh("git", "add", "-A", cwd=root, env=tool_env)
    sh("git", "commit", "-qm", "start small", cwd=root, env=tool_env)
    (before,) = (root / "vendor").iterdir()
    model = root / "src/cool_net/models/classifier.py"  # machinery=package: the machinery is a wheel in vendor/
    model.write_text(model.read_text() + "# tuned for my data\n")
    sh("git", "commit", "-qam", "my edit", cwd=root, env=tool_env)
    assert not (root / "configs/hparams_search").exists()

    sh(sys.executable, "-m", "copier", "update", "--trust", "--defaults", "--data=sweeps=true", cwd=root, env=tool_env)

    assert "sweeps: true" in (root / ".copier-answers.yml").read_text()
    assert (root / "configs/hparams_search/digits.yaml").is_file()
    (wheel,) = (root / "vendor").iterdir()  # another build (its content in its version): pip installs it over the old
    assert wheel.name != before.name
    with zipfile.ZipFile(wheel) as zf:  # the study sweeper's Hydra plugin comes with the machinery
        assert "hydra_plugins/mlproject_sweeper/study_sweeper.py" in zf.namelist()
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert re.search(r"^optuna = ", (root / "pyproject.toml").read_text(), re.M)
    for lock in ("requirements.lock", "requirements-dev.lock"):  # the locks come along, with the new wheel's hash
        assert re.search(r"^optuna==", (root / lock).read_text(), re.M) and sha in (root / lock).read_text()
    assert model.read_text().endswith("# tuned for my data\n")
    assert not sh("git", "diff", "--name-only", "--diff-filter=U", cwd=root, env=tool_env).stdout.split()
    assert not mentions(root, r"^\W*/?feature:", ("src", "configs", "tests", "docs"))


def test_make_rename_in_a_plain_clone(tmp_path, tool_env):
    root = tmp_path / "clone"
    copy_tree(PROJECT_ROOT, root)
    sh("make", "rename", "NAME=cool_net", "EXAMPLES=digits", cwd=root, env=tool_env)
    assert not leftovers(root), leftovers(root)
    before = tree(root)
    sh("make", "rename", "NAME=cool_net", "EXAMPLES=digits", cwd=root, env=tool_env)  # idempotent
    assert tree(root) == before


@pytest.mark.parametrize(
    ("name", "examples", "error"),
    [
        ("Cool-Net", "digits", "not a lower-case Python identifier"),
        ("import", "digits", "not a lower-case Python identifier"),
        (f"my_{OLD}", "digits", "contains the old name"),
        ("cool_net", "digits,nope", "unknown example"),
        ("cool_net", "", "keep at least one example"),
    ],
)
def test_rename_refuses_before_changing_anything(tmp_path, name, examples, error):
    root = tmp_path / "clone"
    copy_tree(PROJECT_ROOT, root)
    before = tree(root)
    proc = subprocess.run(
        [sys.executable, "scripts/rename_project.py", name, f"--examples={examples}"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and error in proc.stderr
    assert tree(root) == before


def modules(paths: list[Path], root: Path) -> list[str]:
    src = root / "src"
    return [".".join(p.relative_to(src).with_suffix("").parts) for p in paths if p.suffix == ".py" and src in p.parents]


@pytest.mark.parametrize("dropped", list(rename_project.EXAMPLES))
def test_dropping_an_example_leaves_no_reference_to_it(tmp_path, dropped):
    """The example table lists every file of an example: nothing kept imports or composes a dropped file."""
    root = tmp_path / "clone"
    copy_tree(PROJECT_ROOT, root)
    example = rename_project.EXAMPLES[dropped]
    files = [p for pattern in example.paths for p in root.glob(pattern.format(pkg=OLD))]
    keep = [e for e, ex in rename_project.EXAMPLES.items() if e != dropped and rename_project.present(root, OLD, ex)]
    proc = subprocess.run(
        [sys.executable, "scripts/rename_project.py", "cool_net", f"--examples={','.join(keep)}"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if not keep:  # the template's only example: refused, since train.yaml needs a default
        assert proc.returncode == 2 and "keep at least one example" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    gone = [m.replace(OLD, "cool_net", 1) for m in modules(files, root)]
    configs = [(p.parent.name, p.stem) for p in files if p.suffix == ".yaml" and p.parent.parent.name == "configs"]
    refs = []  # code and configs only: prose (READMEs, error hints) may still name a dropped example
    for rel, (data, _) in tree(root).items():
        if not rel.endswith((".py", ".yaml", ".ipynb")):
            continue
        text = data.decode(errors="replace")
        refs += [f"{rel}: {m}" for m in gone if re.search(rf"\b{re.escape(m)}\b", text)]
        refs += [f"{rel}: {g}: {o}" for g, o in configs if re.search(rf"^\s*-?\s*(override /)?{g}: {o}\b", text, re.M)]
        if rel.startswith("tests/"):  # overrides, e.g. compose_cfg("model=gpt")
            refs += [f"{rel}: {g}={o}" for g, o in configs if re.search(rf"\b{g}={o}\b", text)]
    assert not refs, refs
    assert all(not p.exists() for p in files)


SUBSETS = [
    ",".join(c) for n in range(1, len(rename_project.EXAMPLES) + 1) for c in combinations(rename_project.EXAMPLES, n)
]
MINIMAL = "digits"  # the smallest project: this example and no feature (copier's preset=minimal)


@pytest.fixture(scope="module", params=[*SUBSETS, f"{MINIMAL} alone"])
def subset_project(request, tmp_path_factory) -> tuple[Path, list[str]]:
    """A project keeping one subset of the examples (none is refused: test_rename_refuses_before_changing_anything),
    with every feature; and the smallest project, MINIMAL without any."""
    root = tmp_path_factory.mktemp("subset") / "cool-net"
    copy_tree(PROJECT_ROOT, root)
    examples, alone = request.param.removesuffix(" alone"), request.param.endswith(" alone")
    rename_project.main(["cool_net", f"--root={root}", f"--examples={examples}", *(["--features="] if alone else [])])
    return root, examples.split(",")


def test_every_subset_describes_what_it_keeps(subset_project):
    """README, docs and config comments name the kept default example, never a dropped one."""
    root, kept = subset_project
    default = rename_project.EXAMPLES[kept[0]]
    assert default.prose["run"] in (root / "README.md").read_text()
    prose = {rel: data.decode() for rel, (data, _) in tree(root).items() if rel.endswith((".md", ".yaml"))}
    dropped = [p for name, ex in rename_project.EXAMPLES.items() if name not in kept for p in ex.prose.values()]
    assert not [(rel, p) for rel, text in prose.items() for p in dropped if p in text]
    train_yaml = prose["configs/train.yaml"]
    assert all(f"- {group}: {option}" in train_yaml for group, option in default.defaults.items())


def move_in_lht(root: Path, package: str) -> None:
    """A lightning-hydra-template project's model, data and configs moved into a generated project file by file,
    as docs/migrating.md says (the one edit: `_target_: src.` names the project's package). Its options get names
    of their own: test_move_in.py, where kept, finds the fixture's under the fixture's names."""
    lht = PROJECT_ROOT / "tests/fixtures/lht"
    for rel in ("models/mnist_module.py", "models/components/simple_dense_net.py", "data/digits_datamodule.py"):
        shutil.copy2(lht / "src" / rel, root / "src" / package / rel)
    for rel, option in (("model/mnist.yaml", "model/moved_in.yaml"), ("data/digits_lht.yaml", "data/moved_in.yaml")):
        text = (lht / "configs" / rel).read_text().replace("_target_: src.", f"_target_: {package}.")
        (root / "configs" / option).write_text(text)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # a whole fast suite, cold, beside the other xdist worker's tests: ~8-14 min
def test_every_subset_passes_its_fast_tests(subset_project):
    """`make test-fast` of the generated project, with an LHT project's model and data moved in (its config
    tests instantiate them with the project's own, no test changed): a process of its own, another package."""
    root, kept = subset_project
    if len(kept) == len(rename_project.EXAMPLES):
        pytest.skip("all examples kept: this suite renamed, covered by the single-example subsets (~1 min saved)")
    move_in_lht(root, "cool_net")
    # -v: on a timeout, the tail names the test that was running
    project_tests(root, "-m", "not slow", "-v", timeout=2400)


def test_a_gpt_only_project_configs_never_mention_digits(tmp_path):
    """Config comments kept by a project of the GPT example alone name no file or option it no longer has."""
    shutil.copytree(PROJECT_ROOT / "configs", tmp_path / "configs")
    rename_project.drop_examples(tmp_path, OLD, ["gpt"])
    rename_project.retell(tmp_path, ["gpt"])
    mentions = [
        f"{path.relative_to(tmp_path)}:{n}"
        for path in sorted((tmp_path / "configs").rglob("*.yaml"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"digits|data=images", line)
    ]
    assert not mentions


# What a project without the feature never mentions in src/, configs/, docs/ and README.md: its code, options,
# comments and prose.
WORDS = {
    "slurm": r"slurm",  # submitit stays with sweeps: its local launcher runs trials in parallel
    "kubernetes": r"kubernetes|kubeflow|trainjob",
    "sweeps": r"optuna|hparams_search|study_sweeper",
    "wandb": r"wandb|W&B",
    "mlflow": r"mlflow",
    "deepspeed": r"deepspeed|zero_shards",
    "tensor": r"tensor_parallel|fsdp_tp|strategy=tp\b|colwise|rowwise|apply_tp",
    "expert": r"expert_parallel|expert_shard|expert_fsdp|apply_ep|ep_group",
    "pipeline": r"pipeline_parallel|strategy=pp\b|distributed\.pipeline|pipeline_bubble|1f1b|microbatches",
    "object_storage": r"s3fs|s3://|object storage|moto",
    "planner": r"make plan|\.plan import|import plan\b|check_memory|gpu_memory|no-plan|planning\.md|memory planner",
}


def mentions(root: Path, pattern: str, folders=("src", "configs", "docs", "README.md")) -> list[str]:
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for folder in folders
        for path in sorted((root / folder).rglob("*") if (root / folder).is_dir() else [root / folder])
        if path.is_file() and path.suffix in (".py", ".yaml", ".md")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(pattern, line, re.I)
    ]


def keep(text: str, features: list[str]) -> str:
    return rename_project.keep_feature_lines(text, features, "f")


def test_feature_lines_go_with_their_feature(capsys):
    text = "a\n# feature: wandb\nb\n  # feature: slurm, mlflow\nc\n  # /feature: slurm, mlflow\n# /feature: wandb\nd\n"
    assert keep(text, ["wandb"]) == "a\nb\nd\n"
    assert keep(text, ["wandb", "mlflow"]) == "a\nb\nc\nd\n"  # either of the names keeps a block
    assert keep(text, ["mlflow"]) == "a\nd\n"  # inside a left-out block: gone too
    assert keep("x\n<!-- feature: sweeps -->\ny\n<!-- /feature: sweeps -->\n", []) == "x\n"
    assert keep("x\n\n\n# feature: sweeps\ny\n# /feature: sweeps\n", []) == "x\n"  # no blank tail left
    for bad, error in [
        ("# feature: nope\n# /feature: nope\n", "f:1: unknown feature nope"),
        ("# feature: wandb\n", "f: feature wandb is never closed"),
        ("# feature: wandb\n# /feature: mlflow\n", "f:2: closes feature mlflow, which is not the open block"),
    ]:
        with pytest.raises(SystemExit):
            keep(bad, ["wandb"])
        assert error in capsys.readouterr().err


def test_every_feature_marker_in_the_template_pairs_up(capsys):
    """A typo in a marker would leave a block in every project, or take the rest of a file with it."""
    for path in rename_project.project_files(PROJECT_ROOT):
        data = path.read_bytes()
        if b"feature:" in data and b"\0" not in data:
            try:
                keep(data.decode(), list(rename_project.FEATURES))
            except SystemExit:
                pytest.fail(f"{path.relative_to(PROJECT_ROOT)}: {capsys.readouterr().err}")


@pytest.fixture(scope="module", params=list(rename_project.FEATURES))
def without_feature(request, tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("without") / "cool-net"
    copy_tree(PROJECT_ROOT, root)
    kept = [name for name in rename_project.FEATURES if name != request.param]
    rename_project.main(["cool_net", f"--root={root}", f"--features={','.join(kept)}"])
    return root, request.param


def project_tests(root: Path, *args: str, timeout: int = 180) -> None:
    """`pytest args...` of the generated project's own tests, run with its package (and this template's machinery
    where the project depends on it as a package: the same code as its wheel, whose root is then the project's)."""
    env = clean_env(PYTHONPATH=str(root / "src"), PROJECT_ROOT=str(root))
    sh(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, cwd=root, env=env, timeout=timeout)


def test_a_left_out_feature_leaves_nothing_behind(without_feature):
    """Its files, its lines in shared files, its extras and the locked packages only it needed go; the rest is
    a clean project: it compiles, lints, and its locks still match its pyproject."""
    root, feature = without_feature
    assert not [
        p for pattern in rename_project.FEATURES[feature].paths for p in root.glob(pattern.format(pkg="cool_net"))
    ]
    assert not mentions(root, WORDS[feature])
    assert not mentions(root, r"^\W*/?feature:", ("src", "configs", "tests", "docs"))  # no marker left
    env = clean_env(PYTHONPATH=str(root / "src"))
    sh(sys.executable, "-m", "ruff", "check", "--no-cache", ".", cwd=root, env=env)
    sh(sys.executable, "-m", "ruff", "format", "--check", "--no-cache", ".", cwd=root, env=env)
    project_tests(root, "-q", "tests/test_lock.py", "tests/test_layers.py", "tests/test_docs.py")
    needed = {extra for name, f in rename_project.FEATURES.items() if name != feature for extra in f.extras}
    pyproject = (root / "pyproject.toml").read_text()
    for extra in set(rename_project.FEATURES[feature].extras) - needed:
        template_line = re.search(rf"^{extra} = \[(.*)\]", (PROJECT_ROOT / "pyproject.toml").read_text(), re.M)
        assert not re.search(rf"^{extra} = ", pyproject, re.M) and f"{extra}," not in pyproject
        for package in re.findall(r'"([A-Za-z0-9_.-]+)', template_line.group(1)):  # its requirements' names
            for lock in root.glob("requirements*.lock"):
                assert not re.search(rf"^{re.escape(package)}==", lock.read_text(), re.M | re.I), (lock.name, package)


def test_copier_preset_minimal_keeps_digits_and_no_feature(template, tmp_path, tool_env):
    root = copier_copy(template, tmp_path / "small", tool_env, examples=None, preset="minimal")  # no other answer
    answers = (root / ".copier-answers.yml").read_text()
    assert "preset: minimal" in answers and "sweeps: false" in answers
    assert not [m for pattern in WORDS.values() for m in mentions(root, pattern)]
    assert not rename_project.present(root, "cool_net", rename_project.EXAMPLES["gpt"])


PROJECTS_CI = yaml.safe_load((PROJECT_ROOT / ".github/workflows/projects.yml").read_text())["jobs"]["project"]


@pytest.mark.parametrize("combination", PROJECTS_CI["strategy"]["matrix"]["include"], ids=lambda c: c["name"])
def test_each_combination_of_the_projects_ci_generates_with_its_features(template, tmp_path, tool_env, combination):
    """The answers of .github/workflows/projects.yml (where each project installs and runs its quick tests) make
    a project that holds the features they chose and no other, with locks that match its pyproject."""
    root = tmp_path / "cool-net"
    data = shlex.split(combination["answers"])
    sh(
        sys.executable,
        "-m",
        "copier",
        "copy",
        "--trust",
        "--defaults",
        "--vcs-ref=v1",
        "--data",
        "project_name=Cool Net",
        *data,
        template,
        root,
        cwd=tmp_path,
        env=tool_env,
    )
    answers = yaml.safe_load((root / ".copier-answers.yml").read_text())
    chosen = {*answers["clusters"], *answers["loggers"], *answers["parallelism"], answers["checkpoint_storage"]}
    chosen |= {name for name in ("sweeps", "planner") if answers[name]}
    for name, feature in rename_project.FEATURES.items():
        assert rename_project.present(root, "cool_net", feature) == (name in chosen), name
    assert not (root / ".github/workflows/projects.yml").exists()
    if (root / "vendor").exists() and (root / "Dockerfile").exists():  # the pods' image installs the machinery's wheel
        assert "COPY vendor /tmp/vendor\nENV PIP_FIND_LINKS=/tmp/vendor\n" in (root / "Dockerfile").read_text()
        assert "!vendor/" in (root / ".dockerignore").read_text()
        assert "image: ghcr.io/your-org/cool_net:latest" in (root / "configs/cluster/kubernetes.yaml").read_text()
    project_tests(root, "-q", "tests/test_lock.py", "tests/test_docs.py")


def test_the_smallest_project_owns_its_models_and_data_and_depends_on_the_machinery(template, tmp_path, tool_env):
    """preset=minimal: src/ holds the examples' models and data only; the rest is the template's package, a wheel in
    vendor/ that both locks pin by its hash, built byte for byte the same on every replay (copier update); tests/
    holds the project's own tests, which pass with it."""
    root = copier_copy(template, tmp_path / "cool-net", tool_env, preset="minimal", examples=None)
    assert yaml.safe_load((root / ".copier-answers.yml").read_text())["machinery"] == "package"
    sources = sorted((root / "src").rglob("*.py"))
    assert {p.relative_to(root / "src/cool_net").parts[0] for p in sources} == {"__init__.py", "models", "data"}
    assert sum(len(p.read_text().splitlines()) for p in sources) <= 2000
    assert not mentions(root, "|".join(WORDS.values()), ("src", "configs"))
    tests = {str(p.relative_to(root)) for p in (root / "tests").rglob("*.py")}
    assert all(any(fnmatch(t, g) for g in rename_project.PROJECT_TESTS) for t in tests)
    assert "tests/test_train.py" in tests and "tests/test_add_your_own.py" in tests
    (wheel,) = (root / "vendor").iterdir()
    build = re.fullmatch(r"mlproject-(0\.1\.0\+[0-9a-f]{8})-py3-none-any\.whl", wheel.name).group(1)  # +its content
    assert '"mlproject==0.1.0"' in (root / "pyproject.toml").read_text()
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    for lock in root.glob("requirements*.lock"):
        assert f"mlproject=={build} \\\n    --hash=sha256:{sha}\n" in lock.read_text(), lock.name
    with zipfile.ZipFile(wheel) as zf:
        names = {n for n in zf.namelist() if n.endswith(".py")}
    machinery = rename_project.project_files(PROJECT_ROOT / "src" / OLD)
    expected = {str(p.relative_to(PROJECT_ROOT / "src")) for p in machinery if p.suffix == ".py"}
    assert names == {n for n in expected if n.split("/")[1] not in rename_project.OWN}
    again = tmp_path / "again"
    copy_tree(PROJECT_ROOT, again)
    rename_project.main(["cool_net", f"--root={again}", "--examples=digits", "--features=", "--machinery=package"])
    assert (again / "vendor" / wheel.name).read_bytes() == wheel.read_bytes()
    rename_project.main(["cool_cat", f"--root={again}", "--examples=digits", "--features=", "--machinery=package"])
    assert (again / "vendor" / wheel.name).read_bytes() == wheel.read_bytes()  # renamed again: the same machinery
    assert "cool_cat.models.classifier" in (again / "configs/model/digits.yaml").read_text()
    # installs: the wheel's modules import from it, without the template's source on the path
    target = tmp_path / "site"
    sh(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel, cwd=tmp_path, env=tool_env)
    code = "import mlproject.train, mlproject.core.constants as c; print(mlproject.train.__file__, c.PROJECT_ROOT)"
    out = sh(
        sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}", cwd=root, env=tool_env
    )
    assert out.stdout.split() == [str(target / "mlproject/train.py"), str(root)]
    project_tests(root, "-q", "tests/test_lock.py", "tests/test_docs.py", "tests/test_configs.py")
