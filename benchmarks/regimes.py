"""Scores plus one regime's g against the floor of two plain batched backwards, side by side in one process.

Per repetition (interleaved, after one warm-up), each against the floor = two batched forward + backward
passes of the summed objectives (Σ_t log p(y_t), and the regime's own objective), every parameter requiring
grad: what a trainer pays for the two gradients.

- "separate": the scores stage's streaming step (``PerSampleGrads.accumulate`` of the score into float64
  moment state), then the regime fold's (``RegimeMoments.fold`` of the regime's g_n, summed per prompt group of
  8 samples by default, with its bound scalars): two forwards, two per-sample backwards;
- "fused": one multi-cotangent pass (``RegimeMoments.fold(..., also=[score])``, i.e.
  ``PerSampleGrads.accumulate_many``): one forward, then one per-sample backward per cotangent, each folded
  into its own accumulator (the same bytes as "separate", checked after the timing);
- "fused, fold skipped": the same pass into accumulators whose fold does nothing: its excess over the floor is
  the per-sample products' and the pass's own, and "fused" minus it is the fold's.

The teacher's logits are computed once before timing (a teacher forward costs the same on both sides).
Timed in process CPU time by default (``--clock wall``: wall time; on a shared machine other jobs' load
enters wall time, not the process's own CPU time). Reported: median ratio over repetitions.

    python -m benchmarks.regimes                      # small and large CPU models, distill_reverse_kl
    python -m benchmarks.regimes --regime rl_token --model small
    python -m benchmarks.regimes --model small --reps 0 --profile 10   # cProfile of 10 fused steps
    python -m benchmarks.regimes --response 480                # responses of 480 tokens instead of 32
    python -m benchmarks.regimes --fold-only                   # the fold alone: native and torch.compile kernels
    python -m benchmarks.regimes --group 1                     # every sample a prompt group of its own
    python -m benchmarks.regimes --device cuda --model llama-134m llama-0.85b --reps 3   # on a GPU

``--fold-only`` times the compiled fold alone, side by side: one batch of the model's P columns in row-chunk
sized blocks, zero advantages, into a state with the co-moment (the score's) and without it (a regime's),
by the native CPU kernel (``covgrad.moments.native_fold``) and by the torch.compile kernel; wall and process CPU
time, median over repetitions.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import time

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.scores import MODELS, build, make_batch, objective
from covgrad.layout import select_parameters
from covgrad.moments import GroupAccumulator, MomentAccumulator, accum
from covgrad.regimes import Regime, RegimeGrad, RegimeMoments
from covgrad.scores import Cotangent, PerSampleGrads, default_chunk_bytes, score_logit_grad


def regime_objective(kind: str, logits: Tensor, zq: Tensor, ids: Tensor, w: Tensor, adv: Tensor) -> Tensor:
    """Σ_n J_n of the regime, batched (the floor's second backward): logits, zq (B, L, V); ids, w (B, L)."""
    logp = F.log_softmax(logits[:, :-1].float(), -1)
    ww = w[:, 1:]
    if kind == "distill_reverse_kl":
        logq = F.log_softmax(zq[:, :-1].float(), -1)
        return -(ww * (logp.exp() * (logp - logq)).sum(-1)).sum()
    drawn = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return (ww * adv[:, 1:] * drawn).sum()  # rl_token with per-token advantages


class _Unfolded(MomentAccumulator):
    """An accumulator whose fold does nothing: the fused pass with it is the forward, the per-sample backwards
    and products alone (what the fold adds is the difference to "fused")."""

    def fold(self, offset: int, block: Tensor) -> None:
        """Take the block and drop it."""


class _UnfoldedGroups(GroupAccumulator):
    """:class:`_Unfolded` for a regime's accumulator (which also takes the batch's prompt groups)."""

    def fold(self, offset: int, block: Tensor) -> None:
        """Take the block and drop it."""


def run(
    name: str,
    kind: str,
    reps: int,
    clock: str,
    profile: int = 0,
    response: int | None = None,
    state_dtype: str = "float64",
    group: int = 8,
    device_name: str = "cpu",
) -> dict[str, float]:
    """Time both passes of ``kind`` on model ``name`` (responses of ``response`` tokens; None: the model's
    default; moment state in ``state_dtype``; prompt groups of ``group`` samples; on ``device_name``) against
    the floor; returns the median ratio per pass. On cuda the clock is wall time after a synchronize."""
    device = torch.device(device_name)
    model = build(name, device)
    B, prompt, default_response = MODELS[name][8:11]
    response = response or default_response
    ids, w = make_batch(MODELS[name][1], B, prompt, response, seed=0, device=device)
    layout = select_parameters(model, None)
    plist = [dict(model.named_parameters())[n] for n in layout.names]
    mask, pos = torch.ones_like(ids), torch.arange(ids.shape[1], device=device).expand_as(ids)
    torch.manual_seed(1)
    teacher = build(name, device)
    with torch.no_grad():
        zq = teacher(input_ids=ids).logits
    adv = torch.randn(ids.shape, dtype=torch.float64).to(device) * (w != 0)
    groups = np.arange(B) // group
    half = groups % 2
    psg = PerSampleGrads(model, layout, check=False)
    accs = {m: MomentAccumulator(layout.P, device, state_dtype, compiled=True) for m in ("separate", "fused")}
    moments = {m: RegimeMoments(layout.P, device, state_dtype, compiled=True) for m in ("separate", "fused")}
    accs["unfolded"], moments["unfolded"] = _Unfolded(layout.P, device), RegimeMoments(layout.P, device)
    moments["unfolded"].acc = _UnfoldedGroups(layout.P, device)
    seq_adv = np.random.default_rng(0).standard_normal(B)
    regime = Regime(kind)

    def score(z: Tensor) -> Tensor:
        return score_logit_grad(z, ids, w)

    def regime_fn() -> RegimeGrad:
        if kind == "distill_reverse_kl":
            return RegimeGrad(regime, ids, w, teacher_logits=zq)
        return RegimeGrad(regime, ids, w, advantages=adv)

    def separate() -> None:
        psg.accumulate(ids, mask, score, accs["separate"], seq_adv, half, position_ids=pos)
        moments["separate"].fold(psg, ids, mask, regime_fn(), half, pos, group=groups)

    def fused(way: str = "fused") -> None:
        also = [Cotangent(score, accs[way], seq_adv, half)]
        moments[way].fold(psg, ids, mask, regime_fn(), half, pos, group=groups, also=also)

    def floor() -> None:
        torch.autograd.grad(objective(model(input_ids=ids).logits, ids, w), plist)
        torch.autograd.grad(regime_objective(kind, model(input_ids=ids).logits, zq, ids, w, adv), plist)

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    timer = synced if device.type == "cuda" else time.process_time if clock == "cpu" else time.perf_counter
    ours = {"separate": separate, "fused": fused, "fused, fold skipped": lambda: fused("unfolded")}
    for fn in (*ours.values(), floor):  # warm-up (compiles the fold)
        fn()
    ratios: dict[str, list[float]] = {m: [] for m in ours}
    for _ in range(reps):
        for m, fn in ours.items():
            t0 = timer()
            fn()
            t1 = timer()
            floor()
            t2 = timer()
            ratios[m].append((t1 - t0) / (t2 - t1))
    if profile:  # where a fused step's time goes, by function (self time)
        prof = cProfile.Profile()
        prof.runcall(lambda: [fused() for _ in range(profile)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        for _ in range(profile):  # the same batches both ways again, for the check below
            separate()
    for part in ("mean", "m2", "c"):  # the same state both ways, bit for bit
        for a, b in ((accs["separate"], accs["fused"]), (moments["separate"].acc, moments["fused"].acc)):
            x, y = getattr(a, part), getattr(b, part)
            assert (x is None and y is None) or torch.equal(x, y), f"fused and separate {part} differ"
    out = {m: statistics.median(r) if r else float("nan") for m, r in ratios.items()}
    for m, ratio in out.items():
        print(f"| {name} | P = {layout.P} | B = {B}, L = {ids.shape[1]} | {kind} | {state_dtype} | {m} | {ratio:.3f} |")
    return out


def fold_only(name: str, reps: int) -> None:
    """The compiled fold of one batch of zero-advantage blocks over the model's P, with and without the
    co-moment, by the native kernel and by the torch.compile kernel, interleaved; prints the medians (wall,
    process CPU) and the native / torch.compile ratios."""
    B = MODELS[name][8]
    P = select_parameters(build(name, torch.device("cpu")), None).P
    cols = default_chunk_bytes("cpu") // (4 * B)
    block = torch.randn(B, cols, generator=torch.Generator().manual_seed(0))
    half, zero = np.arange(B) % 2, np.zeros(B)
    ways = [(kernel, c) for kernel in ("native", "torch.compile") for c in (True, False)]
    native_cpu = accum.NATIVE_CPU
    accs = {w: MomentAccumulator(P, "cpu", compiled=True, comoment=w[1]) for w in ways}

    def step(way: tuple[str, bool]) -> None:
        accum.NATIVE_CPU = way[0] == "native"
        acc = accs[way]
        acc.begin_batch(zero, half)
        for j in range(0, P, cols):
            acc.fold(j, block[:, : min(cols, P - j)])
        acc.end_batch()

    for way in ways:  # the first batch starts the state (eager), the next ones build or compile and run
        for _ in range(3):
            step(way)
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {w: [] for w in ways}
    for _ in range(reps):
        for way in ways:
            w, t = time.perf_counter(), time.process_time()
            step(way)
            times[way].append((time.perf_counter() - w, time.process_time() - t))
    accum.NATIVE_CPU = native_cpu
    med = {w: np.median(np.array(v), axis=0) * 1e3 for w, v in times.items()}
    cells = [f"{med[w][0]:.1f} ms, {med[w][1]:.1f} ms" for w in ways]
    ratio = [f"{med[('native', c)][0] / med[('torch.compile', c)][0]:.2f}" for c in (True, False)]
    print(f"| {name} | {P} | B = {B}, {cols} columns per block | {' | '.join(cells)} | {' | '.join(ratio)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["small", "large"], choices=list(MODELS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: wall time after a synchronize")
    ap.add_argument("--regime", default="distill_reverse_kl", choices=["distill_reverse_kl", "rl_token"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time or wall time")
    ap.add_argument("--profile", type=int, default=0, help="also print a cProfile of this many fused steps")
    ap.add_argument("--response", type=int, default=None, help="response tokens per sample (default: the model's)")
    ap.add_argument("--fold-only", action="store_true", help="time the regime fold with and without co-moment")
    ap.add_argument("--state-dtype", choices=("float64", "float32"), default="float64", help="moment state dtype")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt group (the clustered standard error)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    if args.fold_only and args.device == "cuda":
        ap.error("--fold-only times the CPU kernels; drop --device cuda")
    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, clock=wall after synchronize"
    else:
        where = f"{cpu}, {torch.get_num_threads()} torch threads, clock={args.clock}"
    print(f"{where}, torch {torch.__version__}")
    if args.fold_only:
        print(
            "| model | P | blocks | native, with c (wall, CPU) | native, without c | torch.compile, with c | "
            "torch.compile, without c | native / torch.compile wall, with c | without c |\n"
            "|---|---|---|---|---|---|---|---|---|"
        )
        for name in args.model:
            fold_only(name, args.reps)
        return
    print(
        "| model | params | batch | regime | state | pass | (scores + regime) / (2 batched backwards) |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name in args.model:
        run(
            name,
            args.regime,
            args.reps,
            args.clock,
            args.profile,
            args.response,
            args.state_dtype,
            args.group,
            args.device,
        )


if __name__ == "__main__":
    main()
