"""Run every strategy on the GPU with bf16 for a few steps and print one table; exit 1 if any failed.

    python scripts/gpu_check.py                    # all strategies, every visible GPU, the GPT example
    python scripts/gpu_check.py --strategies ddp fsdp --steps 30
    python scripts/gpu_check.py --experiment gpt_124m --steps 30   # one GPU: eager, compiled, no host syncs

Each row trains an experiment (default `gpt_large`, the ~114M-parameter GPT, batch 16 x 256 tokens) for
--steps optimizer steps in a fresh process, with no validation, test, checkpoints or loggers. Step time is
the median over the steps after the first few, read from CUDA events (bench.StepClock: no host sync per
step); tokens/s = global batch x block size / step time; MFU = the model's FLOPs per token (6 x weights +
attention, nanoGPT's estimate) x tokens/s / (bf16 dense peak of the GPU x GPUs), shown only for GPUs whose
peak is known (mlproject.callbacks.throughput). Peak memory is rank 0's torch.cuda.max_memory_allocated.

`--experiment gpt_124m` runs on one GPU with its own batch (32 x 1024): model.compile=false, then true,
then compiled again with torch.cuda.set_sync_debug_mode("error") over the steady-state steps, which fails
the row on any host-device sync (between the steps where metrics are logged and signals checked).
Budget: about 30 s per row on one GPU, under 8 minutes in all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = [
    "single",
    "ddp",
    "ddp_spawn",
    # feature: deepspeed
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
    # /feature: deepspeed
    "fsdp",
    "hsdp",
    # feature: tensor
    "tp",
    "fsdp_tp",
    # /feature: tensor
    # feature: pipeline
    "pp",  # 2 pipeline stages (1F1B), FSDP over the rest: an even number of GPUs
    # /feature: pipeline
    "moe",  # model=gpt_moe (4 experts per block, top-2) on one GPU
    # feature: expert
    "moe_ep",  # model=gpt_moe under fsdp, its experts split over up to 4 GPUs: an even number of GPUs
    # /feature: expert
]
# rows that are not a strategy config alone; "single" and "moe" run on one GPU, the rest on every visible GPU
ROWS = {"moe": ["model=gpt_moe", "strategy=single"], "moe_ep": ["model=gpt_moe", "strategy=fsdp"]}
ONE_GPU = ("single", "moe")
WARMUP_STEPS = 5  # first steps (allocator, kernels, compilation, a strategy's buckets) are not steady state


def sync_check(first: int, last: int):
    """A callback that makes any host-device sync an error during optimizer steps first..last-1 (built in a
    function so that importing this script does not import Lightning)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class SyncCheck(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            torch.cuda.set_sync_debug_mode("error" if first <= trainer.global_step < last else "default")

        def on_train_end(self, trainer, pl_module) -> None:
            torch.cuda.set_sync_debug_mode("default")

    return SyncCheck()


def no_sync_overrides(steps: int) -> list[str]:
    """A run of `steps` optimizer steps in which any host-device sync during the steady-state steps
    (WARMUP_STEPS..steps-2) fails it. What syncs by design, every N steps, happens only at the last step:
    metrics logged, signals agreed (cluster/requeue.py); no progress bar reads the loss, and no checkpoint is
    written (Lightning adds one that saves at every epoch end). tests/gpu/ uses it too."""
    return [
        "+callbacks.sync._target_=gpu_check.sync_check",
        f"+callbacks.sync.first={WARMUP_STEPS}",
        f"+callbacks.sync.last={steps - 1}",
        "++trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false",  # a key of configs/trainer/default.yaml
        f"trainer.log_every_n_steps={steps}",
        f"cluster.signal_check_every_n_steps={steps}",
    ]


def run_one(name: str, experiment: str, overrides: list[str], steps: int, tmp: str) -> dict:
    out = f"{tmp}/{name}.json"
    cmd = [sys.executable, "-m", "mlproject.train", f"experiment={experiment}", "trainer.precision=bf16-mixed"]
    cmd += [f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "test=false", "callbacks=none", "~logger"]
    cmd += ["extras.print_config=false", *overrides]
    cmd += [f"paths.log_dir={tmp}/logs", "+callbacks.timer._target_=bench.step_timer", f"+callbacks.timer.out={out}"]
    # prepended, not replacing: the GPU machine finds the wheels it lacks (hydra, ...) on PYTHONPATH
    path = [str(ROOT / "src"), str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.pop("MLPROJECT_RUN_ID", None)
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    row = {"strategy": name, "ok": proc.returncode == 0 and Path(out).exists(), "wall_s": time.time() - start}
    if not row["ok"]:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error: ")]  # a bug's report ends with where its traceback is
        row["error"] = (errors or lines)[-1][:160] if lines else f"exit code {proc.returncode}"
        return row
    rec = json.loads(Path(out).read_text())
    times = rec["times"]
    step_s = statistics.median(b - a for a, b in zip(times[WARMUP_STEPS:], times[WARMUP_STEPS + 1 :], strict=False))
    tokens = rec["batch_size"] * rec["block_size"] / step_s
    row.update(step_s=step_s, tokens_per_s=tokens, flops_per_token=rec["flops_per_token"], memory=rec["peak_memory"])
    return row


def rows_to_run(args, devices: int) -> list[tuple[str, list[str]]]:
    """(row name, overrides) for the experiment chosen."""
    shape = [f"data.batch_size={b}" for b in [args.batch] if b] + [f"data.block_size={b}" for b in [args.block] if b]
    if args.experiment == "gpt_124m":
        return [
            ("gpt_124m eager", [*shape, "model.compile=false"]),
            ("gpt_124m compiled", shape),
            ("gpt_124m no syncs", [*shape, *no_sync_overrides(args.steps)]),
        ]
    rows = []
    for strategy in args.strategies:
        if strategy in ("pp", "moe_ep") and devices % 2:  # a process per stage; EP needs 2+ ranks
            print(f"  {strategy}: skipped, needs an even number of GPUs ({devices} visible)")
            continue
        overrides = [*ROWS.get(strategy, [f"strategy={strategy}"]), *shape]
        overrides.append(f"trainer.devices={1 if strategy in ONE_GPU else devices}")
        # feature: tensor
        if strategy == "tp" or strategy == "fsdp_tp":
            overrides += [f"strategy.tensor_parallel_size={devices if strategy == 'tp' else max(1, devices // 2)}"]
        # /feature: tensor
        if strategy == "hsdp":  # one machine: two replicas of a shard over half of its GPUs
            overrides += [f"strategy.replicate_size={2 if devices % 2 == 0 else 1}"]
        # feature: pipeline
        if strategy == "pp":  # gpt_large's 16 blocks in 2 stages of 8, 4 micro-batches (the default)
            overrides += ["strategy.pipeline_parallel_size=2"]
        # /feature: pipeline
        # feature: expert
        if strategy == "moe_ep":  # the 4 experts divide over 2 or 4 ranks of a shard group
            overrides += [f"strategy.expert_parallel_size={4 if devices % 4 == 0 else 2}"]
        # /feature: expert
        rows.append((strategy, overrides))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, help="strategy configs, moe, moe_ep")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per strategy")
    parser.add_argument("--experiment", default="gpt_large", choices=["gpt_large", "gpt_124m"], help="what trains")
    parser.add_argument("--batch", type=int, default=None, help="global batch size (default: 16; gpt_124m: its own)")
    parser.add_argument("--block", type=int, default=None, help="tokens per sequence (default: 256; gpt_124m: its own)")
    args = parser.parse_args()
    if args.experiment == "gpt_large":
        args.batch, args.block = args.batch or 16, args.block or 256

    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from mlproject.callbacks.throughput import peak_flops

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU visible; this script checks the GPU paths only")
    devices, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    print(f"{devices} x {name}; bf16 peak {peak / 1e12:.0f} TFLOP/s per GPU" if peak else f"{devices} x {name}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in rows_to_run(args, devices):
            rows.append(run_one(name, args.experiment, overrides, args.steps, tmp))
            r = rows[-1]
            print(f"  {name}: {'ok' if r['ok'] else 'FAILED: ' + r['error']} ({r['wall_s']:.0f}s)", flush=True)

    head = f"{'run':<26} {'ok':<4} {'step ms':>8} {'tokens/s':>10} {'peak GiB':>9} {'MFU':>6}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if not r["ok"]:
            print(f"{r['strategy']:<26} {'no':<4} {r['error']}")
            continue
        gpus = devices if r["strategy"] in args.strategies and r["strategy"] not in ONE_GPU else 1
        mfu = f"{r['flops_per_token'] * r['tokens_per_s'] / (peak * gpus):.1%}" if peak else "n/a"
        print(
            f"{r['strategy']:<26} {'yes':<4} {r['step_s'] * 1e3:>8.1f} {r['tokens_per_s']:>10.0f} "
            f"{r['memory'] / 2**30:>9.2f} {mfu:>6}"
        )
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
