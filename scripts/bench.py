"""Training throughput of the template against a plain PyTorch loop: same model, data, batch, optimizer.

    python scripts/bench.py                 # digits CNN: single process and ddp with 2 processes, on CPU
    python scripts/bench.py --worlds 1 --epochs 8 model.net.channels=96 data.batch_size=256
    python scripts/bench.py --example gpt --epochs 3 --steps 20

Each side runs as its own fresh process (or 2, with gloo), so startup is measured the same way: from
the launch of the command to the end of the first optimizer step. Steady-state steps/s is measured
over training steps only: steps that span an epoch boundary (validation, checkpoints, shuffling)
and the first epoch are left out (median step time). Rank 0's CPU time per step is reported too: on a
shared machine it is far less sensitive to other processes than the wall clock. The template runs with
its default callbacks and CSV logger on. Both sides use one thread per process (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"digits": [], "gpt": ["experiment=gpt"]}  # overrides selecting each example's model and data


def step_timer(out: str):
    """A Lightning callback that records the end of every training step on rank 0, the parameter count, the
    model's FLOPs per token (if it has them), the batch shape and peak GPU memory. Built in a function so
    that the plain loop, which imports this file, never imports Lightning. scripts/gpu_check.py uses it too."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self):
            self.times, self.cpu, self.epochs = [], [], []

        def on_train_batch_end(self, trainer, *args) -> None:
            self.times.append(time.time())
            self.cpu.append(time.process_time())
            self.epochs.append(trainer.current_epoch)

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_rank == 0:
                # ZeRO-3 keeps a shard per rank (ds_numel is the full size); DTensor.numel() is already global.
                params = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters())
                memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
                record = {"times": self.times, "cpu": self.cpu, "epochs": self.epochs}
                record.update(
                    params=params, peak_memory=memory, flops_per_token=getattr(pl_module, "flops_per_token", 0)
                )
                data = trainer.datamodule
                record.update(batch_size=data.batch_size, block_size=data.hparams.get("block_size", 1))
                Path(out).write_text(json.dumps(record))

    return StepTimer()


