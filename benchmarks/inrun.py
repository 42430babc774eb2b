"""In-run statistics: a trainer's step with and without ``InRunFolder.fold``, side by side in one process.

The trainer's step is what a GRPO-style trainer pays per batch: one forward of the batch in training mode, the
loss −Σ_n A_n Σ_t log p(y_t) / (response tokens), its backward into every parameter's ``.grad``, an AdamW step
and ``zero_grad``. The alternatives run the same ``--steps`` steps (each step a new batch of the model's rows):

- "trainer": the step alone;
- "every_n = 1", "every_n = 10": ``InRunFolder.fold`` of the step's batch before the step, due every n steps
  (one forward and one per-sample backward of the scores stage's engine into fresh float64 moment state, the
  statistics and top-1% sets on the host, the per-step files written to a temporary directory); an every_n
  above ``--steps`` runs every_n steps instead (one fold in them).

Models: the benchmark models of ``benchmarks.scores`` (``--model``: ``small`` and ``large`` by default,
``llama-134m`` ...; random weights, each with its batch shape there) and real checkpoint directories
(``--path``, loaded with transformers ``from_pretrained(local_files_only=True)`` in float32; batch
32 rows × (16 prompt + 48 response) tokens). ``--shape ROWS PROMPT RESPONSE`` overrides either; the batch's
tokens are uniform random ids, every position attended, the response positions scored. ``--params``: the globs
of the parameters folded (default: all; the trainer's step always trains all).

The folder folds one warm-up batch first (the engine traces its first call), and the trainer takes one warm-up
step. Repetitions interleave the alternatives; reported: the median over repetitions of each alternative's mean
time per step, and its ratio to the trainer's in the same repetition. On cpu timed in process CPU time by
default (``--clock wall``: wall time; on a shared machine other jobs' load enters wall time, not the process's
own CPU time); on cuda in wall time, the device synchronized at each end of a timed region.

    python -m benchmarks.inrun                         # small and large CPU models, every_n 1 and 10
    python -m benchmarks.inrun --model small --steps 10 --reps 2 --every 1 5
    python -m benchmarks.inrun --model large --parts   # one fold's time by part instead
    python -m benchmarks.inrun --device cuda --model llama-134m --steps 4 --reps 2
    python -m benchmarks.inrun --threads 1 --path models/smollm2-135m-instruct --steps 2 --reps 1 \
        --params "model.layers.*.mlp.down_proj.weight"

``--parts`` times the parts of a fold (median over ``--reps`` folds after a warm-up): the engine's pass into fresh
state, the statistics read off it (``compute_stats`` of the two halves' rows), the three top-1% selections and the
files written.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from benchmarks.scores import MODELS, build, make_batch
from covgrad.integrations.inrun import METRICS, InRunFolder
from covgrad.integrations.inrun import statistics as fold_statistics
from covgrad.moments.topk import count_for_fraction, topk_indices

Batch = tuple[Tensor, Tensor, Tensor, np.ndarray]  # ids (B, L), attention mask (B, L), response mask (B, L), A (B,)
Shape = tuple[int, int, int]  # rows, prompt tokens, response tokens
CHECKPOINT_SHAPE: Shape = (32, 16, 48)  # a checkpoint's batch: 32 rows × (16 prompt + 48 response) tokens


def load(name: str, device: torch.device) -> tuple[nn.Module, int, Shape]:
    """The model in training mode on ``device``, its vocabulary size and its batch shape: a benchmark model of
    ``benchmarks.scores`` by name, else a checkpoint directory in float32."""
    if name in MODELS:
        return build(name, device).train(), MODELS[name][1], MODELS[name][8:]
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=True)
    return model.to(device).train(), model.config.vocab_size, CHECKPOINT_SHAPE


def batches(vocab: int, shape: Shape, n: int, device: torch.device) -> list[Batch]:
    """``n`` batches of ``shape`` (B rows, prompt, response) on ``device``, each with standard normal advantages."""
    B, prompt, response = shape
    out = []
    for i in range(n):
        ids, w = make_batch(vocab, B, prompt, response, seed=i, device=device)
        out.append((ids, torch.ones_like(ids), w, np.random.default_rng(i).standard_normal(B)))
    return out


def trainer_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    """Forward in training mode, −Σ A·log p over response tokens / their count, backward, AdamW step, zero_grad."""
    ids, mask, w, A = batch
    logits = model(input_ids=ids, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(torch.as_tensor(A, dtype=lp.dtype, device=lp.device)[:, None] * w[:, 1:] * lp).sum() / w[:, 1:].sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list[Batch], folder: InRunFolder | None) -> None:
    """The trainer's steps over ``data``, each preceded by the folder's fold of its batch when given."""
    for step, batch in enumerate(data):
        if folder is not None:
            folder.fold(step, *batch)
        trainer_step(model, opt, batch)


def title(name: str, folder: InRunFolder, shape: Shape | None = None) -> str:
    """The model column: the model's name (a directory's last part), the parameters folded (of the model's, when
    ``--params`` selects fewer) and the batch shape."""
    label = name if name in MODELS else Path(name).name
    folded, total = folder.layout.P, sum(p.numel() for p in folder.model.parameters())
    count = f"{folded:,}" if folded == total else f"{folded:,} of {total:,}"
    if shape is None:
        return f"{label} ({count})"
    return f"{label} ({count}; {shape[0]} rows × {shape[1] + shape[2]} tokens)"


def measure(
    name: str,
    device: torch.device,
    shape: Shape | None,
    params: Sequence[str] | None,
    every: Sequence[int],
    steps: int,
    reps: int,
    clock: Callable[[], float],
    out: str,
) -> None:
    """Print one table row per alternative of model ``name`` (``shape``: its batch shape, None: the model's;
    ``params``: the globs of the parameters folded, None: all)."""
    model, vocab, default = load(name, device)
    shape = shape or default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = batches(vocab, shape, max(steps, *every), device)
    folder = InRunFolder(model, params, every_n=1, out_dir=os.path.join(out, Path(name).name))
    folder.fold(0, *data[0])  # warm-up: the first call traces
    run_steps(model, opt, data[:1], None)  # warm-up of the trainer's step
    runs: dict[str, tuple[int | None, int]] = {"trainer": (None, steps)}
    runs.update({f"every_n = {n}": (n, max(steps, n)) for n in every})
    per_step: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for label, (n, count) in runs.items():
            if n is not None:
                folder.every_n = n
                folder.steps.clear()  # due at step 0 again
            t0 = clock()
            run_steps(model, opt, data[:count], None if n is None else folder)
            per_step[label].append((clock() - t0) / count)
    base = per_step["trainer"]
    for label, times in per_step.items():
        ratio = statistics.median(t / b for t, b in zip(times, base, strict=True))
        row = f"| {title(name, folder, shape)} | {label} | {statistics.median(times):.3f} s | {ratio:.2f}× |"
        print(row)


def parts(
    name: str,
    device: torch.device,
    shape: Shape | None,
    params: Sequence[str] | None,
    reps: int,
    clock: Callable[[], float],
    out: str,
) -> None:
    """Print one table row per part of a fold of model ``name`` (median over ``reps`` folds): the parts of
    ``InRunFolder.fold`` timed one by one."""
    model, vocab, default = load(name, device)
    data = batches(vocab, shape or default, 1, device)
    folder = InRunFolder(model, params, every_n=1, out_dir=os.path.join(out, f"{Path(name).name}-parts"))
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
    for label, ts in times.items():
        print(f"| {title(name, folder)} | {label} | {statistics.median(ts):.3f} s |")


def timer(device: torch.device, clock: str) -> Callable[[], float]:
    """The clock read at each end of a timed region: process CPU time or wall time, the device synchronized
    first on cuda."""
    read = time.process_time if clock == "cpu" else time.perf_counter
    if device.type != "cuda":
        return read

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return read()

    return synchronized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", nargs="+", default=None, choices=list(MODELS), help="default: small large (no --path)")
    ap.add_argument("--path", nargs="+", default=[], help="checkpoint directories (Hugging Face causal LMs)")
    ap.add_argument("--shape", nargs=3, type=int, default=None, metavar=("ROWS", "PROMPT", "RESPONSE"))
    ap.add_argument("--params", nargs="+", default=None, help="globs of the parameters folded (default: all)")
    ap.add_argument("--every", nargs="+", type=int, default=[1, 10], help="every_n of the folders")
    ap.add_argument("--steps", type=int, default=20, help="trainer steps per repetition and alternative")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None, help="default: cpu time on cpu, wall on cuda")
    ap.add_argument("--parts", action="store_true", help="time the parts of one fold instead of the steps")
    args = ap.parse_args()
    for path in args.path:
        if not (Path(path) / "config.json").is_file():
            print(f"benchmarks.inrun: error: {path!r} is not a model directory (no config.json)", file=sys.stderr)
            raise SystemExit(2)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu")
    if device.type == "cuda" and args.clock == "cpu":
        ap.error("--clock cpu on cuda: the device's work is not the process's CPU time")
    clock = args.clock or ("cpu" if device.type == "cpu" else "wall")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"{cpu}{gpu}, {torch.get_num_threads()} torch threads, clock={clock}, torch {torch.__version__}")
    if args.parts:
        print("| model (P) | part of a fold | time |\n|---|---|---:|")
    else:
        print("| model (P) | step | time per step | / trainer |\n|---|---|---:|---:|")
    shape: Shape | None = (args.shape[0], args.shape[1], args.shape[2]) if args.shape else None
    names = (args.model or ([] if args.path else ["small", "large"])) + args.path
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            if args.parts:
                parts(name, device, shape, args.params, args.reps, timer(device, clock), out)
            else:
                measure(name, device, shape, args.params, args.every, args.steps, args.reps, timer(device, clock), out)


if __name__ == "__main__":
    main()
