"""A warm Python for the test suite's child processes: most of a short run's CPU is its imports (~5 CPU-s of
torch and Lightning a process), paid again by every rank of every multi-process proof.

`start()` runs one server process that imports torch, Lightning, the libraries runs use and the package once,
before any thread or accelerator exists, and returns the path of a stand-in interpreter (which waits for the
server while it still imports: a cold start costs more). `[stand_in, "-m", "mlproject.train", ...]`
behaves as `python -m mlproject.train ...` would: the server forks a child that takes the stand-in's
stdin, stdout and stderr, working directory, environment and arguments, and runs the module as `__main__`.
The stand-in mirrors the child: a signal sent to it reaches the child's process group (the child is a session
leader, so its own children, e.g. the local ranks it starts, get it too, as in `kill -TERM -<pgid>`), the
child's exit status is its own (a child killed by signal N kills the stand-in with N), and a stand-in that
dies (SIGKILL) takes the child's group with it. Inside the child `sys.executable` is the stand-in, so the
ranks it starts are warm too. Anything the server cannot run as a cold interpreter would (other modules,
other Python options, thread settings, which bind at import, or a PYTHONPATH other than folders put before the
server's) is handed to the real interpreter with exec: the stand-in is then that process.

What a fork cannot give: every child has the server's hash seed (Python reads PYTHONHASHSEED once, as it starts;
a request that sets another runs cold), so warm ranks iterate a set or dict of strings in one order where cold
ranks may not, and a bug of ranks that disagree can pass warm. The server forks only while it has one thread (a
thread's locks would be copied mid-use): with more, every request runs cold. CI therefore runs the multi-process
proofs cold as well (MLPROJECT_COLD_TESTS=1 in .ci/run).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import random
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

# Environment read at import (thread pools, module search path, hashing, torch's logging and debug levels) or
# cached at the first CUDA query (the visible GPUs, where there are any: gpu()): a request that differs here from
# the server's is run cold (e.g. the ranks of a debug=distributed run, which set TORCH_DISTRIBUTED_DEBUG).
BOUND_AT_IMPORT = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "CUDA_VISIBLE_DEVICES",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "TORCH_LOGS",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_CPP_LOG_LEVEL",
)
WARM_MODULES = ("mlproject.", "torch.distributed.run")  # `-m` targets run warm; scripts under tests/ too
IMPORTS = (  # what a run imports anyway, in the order a run does (s3fs: Lightning's object-storage check)
    "torch",
    "lightning.pytorch",
    "torchmetrics",
    "hydra",
    "omegaconf",
    "rich",
    "torch.distributed.run",
    "torchdata.stateful_dataloader",
    "s3fs",
)
# What some runs import: ~1.1-1.6 CPU-s each. DeepSpeed and inductor ask for a GPU as they import, which must not
# happen before a fork: preloaded only on a machine that has none.
OPTIONAL = ("optuna", "mlflow")
WITHOUT_GPU = ("deepspeed", "torch._inductor.compile_fx")

STAND_IN = r'''#!{python} -S
# The test suite's warm interpreter (tests/helpers/warm.py): asks its server to run this command.
import json, os, signal, socket, sys, time
REAL, SOCKET, TESTS, BOUND = {real!r}, {socket!r}, {tests!r}, {bound!r}  # BOUND: the server's values
SERVER = {server}  # its pid


def cold():
    os.execv(REAL, [REAL, *sys.argv[1:]])


def target(args):
    """(how, what, argv) for `python [-u] -m mod ... | script.py ... | -c code ...`, or None."""
    while args[:1] == ["-u"]:
        args = args[1:]
    if args[:1] == ["-m"] and len(args) > 1 and args[1].startswith({warm_modules!r}):
        return "module", args[1], args[1:]
    if args[:1] == ["-c"] and len(args) > 1:
        return "code", args[1], ["-c", *args[2:]]
    if args and args[0].endswith(".py") and os.path.realpath(args[0]).startswith(TESTS):
        return "script", os.path.realpath(args[0]), args
    return None


def starting():
    """The server is alive (not a zombie) and still importing: waiting for it costs less than a cold start."""
    try:
        with open(f"/proc/{{SERVER}}/stat") as stat:
            return not os.path.exists(SOCKET) and stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def extra_path():
    """The folders this PYTHONPATH puts before the server's (a user's module beside the package), which the child
    puts on sys.path as a cold start would; None where it differs otherwise or a folder holds a module of a name
    the server imported (the child would get the server's)."""
    mine, servers = os.environ.get("PYTHONPATH") or "", BOUND["PYTHONPATH"] or ""
    if servers and not (mine == servers or mine.endswith(os.pathsep + servers)):
        return None
    extra = [p for p in mine[: len(mine) - len(servers)].split(os.pathsep) if p]
    with open(SOCKET + ".modules") as f:
        imported = set(f.read().split())
    names = {{n.partition(".")[0] for p in extra if os.path.isdir(p) for n in os.listdir(p)}}
    return None if names & imported else extra


run = target(sys.argv[1:])
# started by SLURM (tests/cluster): as a user's job would be, with the real interpreter
bound = any(os.environ.get(k) != v for k, v in BOUND.items() if k != "PYTHONPATH")
if run is None or "SLURM_JOB_ID" in os.environ or bound:
    cold()
while starting():
    time.sleep(0.05)
path = extra_path() if os.path.exists(SOCKET) else None  # no socket: the server ended
if path is None:
    cold()
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    server.connect(SOCKET)
    request = json.dumps({{"run": run, "cwd": os.getcwd(), "env": dict(os.environ), "path": path}}).encode()
    socket.send_fds(server, [request], [0, 1, 2])
    pid = int(server.recv(64))
except (OSError, ValueError):
    cold()  # no server (it ended, or never started): be the real interpreter


def forward(signum, frame):
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:  # the child has not made its session yet, or has ended
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, forward)
status = int(server.recv(64) or -signal.SIGKILL)
sys.stdout.flush()
if status >= 0:
    os._exit(status)
