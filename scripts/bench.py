"""Training throughput of the template against a plain PyTorch loop and against the same LightningModule in a
bare Lightning `Trainer`: same model, data, batch, optimizer.

    python scripts/bench.py                 # the first example: single process and ddp with 2 processes, on CPU
    python scripts/bench.py --worlds 1 --epochs 8 data.batch_size=256
    python scripts/bench.py --example <name> --epochs 3 --steps 20   # another example (--help lists them)
    python scripts/bench.py --device cuda --worlds 1 --epochs 3 --steps 30 experiment=<recipe>

Each side runs as its own fresh process (or one per rank: gloo on CPU, nccl on GPUs), so startup is
measured the same way: from the launch of the command to the end of the first optimizer step. Steady-state
steps/s is measured over training steps only: steps that span an epoch boundary (validation, checkpoints,
shuffling) and the first epoch (compilation, warm-up) are left out (median step time). Rank 0's CPU time per
step is reported too: on a shared machine it is far less sensitive to other processes than the wall clock.
The template runs with its default callbacks and CSV logger on. The bare side (CPU, one process) runs the
example's LightningModule and datamodule in `lightning.Trainer` with this Lightning version's defaults, no
callbacks (no progress bar, no checkpoints) and no logger; only the clipping, precision and epochs are the
config's. Every side uses one thread per process (OMP_NUM_THREADS=1).

--device cuda: the template runs with trainer=gpu (one GPU per process); the plain loop composes the same
config and takes its precision (bf16 autocast for bf16-mixed), model.compile (the project's apply_compile,
as the template) and fused AdamW (training/optim.adamw) from it, with pinned batches copied non-blocking and
no host sync in its steps. Step times come from CUDA events on the GPU's own timeline (StepClock); the table
adds tokens/s, MFU (models with flops_per_token on a GPU of known bf16 peak) and rank 0's peak memory.
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
EXAMPLES = {  # overrides selecting each example's model and data
    # feature: digits
    "digits": [],  # the default config
    # /feature: digits
    # feature: gpt
    "gpt": ["experiment=gpt"],
    # /feature: gpt
}


class StepClock:
    """The end of every training step, on both sides alike: wall time, CPU time, epoch. On a GPU the host
    queues steps ahead of the device, so its clock says nothing there: each step also records a CUDA event,
    and the step times are read from the GPU's own timeline at the end (no host sync per step). The one sync
    is at the end of the first step, whose wall time is the startup figure."""

    def __init__(self, cuda: bool):
        self.cuda, self.times, self.cpu, self.epochs, self.events = cuda, [], [], [], []

    def tick(self, epoch: int) -> None:
        if self.cuda:
            import torch

            if not self.events:
                torch.cuda.synchronize()  # startup ends when the first step has run, not when it was queued
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        self.times.append(time.time())
        self.cpu.append(time.process_time())
        self.epochs.append(epoch)

    def record(self) -> dict:
        times, memory = self.times, 0
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            times = [times[0] + self.events[0].elapsed_time(e) / 1e3 for e in self.events]  # ms after step 1
            memory = torch.cuda.max_memory_allocated()
        return {"times": times, "cpu": self.cpu, "epochs": self.epochs, "peak_memory": memory}


def step_timer(out: str):
    """A Lightning callback that records the end of every training step (StepClock) on rank 0, the parameter
    count, the model's FLOPs per token (if it has them), the batch shape and peak GPU memory. Built in a
    function so that importing this file does not import Lightning. scripts/gpu_check.py uses it too."""
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.clock = StepClock(trainer.strategy.root_device.type == "cuda")

        def on_train_batch_end(self, trainer, *args) -> None:
            self.clock.tick(trainer.current_epoch)

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_rank == 0:
                # ZeRO-3 keeps a shard per rank (ds_numel is the full size); DTensor.numel() is already global.
                params = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters())
                record = self.clock.record()
                record.update(params=params, flops_per_token=getattr(pl_module, "flops_per_token", 0))
                data = trainer.datamodule
                record.update(batch_size=data.batch_size, block_size=data.hparams.get("block_size", 1))
                Path(out).write_text(json.dumps(record))

    return StepTimer()


def config(overrides: list[str]):
    """The template's composed train config (what `python -m mlproject.train <overrides>` would run)."""
    from hydra import compose, initialize_config_dir

    sys.path.insert(0, str(ROOT / "src"))
    from mlproject.core.resolvers import register_resolvers

    register_resolvers()  # trainer.precision is ${precision:...}
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides)


