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
state, the statistics read off it block by block (``compute_stats`` of each block of the two halves' rows, the
three streamed top-1% sets, the vectors into their temporary files) and the step's files written. ``--block``: the
folders' columns per block (default ``covgrad.integrations.blocks.BLOCK``).

``--memory`` measures the host memory of the statistics phase instead (the blocks' statistics, the sets and the
files of one fold, ``keep=()``), with ``--block`` columns a block and with one block of all P (the whole-array
reads), each in a fresh process after its engine pass: the peak resident set above the phase's start (the kernel's
high-water mark, reset at the start; freed heap returned first) and the peak of the allocations ``tracemalloc``
sees (numpy's; torch's host copies are not traced).

    python -m benchmarks.inrun --memory --model large --block 65536
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from benchmarks.scores import MODELS, build, make_batch
from covgrad.integrations.blocks import BLOCK, StepVectors
from covgrad.integrations.inrun import InRunFolder

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
    block: int,
) -> None:
    """Print one table row per alternative of model ``name`` (``shape``: its batch shape, None: the model's;
    ``params``: the globs of the parameters folded, None: all; ``block``: the folder's columns per block)."""
    model, vocab, default = load(name, device)
    shape = shape or default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = batches(vocab, shape, max(steps, *every), device)
    folder = InRunFolder(model, params, every_n=1, out_dir=os.path.join(out, Path(name).name), block=block)
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
    block: int,
) -> None:
    """Print one table row per part of a fold of model ``name`` (median over ``reps`` folds): the parts of
    ``InRunFolder.fold`` timed one by one, the statistics ``block`` columns at a time."""
    model, vocab, default = load(name, device)
    data = batches(vocab, shape or default, 1, device)
    folder = InRunFolder(model, params, every_n=1, out_dir=os.path.join(out, f"{Path(name).name}-parts"), block=block)
    folder.fold(0, *data[0])  # warm-up: the first call traces
    times: dict[str, list[float]] = {"engine pass": [], "statistics, sets, vectors (blocks)": [], "files": []}
    for rep in range(reps):
        step = rep + 1
        t0 = clock()
        acc = folder._fold(*folder._batch(*data[0], None, None))
        t1 = clock()
        assert folder.out is not None
        with StepVectors(folder.layout.P, folder.vectors, folder.keep, folder.out, f"step_{step:06d}") as vectors:
            scalars, top = folder._reduce(acc, vectors)
            t2 = clock()
            folder._record(step, scalars, top, vectors, 0.0)
            t3 = clock()
        for label, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[label].append(dt)
    for label, ts in times.items():
        print(f"| {title(name, folder)} | {label} | {statistics.median(ts):.3f} s |")


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _phase_memory(
    name: str, device: str, shape: Shape | None, params: Sequence[str] | None, block: int | None, out: str
) -> tuple[str, int, float, int, int]:
    """In a fresh process: one fold's engine pass, then its statistics phase (``keep=()``) measured: the model
    column, the columns per block, the phase's seconds, its peak resident set above its start and its
    ``tracemalloc`` peak, in bytes (``block`` None: one block)."""
    torch.set_num_threads(1)
    model, vocab, default = load(name, torch.device(device))
    data = batches(vocab, shape or default, 1, torch.device(device))
    folder = InRunFolder(model, params, every_n=1, out_dir=out, keep=())
    folder.block = block or max(folder.layout.P, 1)
    acc = folder._fold(*folder._batch(*data[0], None, None))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the engine's freed heap back to the system
    start = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    tracemalloc.start()
    t0 = time.perf_counter()
    folder._finish(0, acc, t0)
    seconds = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return title(name, folder), folder.block, seconds, _status("VmHWM") - start, traced


def memory(name: str, device: str, shape: Shape | None, params: Sequence[str] | None, block: int, out: str) -> None:
    """Print the statistics phase's host memory of model ``name`` with ``block`` columns a block and with one
    block (each in a fresh process)."""
    ctx = multiprocessing.get_context("spawn")
    for b in (block, None):
        folder = os.path.join(out, f"{Path(name).name}-memory-{b}")
        with ctx.Pool(1) as pool:
            label, used, seconds, rss, traced = pool.apply(_phase_memory, (name, device, shape, params, b, folder))
        print(f"| {label} | {used:,} | {seconds:.2f} s | {rss / 2**20:,.1f} MiB | {traced / 2**20:,.1f} MiB |")


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
    ap.add_argument("--block", type=int, default=BLOCK, help="the folders' columns per block")
    ap.add_argument("--memory", action="store_true", help="the statistics phase's host memory, block vs one block")
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
    if args.memory:
        print("| model (P) | columns a block | time | peak RSS above start | tracemalloc peak |")
        print("|---|---:|---:|---:|---:|")
    elif args.parts:
        print("| model (P) | part of a fold | time |\n|---|---|---:|")
    else:
        print("| model (P) | step | time per step | / trainer |\n|---|---|---:|---:|")
    shape: Shape | None = (args.shape[0], args.shape[1], args.shape[2]) if args.shape else None
    names = (args.model or ([] if args.path else ["small", "large"])) + args.path
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            if args.memory:
                memory(name, args.device, shape, args.params, args.block, out)
            elif args.parts:
                parts(name, device, shape, args.params, args.reps, timer(device, clock), out, args.block)
            else:
                clock_fn = timer(device, clock)
                measure(name, device, shape, args.params, args.every, args.steps, args.reps, clock_fn, out, args.block)


if __name__ == "__main__":
    main()
