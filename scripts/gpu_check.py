"""Run every strategy on the GPU with bf16 for a few steps and print one table; exit 1 if any failed.

    python scripts/gpu_check.py                    # all strategies, every visible GPU, the GPT example
    python scripts/gpu_check.py --strategies ddp fsdp --steps 30

Each strategy trains `experiment=gpt_large` (the ~114M-parameter GPT) for --steps optimizer steps in a
fresh process, with no validation, test, checkpoints or loggers. Step time is the median over the steps
after the first few; tokens/s = global batch x block size / step time; MFU = model FLOPs per token
(6 x parameters + attention, as in the PaLM paper) x tokens/s / (bf16 dense peak of the GPU x GPUs),
shown only for GPUs whose peak is listed below. Peak memory is rank 0's torch.cuda.max_memory_allocated.
Budget: about 30 s per strategy on one GPU, under 8 minutes in all.
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
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
    "fsdp",
    "tp",
    "fsdp_tp",
]
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12}  # dense, per GPU
WARMUP_STEPS = 5  # first steps (allocator, kernels, DeepSpeed buckets) are not steady state


def peak_flops(name: str) -> float | None:
    return next((v for k, v in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def run_one(strategy: str, devices: int, steps: int, batch: int, block: int, tmp: str) -> dict:
    out = f"{tmp}/{strategy}.json"
    cmd = [sys.executable, "-m", "mlproject.train", "experiment=gpt_large", f"strategy={strategy}"]
    cmd += [f"trainer.devices={1 if strategy == 'single' else devices}", "trainer.precision=bf16-mixed"]
    cmd += [f"+trainer.max_steps={steps}", "+trainer.limit_val_batches=0", "test=false", "callbacks=none", "~logger"]
    cmd += [f"data.batch_size={batch}", f"data.block_size={block}", "extras.print_config=false"]
    cmd += [f"paths.log_dir={tmp}/logs", "+callbacks.timer._target_=bench.step_timer", f"+callbacks.timer.out={out}"]
    if strategy == "tp" or strategy == "fsdp_tp":
        cmd += [f"strategy.tensor_parallel_size={devices if strategy == 'tp' else max(1, devices // 2)}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "scripts")]))
    env.pop("MLPROJECT_RUN_ID", None)
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    row = {"strategy": strategy, "ok": proc.returncode == 0 and Path(out).exists(), "wall_s": time.time() - start}
    if not row["ok"]:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        row["error"] = lines[-1][:160] if lines else f"exit code {proc.returncode}"
        return row
    rec = json.loads(Path(out).read_text())
    times = rec["times"]
    step_s = statistics.median(b - a for a, b in zip(times[WARMUP_STEPS:], times[WARMUP_STEPS + 1 :], strict=False))
    row.update(step_s=step_s, tokens_per_s=batch * block / step_s, params=rec["params"], memory=rec["peak_memory"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, help="configs/strategy/ names to run")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per strategy")
    parser.add_argument("--batch", type=int, default=16, help="global batch size (sequences)")
    parser.add_argument("--block", type=int, default=256, help="tokens per sequence")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU visible; this script checks the GPU paths only")
    devices, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    print(f"{devices} x {name}; bf16 peak {peak / 1e12:.0f} TFLOP/s per GPU" if peak else f"{devices} x {name}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            rows.append(run_one(strategy, devices, args.steps, args.batch, args.block, tmp))
            r = rows[-1]
            print(f"  {strategy}: {'ok' if r['ok'] else 'FAILED: ' + r['error']} ({r['wall_s']:.0f}s)", flush=True)

    # 6N per token for the weights, 12 * layers * block * width for attention (PaLM, appendix B).
    n_layer, n_embd = 16, 768  # experiment=gpt_large
    head = f"{'strategy':<26} {'ok':<4} {'step ms':>8} {'tokens/s':>10} {'peak GiB':>9} {'MFU':>6}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if not r["ok"]:
            print(f"{r['strategy']:<26} {'no':<4} {r['error']}")
            continue
        gpus = 1 if r["strategy"] == "single" else devices
        flops_per_token = 6 * r["params"] + 12 * n_layer * args.block * n_embd
        mfu = f"{flops_per_token * r['tokens_per_s'] / (peak * gpus):.1%}" if peak else "n/a"
        print(
            f"{r['strategy']:<26} {'yes':<4} {r['step_s'] * 1e3:>8.1f} {r['tokens_per_s']:>10.0f} "
            f"{r['memory'] / 2**30:>9.2f} {mfu:>6}"
        )
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
