"""In-run statistics: a trainer's step with and without ``InRunFolder.fold``, side by side in one process.

The trainer's step is what a GRPO-style trainer pays per batch: one forward of the batch in training mode, the
loss −Σ_n A_n Σ_t log p(y_t) / (response tokens), its backward into every parameter's ``.grad``, an AdamW step
and ``zero_grad``. The alternatives run the same ``--steps`` steps (each step a new batch of the model's rows):

- "trainer": the step alone;
- "every_n = 1", "every_n = 10": ``InRunFolder.fold`` of the step's batch before the step, due every n steps
  (one forward and one per-sample backward of the scores stage's engine into fresh float64 moment state, the
  statistics and top-1% sets on the host, the per-step files written to a temporary directory).

Each folder folds one warm-up batch first (the engine traces its first call). Repetitions interleave the
alternatives; reported: the median over repetitions of each alternative's mean time per step, and its ratio to
the trainer's in the same repetition. Timed in process CPU time by default (``--clock wall``: wall time; on a
shared machine other jobs' load enters wall time, not the process's own CPU time).

    python -m benchmarks.inrun                         # small and large CPU models, every_n 1 and 10
    python -m benchmarks.inrun --model small --steps 10 --reps 2 --every 1 5
    python -m benchmarks.inrun --model large --parts   # one fold's time by part instead

``--parts`` times the parts of a fold (median over ``--reps`` folds after a warm-up): the engine's pass into fresh
state, the statistics read off it (``compute_stats`` of the two halves' rows), the three top-1% selections and the
files written.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
from torch import Tensor, nn

from benchmarks.scores import MODELS, build, make_batch
from covgrad.integrations.inrun import METRICS, InRunFolder
from covgrad.integrations.inrun import statistics as fold_statistics
from covgrad.moments.topk import count_for_fraction, topk_indices

Batch = tuple[Tensor, Tensor, Tensor, np.ndarray]  # ids (B, L), attention mask (B, L), response mask (B, L), A (B,)


def batches(name: str, n: int) -> list[Batch]:
    """``n`` batches of the model's (B rows, prompt, response) shape, each with standard normal advantages."""
    vocab, B, prompt, response = MODELS[name][1], *MODELS[name][8:]
    out = []
    for i in range(n):
        ids, w = make_batch(vocab, B, prompt, response, seed=i, device=torch.device("cpu"))
        out.append((ids, torch.ones_like(ids), w, np.random.default_rng(i).standard_normal(B)))
    return out


def trainer_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    """Forward in training mode, −Σ A·log p over response tokens / their count, backward, AdamW step, zero_grad."""
    ids, mask, w, A = batch
    logits = model(input_ids=ids, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(torch.as_tensor(A, dtype=lp.dtype)[:, None] * w[:, 1:] * lp).sum() / w[:, 1:].sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list[Batch], folder: InRunFolder | None) -> None:
    """The trainer's steps over ``data``, each preceded by the folder's fold of its batch when given."""
    for step, batch in enumerate(data):
        if folder is not None:
            folder.fold(step, *batch)
        trainer_step(model, opt, batch)


def measure(name: str, every: Sequence[int], steps: int, reps: int, clock: Callable[[], float], out: str) -> None:
    """Print one table row per alternative of model ``name``."""
    model = build(name, torch.device("cpu")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = batches(name, steps)
    folders: dict[str, InRunFolder | None] = {"trainer": None}
    for n in every:
        folder = InRunFolder(model, every_n=n, out_dir=os.path.join(out, f"{name}-{n}"))
        folder.fold(-steps - n, *data[0])  # warm-up: the first call traces; due again at step 0
        folders[f"every_n = {n}"] = folder
    run_steps(model, opt, data[:2], None)  # warm-up of the trainer's step
    per_step: dict[str, list[float]] = {k: [] for k in folders}
    for _ in range(reps):
        for label, folder in folders.items():
            if folder is not None:
                folder.steps = folder.steps[:1]  # due at step 0 again
            t0 = clock()
            run_steps(model, opt, data, folder)
            per_step[label].append((clock() - t0) / steps)
    P = sum(p.numel() for p in model.parameters())
    B, L = data[0][0].shape
    base = per_step["trainer"]
    for label, times in per_step.items():
        ratio = statistics.median(t / b for t, b in zip(times, base, strict=True))
        print(f"| {name} ({P:,}; {B} rows × {L} tokens) | {label} | {statistics.median(times):.3f} s | {ratio:.2f}× |")


def parts(name: str, reps: int, clock: Callable[[], float], out: str) -> None:
    """Print one table row per part of a fold of model ``name`` (median over ``reps`` folds): the parts of
    ``InRunFolder.fold`` timed one by one."""
    model = build(name, torch.device("cpu")).train()
    data = batches(name, 1)
    folder = InRunFolder(model, every_n=1, out_dir=os.path.join(out, f"{name}-parts"))
    folder.fold(0, *data[0])  # warm-up: the first call traces
    k = count_for_fraction(folder.q, folder.layout.P)
    times: dict[str, list[float]] = {"engine pass": [], "statistics": [], "top-k (3 sets)": [], "files": []}
    for rep in range(reps):
        t0 = clock()
        acc = folder._fold(*folder._batch(*data[0], None, None))
        t1 = clock()
        stats = fold_statistics(acc.rows())
        t2 = clock()
        top = {m: topk_indices(np.abs(stats[src]), k) for m, src in METRICS.items()}
        t3 = clock()
        folder._record(rep + 1, stats, top, 0.0)
        t4 = clock()
        for label, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[label].append(dt)
    P = sum(p.numel() for p in model.parameters())
    for label, ts in times.items():
        print(f"| {name} ({P:,}) | {label} | {statistics.median(ts):.3f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["small", "large"], choices=["small", "large"])
    ap.add_argument("--every", nargs="+", type=int, default=[1, 10], help="every_n of the folders")
    ap.add_argument("--steps", type=int, default=20, help="trainer steps per repetition and alternative")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time or wall time")
    ap.add_argument("--parts", action="store_true", help="time the parts of one fold instead of the steps")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {torch.get_num_threads()} torch threads, clock={args.clock}, torch {torch.__version__}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.parts:
        print("| model (P) | part of a fold | time |\n|---|---|---:|")
    else:
        print("| model (P) | step | time per step | / trainer |\n|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as out:
        for name in args.model:
            if args.parts:
                parts(name, args.reps, clock, out)
            else:
                measure(name, args.every, args.steps, args.reps, clock, out)


if __name__ == "__main__":
    main()