def plain_worker(rank: int, world: int, port: int, epochs: int, steps: int, overrides: list[str], out: str) -> None:
    """The loop a careful person writes by hand: no framework, DDP over gloo when world > 1. Data, network,
    optimizer, schedule and clipping come from the template's own config (Hydra compose), so both sides
    train the same thing."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader, DistributedSampler

    sys.path.insert(0, str(ROOT / "src"))
    from mlproject.models.optim import adamw, warmup_cosine

    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(42)
    data = instantiate(cfg.data)
    data.setup()
    sampler = DistributedSampler(data.train_set, world, rank, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(data.train_set, batch_size=cfg.data.batch_size // world, sampler=sampler, drop_last=True)
    steps = min(steps, len(loader))
    model = instantiate(cfg.model.net)
    # the template's defaults: no LR scaling, warmup in steps (the keys only configure() reads are dropped)
    opt = adamw(model, **{k: v for k, v in cfg.model.optimizer.items() if k not in ("lr_scaling", "base_batch_size")})
    sched = warmup_cosine(
        opt, epochs * steps, **{k: v for k, v in cfg.model.scheduler.items() if k != "warmup_fraction"}
    )
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    times, cpu, epoch_of = [], [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in itertools.islice(loader, steps):
            logits = model(x)  # (batch, classes) or (batch, time, vocab)
            loss = F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
            opt.step()
            sched.step()
            times.append(time.time())
            cpu.append(time.process_time())
            epoch_of.append(epoch)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "cpu": cpu, "epochs": epoch_of}))
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(world: int, epochs: int, steps: int, overrides: list[str], out: str) -> float:
    code = (
        "import json, sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import bench; "
        "w, e, s, o, x = *map(int, sys.argv[2:5]), json.loads(sys.argv[5]), sys.argv[6]; "
        "bench.plain_worker(0, 1, 0, e, s, o, x) if w == 1 else "
        "mp.start_processes(bench.plain_worker, args=(w, bench.free_port(), e, s, o, x), nprocs=w, "
        "start_method='spawn')"
    )
    start = time.time()
    args = [str(ROOT / "scripts"), str(world), str(epochs), str(steps), json.dumps(overrides), out]
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT)
    # torch 2.13 sometimes aborts a gloo process at interpreter exit, after all work is done; the record
    # written at the end of training says whether it was
    if proc.returncode and not Path(out).exists():
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return start


def run_template(world: int, epochs: int, steps: int, overrides: list[str], out: str, log_dir: str) -> float:
    strategy = ["strategy=ddp", f"trainer.devices={world}"] if world > 1 else []
    cmd = [sys.executable, "-m", "mlproject.train", "trainer=cpu", *strategy, f"trainer.max_epochs={epochs}"]
    cmd += [f"+trainer.limit_train_batches={steps}", f"paths.log_dir={log_dir}", "test=false"]
    cmd += ["extras.print_config=false", *overrides]
    cmd += ["+callbacks.bench_timer._target_=bench.step_timer", f"+callbacks.bench_timer.out={out}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "scripts")]))
    env.pop("MLPROJECT_RUN_ID", None)
    start = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return start


def summarise(path: str, start: float) -> dict[str, float]:
    rec = json.loads(Path(path).read_text())
    epochs = rec["epochs"]
    steady = [i for i in range(1, len(epochs)) if epochs[i] == epochs[i - 1] > 0]

    def median_step(clock: list[float]) -> float:
        return statistics.median(clock[i] - clock[i - 1] for i in steady)

    return {
        "startup_s": rec["times"][0] - start,
        "steps_per_s": 1 / median_step(rec["times"]),
        "cpu_ms": 1e3 * median_step(rec["cpu"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="digits", help="model and data to train")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="process counts to compare")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run")
    parser.add_argument("--steps", type=int, default=10**9, help="at most this many optimizer steps per epoch")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side; the best one counts")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. model.net.channels=96")
    args = parser.parse_args()
    overrides = [*EXAMPLES[args.example], *args.overrides]
    # One thread per process on both sides: the CPU runs are otherwise dominated by thread oversubscription.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            best = {}
            for i in range(args.repeats):  # alternate the sides so background load hits both alike
                for side in ("plain", "template"):
                    out = f"{tmp}/{side}_{world}_{i}.json"
                    if side == "plain":
                        start = run_plain(world, args.epochs, args.steps, overrides, out)
                    else:
                        start = run_template(world, args.epochs, args.steps, overrides, out, f"{tmp}/logs")
                    r = summarise(out, start)
                    b = best.setdefault(side, r)
                    b["steps_per_s"] = max(b["steps_per_s"], r["steps_per_s"])
                    b["startup_s"] = min(b["startup_s"], r["startup_s"])
                    b["cpu_ms"] = min(b["cpu_ms"], r["cpu_ms"])
            p, t = best["plain"], best["template"]
            rows.append((world, p, t))
    print(f"{'processes':>9} {'side':>9} {'steps/s':>9} {'CPU ms/step':>12} {'startup s':>10}")
    for world, p, t in rows:
        for side, r in (("plain", p), ("template", t)):
            print(f"{world:>9} {side:>9} {r['steps_per_s']:>9.1f} {r['cpu_ms']:>12.2f} {r['startup_s']:>10.2f}")
        speed, cpu = t["steps_per_s"] / p["steps_per_s"], p["cpu_ms"] / t["cpu_ms"]
        print(f"{world:>9} {'ratio':>9} {speed:>9.3f} {cpu:>12.3f} {t['startup_s'] - p['startup_s']:>+10.2f}")
    print("ratio: template / plain steps/s (wall clock, and from rank 0's CPU time); startup: template - plain")


if __name__ == "__main__":
    main()