if -status != signal.SIGKILL:
    signal.signal(-status, signal.SIG_DFL)
os.kill(os.getpid(), -status)
'''


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)


def _receive(conn: socket.socket) -> bytes:
    try:
        return conn.recv(64)
    except OSError:  # reset by a stand-in that died
        return b""


def gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def preloaded() -> list[str]:
    """IMPORTS, the optional libraries, and every module of the package but its entry points (`-m` runs them as
    `__main__`: imported already, they would run twice)."""
    import importlib.util
    import pkgutil

    import mlproject

    package = [
        m.name
        for m in pkgutil.walk_packages(mlproject.__path__, "mlproject.")
        if '__name__ == "__main__"' not in Path(importlib.util.find_spec(m.name).origin).read_text()
    ]
    return [*IMPORTS, *OPTIONAL, *(() if gpu() else WITHOUT_GPU), *package]


def one_thread() -> bool:
    """Whether this process has a single thread, the only state a fork copies soundly."""
    return len(os.listdir("/proc/self/task")) == 1


def serve(path: str, stand_in: str) -> dict:
    """The server's loop. Returns only in a forked child, with the request it is to run."""
    _die_with_parent()
    for name in preloaded():
        with contextlib.suppress(ImportError):  # an optional extra that is not installed
            __import__(name)
    gc.freeze()  # children's collections skip what is imported here: its pages stay shared, not copied
    Path(path + ".modules").write_text("\n".join(sorted({m.partition(".")[0] for m in sys.modules})))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.replace(path + ".tmp", path)  # stand-ins run cold until the imports are done
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "children")
    children: dict[int, socket.socket] = {}  # pid -> its stand-in's connection
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    request = json.loads(data)
                except (OSError, ValueError):
                    conn.close()
                    continue
                if not one_thread():  # a thread's locks would be copied mid-use: no fork,
                    for fd in fds:  # the stand-in reads no pid and runs cold
                        os.close(fd)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for fd in (listener.fileno(), wake_r, wake_w, *(c.fileno() for c in children.values())):
                        os.close(fd)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    conn.close()
                    request["stand_in"] = stand_in
                    return request
                for fd in fds:
                    os.close(fd)
                conn.sendall(str(pid).encode())
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "children":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    if conn := children.pop(pid, None):
                        with contextlib.suppress(KeyError):  # unregistered already if its stand-in died
                            selector.unregister(conn)
                        with contextlib.suppress(OSError):
                            conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
                        conn.close()
            elif children.get(key.data) is not key.fileobj:
                continue  # its child was reaped earlier in this round, and the connection closed
            elif not _receive(key.fileobj):  # the stand-in died: so does its child's process group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(key.data, signal.SIGKILL)
                selector.unregister(key.fileobj)


def run_child(request: dict) -> None:
    """In the forked child: become the process the stand-in was asked to be, run it, and exit as Python would,
    less the interpreter's teardown, which would touch (and so copy) every page shared with the server."""
    os.setsid()
    _die_with_parent()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Lightning reads the process's rank from the environment once, at import (in the server): read it again
    # here, as a fresh interpreter would (a rank-1 child otherwise believes it is rank 0 until Trainer setup).
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams, kept for its life
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    sys.executable = request["stand_in"]
    random.seed()  # a new interpreter's streams, not the server's copy
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    how, what, argv = request["run"]
    sys.argv = list(argv)
    sys.path[1:1] = request["path"]  # PYTHONPATH's folders before the server's, as a cold start puts them
    code = 0
    try:
        if how == "module":
            sys.path[0] = request["cwd"]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif how == "script":
            sys.path[0] = os.path.dirname(what)
            runpy.run_path(what, run_name="__main__")
        else:
            sys.path[0] = ""
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit, in its order: threading's exit hooks (they stop executor workers), then
    # waiting for non-daemon threads, then the atexit functions.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def start(project_root: Path, env: dict[str, str], main: str = "tests.helpers.warm") -> tuple[str, subprocess.Popen]:
    """Start the server with `env` (the environment test runs get); returns (stand-in path, server). `main`: the
    module the server runs as `python -m main socket stand_in` (tests/test_warm.py's, to prove a server state)."""
    folder, cuda = tempfile.mkdtemp(prefix="warm-python-"), gpu()
    path, stand_in = f"{folder}/server.sock", f"{folder}/python"
    cmd = [sys.executable, "-m", main, path, stand_in]
    with open(f"{folder}/server.log", "w") as log:
        server = subprocess.Popen(cmd, cwd=project_root, env=env, start_new_session=True, stdout=log, stderr=log)
    Path(stand_in).write_text(
        STAND_IN.format(
            python=sys.executable,
            real=sys.executable,
            socket=path,
            server=server.pid,
            tests=str(project_root / "tests"),
            bound={k: env.get(k) for k in BOUND_AT_IMPORT if cuda or k != "CUDA_VISIBLE_DEVICES"},
            warm_modules=WARM_MODULES,
        )
    )
    os.chmod(stand_in, 0o755)
    return stand_in, server


if __name__ == "__main__":
    sys.path[0] = os.getcwd()
    run_child(serve(*sys.argv[1:3]))