def device_overrides(device: str, world: int) -> list[str]:
    """What selects the device and the process count: the template runs with these, and the plain loop
    composes its config with them, so that both read the same precision and compile setting."""
    if device == "cpu":
        return ["trainer=cpu", *(["strategy=ddp", f"trainer.devices={world}"] if world > 1 else [])]
    return ["trainer=gpu", f"trainer.devices={world}", *(["strategy=ddp"] if world > 1 else [])]


def plain_worker(
    rank: int, world: int, port: int, epochs: int, steps: int, overrides: list[str], out: str, device: str = "cpu"
) -> None:
    """The loop a careful person writes by hand: no framework, DDP when world > 1. Data, network, optimizer,
    schedule, clipping, precision and compile come from the template's own config (Hydra compose, with
    device_overrides), so both sides train the same thing the same way."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader, DistributedSampler

    cfg = config(overrides)
    from mlproject.distributed.parallel import apply_compile
    from mlproject.training.optim import adamw, warmup_cosine

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    if world > 1:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    precision = str(cfg.trainer.precision)
    if precision not in ("32-true", "32", "bf16-mixed"):
        sys.exit(f"bench: the plain loop runs trainer.precision 32-true or bf16-mixed, not {precision}")
    bf16 = precision == "bf16-mixed"  # autocast the forward and the loss, as Lightning's MixedPrecision does
    torch.manual_seed(42)
    data = instantiate(cfg.data)
    data.setup()
    sampler = DistributedSampler(data.train_set, world, rank, shuffle=True, seed=42, drop_last=True)
    workers = cfg.data.get("num_workers", 0)
    loader = DataLoader(
        data.train_set,
        batch_size=cfg.data.batch_size // world,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda and cfg.data.get("pin_memory", False),
        persistent_workers=workers > 0,
    )
    steps = min(steps, len(loader))
    model = instantiate(cfg.model.net).to(device)
    flops_per_token = model.flops_per_token() if hasattr(model, "flops_per_token") else 0
    if cfg.model.get("compile"):
        apply_compile(model)  # what the template does under single and ddp: the whole network, in place
    # fused on CUDA, foreach on the CPU, as in the template; its defaults: no LR scaling, warmup in steps (the
    # keys only configure() reads are dropped)
    opt = adamw(model, **{k: v for k, v in cfg.model.optimizer.items() if k not in ("lr_scaling", "base_batch_size")})
    sched = warmup_cosine(
        opt, epochs * steps, **{k: v for k, v in cfg.model.scheduler.items() if k != "warmup_fraction"}
    )
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    clock = StepClock(cuda)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in itertools.islice(loader, steps):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device, torch.bfloat16, enabled=bf16):
                logits = model(x)  # (batch, classes) or (batch, time, vocab)
                loss = F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
            opt.step()
            sched.step()
            clock.tick(epoch)
    if rank == 0:
        record = clock.record() | {"flops_per_token": flops_per_token, "batch_size": cfg.data.batch_size}
        record["block_size"] = cfg.data.get("block_size", 1)
        Path(out).write_text(json.dumps(record))
    if world > 1:
        dist.destroy_process_group()


def lightning_worker(epochs: int, steps: int, overrides: list[str], out: str) -> None:
    """The example's LightningModule and datamodule in a bare Trainer: Lightning's defaults, no callbacks but
    the step timer, no logger."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from mlproject.build import instantiate_at

    cfg = config(overrides)
    torch.manual_seed(42)
    model = instantiate_at(cfg, "model")  # as train builds it (the plan is the strategy's)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=steps,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        precision=cfg.trainer.precision,
        callbacks=[step_timer(out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=instantiate(cfg.data))


def run_lightning(epochs: int, steps: int, overrides: list[str], out: str) -> float:
    code = "import json, sys; sys.path.insert(0, sys.argv[1]); import bench; "
    code += "bench.lightning_worker(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5])"
    start = time.time()
    args = [str(ROOT / "scripts"), str(epochs), str(steps), json.dumps(overrides), out]
    subprocess.run([sys.executable, "-c", code, *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(world: int, epochs: int, steps: int, overrides: list[str], out: str, device: str) -> float:
    code = (
        "import json, sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import bench; "
        "w, e, s, o, x, d = *map(int, sys.argv[2:5]), json.loads(sys.argv[5]), *sys.argv[6:8]; "
        "bench.plain_worker(0, 1, 0, e, s, o, x, d) if w == 1 else "
        "mp.start_processes(bench.plain_worker, args=(w, bench.free_port(), e, s, o, x, d), nprocs=w, "
        "start_method='spawn')"
    )
    start = time.time()
    args = [str(ROOT / "scripts"), str(world), str(epochs), str(steps), json.dumps(overrides), out, device]
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT)
    # torch 2.13 sometimes aborts a gloo process at interpreter exit, after all work is done; the record
    # written at the end of training says whether it was
    if proc.returncode and not Path(out).exists():
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return start


def run_template(overrides: list[str], epochs: int, steps: int, out: str, log_dir: str) -> float:
    cmd = [sys.executable, "-m", "mlproject.train", f"trainer.max_epochs={epochs}"]
    cmd += [f"trainer.limit_train_batches={steps}", f"paths.log_dir={log_dir}", "test=false"]
    cmd += ["extras.print_config=false", *overrides]
    cmd += ["+callbacks.bench_timer._target_=bench.step_timer", f"+callbacks.bench_timer.out={out}"]
    # prepended, not replacing: the GPU machine finds the wheels it lacks (hydra, ...) on PYTHONPATH
    path = [str(ROOT / "src"), str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
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
        "tokens_per_step": rec.get("batch_size", 0) * rec.get("block_size", 1),
        "flops_per_token": rec.get("flops_per_token", 0),
        "memory": rec.get("peak_memory", 0),
    }


def check_cuda(overrides: list[str], worlds: list[int]) -> float | None:
    """Compose the template's GPU config (bad overrides fail here, before any run), check that enough GPUs are
    visible, and return the GPU's dense bf16 peak FLOP/s when the runs are bf16 and the GPU is known."""
    from hydra.errors import HydraException

    try:
        cfg = config([*device_overrides("cuda", max(worlds)), *overrides])
    except HydraException as e:
        sys.exit(f"bench: {' '.join(str(e).split())}")
    import torch

    settings = f"trainer=gpu, model.compile={cfg.model.get('compile', False)}"
    if not torch.cuda.is_available():
        sys.exit(f"bench: --device cuda, but no CUDA GPU visible (config composed: {settings})")
    if torch.cuda.device_count() < max(worlds):
        sys.exit(f"bench: --worlds {max(worlds)} needs as many GPUs; {torch.cuda.device_count()} visible")
    from mlproject.callbacks.throughput import peak_flops

    name, precision = torch.cuda.get_device_name(0), str(cfg.trainer.precision)
    peak = peak_flops(name) if "bf16" in precision else None
    print(f"{torch.cuda.device_count()} x {name}; {settings}, trainer.precision={precision}", flush=True)
    return peak


def print_cpu_table(rows) -> None:
    print(f"{'processes':>9} {'side':>9} {'steps/s':>9} {'CPU ms/step':>12} {'startup s':>10}")
    for world, p, t, bare in rows:
        for side, r in (("plain", p), ("lightning", bare), ("template", t)):
            if r:
                print(f"{world:>9} {side:>9} {r['steps_per_s']:>9.1f} {r['cpu_ms']:>12.2f} {r['startup_s']:>10.2f}")
        for name, r in (("/ plain", p), ("/ bare", bare)):
            if r:
                speed, cpu, startup = t["steps_per_s"] / r["steps_per_s"], r["cpu_ms"] / t["cpu_ms"], t["startup_s"]
                print(f"{world:>9} {name:>9} {speed:>9.3f} {cpu:>12.3f} {startup - r['startup_s']:>+10.2f}")
    print(
        "/ plain, / bare: template / plain loop and template / bare Lightning steps/s (wall clock, and from rank "
        "0's CPU time); startup: template - the other"
    )


def print_gpu_table(rows, peak: float | None) -> None:
    head = f"{'GPUs':>4} {'side':>9} {'steps/s':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'CPU ms/step':>12}"
    print(head + f" {'startup s':>10}")
    for world, p, t, _ in rows:
        for side, r in (("plain", p), ("template", t)):
            tokens = r["steps_per_s"] * r["tokens_per_step"]
            mfu = f"{r['flops_per_token'] * tokens / (peak * world):.1%}" if peak and r["flops_per_token"] else "n/a"
            print(
                f"{world:>4} {side:>9} {r['steps_per_s']:>9.2f} {tokens:>10.0f} {mfu:>6} {r['memory'] / 2**30:>9.2f} "
                f"{r['cpu_ms']:>12.2f} {r['startup_s']:>10.2f}"
            )
        speed, memory = t["steps_per_s"] / p["steps_per_s"], (t["memory"] - p["memory"]) / 2**30
        cpu, startup = p["cpu_ms"] / t["cpu_ms"], t["startup_s"] - p["startup_s"]
        print(
            f"{world:>4} {'ratio':>9} {speed:>9.3f} {speed:>10.3f} {'':>6} {memory:>+9.2f} {cpu:>12.3f} "
            f"{startup:>+10.2f}"
        )
    print(
        "ratio: template / plain steps/s and tokens/s (CUDA events), plain / template CPU ms; peak GiB and "
        "startup: template - plain. MFU: dense bf16 peak, n/a for other precisions or GPUs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--example", choices=sorted(EXAMPLES), default=next(iter(EXAMPLES)), help="model and data to train"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides train")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="process counts to compare")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run")
    parser.add_argument("--steps", type=int, default=10**9, help="at most this many optimizer steps per epoch")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side; the best one counts")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. model.net.channels=96")
    args = parser.parse_args()
    overrides = [*EXAMPLES[args.example], *args.overrides]
    peak = check_cuda(overrides, args.worlds) if args.device == "cuda" else None
    # One thread per process on both sides: the CPU runs are otherwise dominated by thread oversubscription.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            side_overrides = [*device_overrides(args.device, world), *overrides]
            best = {}
            sides = ("plain", "lightning", "template") if args.device == "cpu" and world == 1 else ("plain", "template")
            for i in range(args.repeats):  # alternate the sides so background load hits them alike
                for side in sides:
                    out = f"{tmp}/{side}_{world}_{i}.json"
                    # cold compiler caches for every run (model.compile): else the second side would start
                    # from the kernels the first one compiled
                    cache = f"{tmp}/cache_{side}_{world}_{i}"
                    os.environ.update(TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
                    if side == "plain":
                        start = run_plain(world, args.epochs, args.steps, side_overrides, out, args.device)
                    elif side == "lightning":
                        start = run_lightning(args.epochs, args.steps, side_overrides, out)
                    else:
                        start = run_template(side_overrides, args.epochs, args.steps, out, f"{tmp}/logs")
                    r = summarise(out, start)
                    b = best.setdefault(side, r)
                    b["steps_per_s"] = max(b["steps_per_s"], r["steps_per_s"])
                    b["startup_s"] = min(b["startup_s"], r["startup_s"])
                    b["cpu_ms"] = min(b["cpu_ms"], r["cpu_ms"])
            rows.append((world, best["plain"], best["template"], best.get("lightning")))
    print_cpu_table(rows) if args.device == "cpu" else print_gpu_table(rows, peak)


if __name__ == "__main__":
    main()
