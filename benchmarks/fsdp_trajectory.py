"""Trajectory steps with the model sharded over R ranks (covgrad.distributed.stepper, FSDP2 over gloo) against the
single-process stepper.

Every configuration takes the same steps of rl (Adam, bf16 weights: the stage's defaults) on fixed batches of
``benchmarks.scores``'s model, every parameter tracked: the step's backward and update, the change tracker's
record and, on ranks, the gathering of the changed set onto rank 0. The time of a step is the slowest rank's (a
barrier ends each step), the median over ``--steps`` steps after one warm-up step. The single process runs
``--threads`` threads and each of R ranks max(1, threads // R), so the ratio is the cost of sharding at equal
hardware: every rank runs every row (the single-process gradient's bytes), so R ranks do R times the arithmetic.

    python -m benchmarks.fsdp_trajectory                     # "large" CPU model, 1 process and 2 ranks
    python -m benchmarks.fsdp_trajectory --model small --ranks 2 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.scores import MODELS, build, make_batch
from covgrad.layout import select_parameters
from covgrad.updates import (
    ChangeTracker,
    FixedBatches,
    OptimizerSpec,
    Stepper,
    StepZeroStats,
    bf16_rounded,
    run_trajectory,
)

SPEC = OptimizerSpec("adam", 1e-4)
PRECISION = "bf16"


def _batches(name: str, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of the model's (B, prompt, response) shape with sequence advantages."""
    vocab, (B, prompt, response) = MODELS[name][1], MODELS[name][8:11]
    out = []
    for b in range(n):
        ids, w = make_batch(vocab, B, prompt, response, seed=100 + b, device=torch.device("cpu"))
        adv = torch.randn(B, generator=torch.Generator().manual_seed(b), dtype=torch.float64)
        mask = torch.ones_like(ids)
        out.append({"input_ids": ids, "attention_mask": mask, "response_mask": w.bool(), "advantages": adv})
    return out


def _stats(P: int, index: np.ndarray | None = None) -> StepZeroStats:
    rng = np.random.default_rng(0)
    F, G = rng.random(P), rng.standard_normal(P)
    cut = slice(None) if index is None else index
    return StepZeroStats(F=F[cut], G=G[cut], rho=G[cut] / np.sqrt(F[cut] + 1), seed=0)


def _timed(steps, sync: bool) -> list[float]:
    """Seconds of each step of the ``steps`` iterator (the first left out)."""
    out, t0 = [], time.perf_counter()
    for _ in steps:
        if sync:
            dist.barrier()
        t1 = time.perf_counter()
        out.append(t1 - t0)
        t0 = t1
    return out[1:]


def single(name: str, n: int, threads: int) -> list[float]:
    """Seconds per step of the single-process stepper and tracker."""
    torch.set_num_threads(threads)
    model = bf16_rounded(build(name, torch.device("cpu")).float())
    layout = select_parameters(model)
    stepper = Stepper(model, SPEC, PRECISION)
    tracker = ChangeTracker(layout, stepper.flat(layout), SPEC, _stats(layout.P))
    return _timed(run_trajectory(stepper, FixedBatches(_batches(name, n)), layout, n, tracker), sync=False)


def _rank(rank: int, ranks: int, init: str, name: str, n: int, threads: int, out: str) -> None:
    from covgrad.distributed import ShardedStepper, gather_changed, rank_shard

    torch.set_num_threads(max(1, threads // ranks))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        model = bf16_rounded(build(name, torch.device("cpu" if rank == 0 else "meta")).float())
        layout = select_parameters(model)
        stepper = ShardedStepper(model, SPEC, PRECISION)
        shard = rank_shard(layout)
        tracker = ChangeTracker(layout, stepper.flat(layout), SPEC, _stats(layout.P, shard.index), shard=shard)
        steps = run_trajectory(stepper, FixedBatches(_batches(name, n)), layout, n, tracker)
        times = _timed((gather_changed(rec["changed"], layout) for rec in steps), sync=True)
        if rank == 0:
            np.save(out, np.asarray(times))
    finally:
        dist.destroy_process_group()


def sharded(name: str, n: int, threads: int, ranks: int) -> list[float]:
    """Seconds per step on ``ranks`` gloo processes (the slowest rank's)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.npy")
        mp.spawn(_rank, args=(ranks, f"file://{tmp}/rendezvous", name, n, threads, out), nprocs=ranks, join=True)
        return np.load(out).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large", choices=list(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=6, help="steps per configuration (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads shared by the ranks")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    B, prompt, response = MODELS[args.model][8:11]
    print(f"model {args.model}: {B} rows of {prompt} + {response} tokens per step, {PRECISION} {SPEC.name}")
    base = statistics.median(single(args.model, args.steps, args.threads))
    print(f"{'configuration':<16}{'s/step':>10}{'ratio':>8}")
    print(f"{'1 process':<16}{base:>10.4f}{1.0:>8.2f}")
    for R in args.ranks:
        t = statistics.median(sharded(args.model, args.steps, args.threads, R))
        print(f"{f'{R} ranks':<16}{t:>10.4f}{t / base:>8.2f}")


if __name__ == "__main__":
    main()
