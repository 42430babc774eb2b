"""Scores with the model sharded over R ranks (covgrad.distributed.fsdp, FSDP2 over gloo) against the single-process
fold.

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
    python -m benchmarks.fsdp --model llama-134m --batch 2 --tokens 8 32 --ranks 2 --weights-everywhere
    python -m benchmarks.fsdp --model llama-134m --batch 2 --tokens 8 32 --ranks 2 --aligned

The peak resident memory of each rank (sampled every 50 ms from its start), once the model is loaded, traced
and sharded and at the end, shows the loading: rank 0 builds the model with its weights, the other ranks on the
meta device, and each takes its shard of rank 0's weights (``--weights-everywhere``: every rank builds it with
weights, the way before).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.scores import MODELS, build, make_batch
from covgrad.devices import PeakRSS
from covgrad.layout import select_parameters
from covgrad.moments import MomentAccumulator
from covgrad.scores import PerSampleGrads, score_logit_grad


def _batches(name: str, n: int, shape: tuple[int, int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``shape`` = (B, prompt, response) tokens."""
    vocab = MODELS[name][1]
    return [make_batch(vocab, *shape, seed=100 + b, device=torch.device("cpu")) for b in range(n)]


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


def _rank(
    rank: int,
    ranks: int,
    init: str,
    name: str,
    n: int,
    threads: int,
    shape: tuple,
    everywhere: bool,
    aligned: bool,
    out: str,
) -> None:
    from covgrad.distributed import rank_scores

    torch.set_num_threads(max(1, threads // ranks))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        with PeakRSS() as rss:  # sampled, not ru_maxrss: a spawned process inherits its parent's peak at the fork
            weights = rank == 0 or everywhere  # the others take their shards of rank 0's weights
            model = build(name, torch.device("cpu" if weights else "meta"))
            layout = select_parameters(model)
            batches = _batches(name, n, shape)
            ids = batches[0][0]
            example = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1),
            }
            rs = rank_scores(model, layout, example, check=False, compiled=False, aligned=aligned)
            loaded = rss.peak  # the peak of loading, tracing and sharding
            times = _times(rs.psg, rs.shard, batches, sync=True)
        formed = torch.tensor([1 - rs.psg.skipped_columns / layout.P], dtype=torch.float64)
        dist.all_reduce(formed, op=dist.ReduceOp.MAX)  # the rank that formed the most columns
        peaks = [torch.zeros(2, dtype=torch.float64) for _ in range(ranks)]
        dist.all_gather(peaks, torch.tensor([float(loaded), float(rss.peak)], dtype=torch.float64))
        if rank == 0:
            others = torch.stack(peaks[1:]).amax(0).tolist() if ranks > 1 else [float("nan")] * 2
            np.save(out, np.array([*times, float(formed), *peaks[0].tolist(), *others]))
    finally:
        dist.destroy_process_group()


def single(name: str, n: int, threads: int, shape: tuple[int, int, int]) -> list[float]:
    """Seconds per batch of the single-process fold (no process group, the whole state)."""
    torch.set_num_threads(threads)
    model = build(name, torch.device("cpu"))
    layout = select_parameters(model)
    acc = MomentAccumulator(layout.P, "cpu", compiled=False)
    return _times(PerSampleGrads(model, layout, check=False), acc, _batches(name, n, shape), sync=False)


@dataclass(frozen=True)
class Sharded:
    """One sharded configuration's measurements."""

    times: list[float]  # seconds per batch, the slowest rank's
    formed: float  # the largest fraction of the per-sample block's columns one rank formed in a batch
    load0: float  # rank 0's peak resident memory once the model is loaded, traced and sharded, bytes
    rss0: float  # rank 0's peak resident memory at the end, bytes
    load_others: float  # the largest of the other ranks' (NaN for one rank)
    rss_others: float


def sharded(
    name: str, n: int, threads: int, ranks: int, shape: tuple[int, int, int], everywhere: bool, aligned: bool = False
) -> Sharded:
    """``ranks`` gloo processes folding their shards (fresh processes: their peaks are their own); with
    ``everywhere`` every rank builds the model with weights, else only rank 0 (the others on the meta device);
    ``aligned``: row chunks on each rank's own grid (``scores.rank_chunks: aligned``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.npy")
        args = (ranks, f"file://{tmp}/rendezvous", name, n, threads, shape, everywhere, aligned, out)
        mp.spawn(_rank, args=args, nprocs=ranks, join=True)
        *times, formed, load0, rss0, load_others, rss_others = np.load(out).tolist()
        return Sharded(times, formed, load0, rss0, load_others, rss_others)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large", choices=list(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=6, help="batches per configuration (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads shared by the ranks")
    parser.add_argument("--batch", type=int, default=None, help="samples per batch (default: the model's)")
    parser.add_argument("--tokens", type=int, nargs=2, default=None, metavar=("PROMPT", "RESPONSE"))
    parser.add_argument(
        "--weights-everywhere", action="store_true", help="also run every rank loading the weights, as a baseline"
    )
    parser.add_argument("--aligned", action="store_true", help="also run the ranks with aligned row chunks")
    args = parser.parse_args()
    B, prompt, response = MODELS[args.model][8:]
    B = args.batch or B
    prompt, response = args.tokens or (prompt, response)
    shape = (B, prompt, response)
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"\n## {args.model} model, B = {B}, L = {prompt + response}, every parameter, float64 state, eager fold")
    print(
        f"{args.threads} threads in the single process, max(1, {args.threads} // R) per rank; seconds per batch: "
        f"median over {args.batches - 1} batches\n"
    )
    print(
        "| configuration | s / batch | ratio to 1 process | block columns formed per rank | peak GB loaded, rank 0 "
        "| peak GB loaded, other ranks | peak GB, rank 0 | peak GB, other ranks |\n|---|---|---|---|---|---|---|---|"
    )
    base = statistics.median(single(args.model, args.batches, args.threads, shape))
    print(f"| 1 process (no FSDP) | {base:.3f} | 1.00 | 1.00 | | | | |")
    for ranks in args.ranks:
        variants = [(False, False)]
        variants += [(True, False)] if args.weights_everywhere and ranks > 1 else []
        variants += [(False, True)] if args.aligned and ranks > 1 else []
        for everywhere, aligned in variants:
            r = sharded(args.model, args.batches, args.threads, ranks, shape, everywhere, aligned)
            t = statistics.median(r.times)
            label = f"FSDP2, {ranks} rank{'s' if ranks > 1 else ''}" + (", weights on every rank" if everywhere else "")
            label += ", aligned row chunks" if aligned else ""
            gb = [f"{x / 1e9:.2f}" for x in (r.load0, r.load_others, r.rss0, r.rss_others)]
            print(f"| {label} | {t:.3f} | {t / base:.2f} | {r.formed:.2f} | {' | '.join(gb)} |")


if __name__ == "__main__":
    main()
