"""Scores with the model sharded over R ranks (covgrad.fsdp, FSDP2 over gloo) against the single-process fold.

Every configuration folds the same batches of ``benchmarks.scores``'s model (every parameter selected,
float64 state, the eager fold) with ``PerSampleGrads.accumulate``; the time of a batch is the slowest
rank's (a barrier ends each batch), the median over ``--batches`` batches after one warm-up batch. The
single process runs ``--threads`` threads (default: all cores) and each of R ranks max(1, threads // R), so
R ranks use the same cores as the single process while threads >= R: the ratio is then the cost of
sharding (all-gathers, the per-sample blocks every rank forms whole, the cut tiles' scratch folds) at equal
hardware. "Columns formed" is the largest fraction of the per-sample block's columns one rank formed in a
batch: a rank skips a weight's row chunks that hold none of its columns (the rest, the embedding's block and
every tensor of one chunk, every rank forms whole).

    python -m benchmarks.fsdp                       # "large" CPU model, 1 process, 1 and 2 ranks
    python -m benchmarks.fsdp --model small --ranks 1 2 4
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.scores import MODELS, build, make_batch
from covgrad.accum import MomentAccumulator
from covgrad.layout import select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad


def _batches(name: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    vocab, B, prompt, response = MODELS[name][1], *MODELS[name][8:]
    return [make_batch(vocab, B, prompt, response, seed=100 + b, device=torch.device("cpu")) for b in range(n)]


def _times(psg: PerSampleGrads, acc: object, batches: list, sync: bool) -> list[float]:
    """Seconds per batch of ``psg.accumulate`` into ``acc`` (the first batch, the warm-up, left out)."""
    out = []
    for ids, w in batches:
        B = ids.shape[0]
        fn = lambda z, ids=ids, w=w: score_logit_grad(z, ids, w)  # noqa: E731
        pos = torch.arange(ids.shape[1]).expand(B, -1)
        t0 = time.perf_counter()
        psg.accumulate(ids, torch.ones_like(ids), fn, acc, np.ones(B), np.arange(B) % 2, pos)
        if sync:
            dist.barrier()
        out.append(time.perf_counter() - t0)
    return out[1:]


def _rank(rank: int, ranks: int, init: str, name: str, n: int, threads: int, out: str) -> None:
    from covgrad.fsdp import rank_scores

    torch.set_num_threads(max(1, threads // ranks))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        model = build(name, torch.device("cpu"))
        layout = select_parameters(model)
        batches = _batches(name, n)
        ids = batches[0][0]
        example = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1),
        }
        rs = rank_scores(model, layout, example, check=False, compiled=False)
        times = _times(rs.psg, rs.shard, batches, sync=True)
        formed = torch.tensor([1 - rs.psg.skipped_columns / layout.P], dtype=torch.float64)
        dist.all_reduce(formed, op=dist.ReduceOp.MAX)  # the rank that formed the most columns
        if rank == 0:
            np.save(out, np.array([*times, float(formed)]))
    finally:
        dist.destroy_process_group()


def single(name: str, n: int, threads: int) -> list[float]:
    """Seconds per batch of the single-process fold (no process group, the whole state)."""
    torch.set_num_threads(threads)
    model = build(name, torch.device("cpu"))
    layout = select_parameters(model)
    acc = MomentAccumulator(layout.P, "cpu", compiled=False)
    return _times(PerSampleGrads(model, layout, check=False), acc, _batches(name, n), sync=False)


def sharded(name: str, n: int, threads: int, ranks: int) -> tuple[list[float], float]:
    """Seconds per batch (the slowest rank's) of ``ranks`` gloo processes folding their shards, and the largest
    fraction of the per-sample block's columns a rank formed (compute sharding skips the row chunks outside a
    rank's columns)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.npy")
        args = (ranks, f"file://{tmp}/rendezvous", name, n, threads, out)
        mp.spawn(_rank, args=args, nprocs=ranks, join=True)
        *times, formed = np.load(out).tolist()
        return times, formed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large", choices=list(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=6, help="batches per configuration (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads shared by the ranks")
    args = parser.parse_args()
    B, prompt, response = MODELS[args.model][8:]
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"\n## {args.model} model, B = {B}, L = {prompt + response}, every parameter, float64 state, eager fold")
    print(
        f"{args.threads} threads in the single process, max(1, {args.threads} // R) per rank; seconds per batch: "
        f"median over {args.batches - 1} batches\n"
    )
    print("| configuration | s / batch | ratio to 1 process | block columns formed per rank |\n|---|---|---|---|")
    base = statistics.median(single(args.model, args.batches, args.threads))
    print(f"| 1 process (no FSDP) | {base:.3f} | 1.00 | 1.00 |")
    for ranks in args.ranks:
        times, formed = sharded(args.model, args.batches, args.threads, ranks)
        t = statistics.median(times)
        print(f"| FSDP2, {ranks} rank{'s' if ranks > 1 else ''} | {t:.3f} | {t / base:.2f} | {formed:.2f} |")


if __name__ == "__main__":
    main()
