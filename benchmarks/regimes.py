"""Scores plus one regime's g against the floor of two plain batched backwards, side by side in one process.

Per repetition (interleaved, after one warm-up): "scores + regime" = the scores stage's streaming step
(``PerSampleGrads.accumulate`` of the score into float64 moment state) then the regime fold's
(``RegimeMoments.fold`` of the regime's g_n with its bound scalars); the floor = two batched forward +
backward passes of the summed objectives (Σ_t log p(y_t), and the regime's own objective), every parameter
requiring grad: what a trainer pays for the two gradients. The teacher's logits are computed once before
timing (a teacher forward costs the same on both sides). Reported: median ratio over repetitions.

    python -m benchmarks.regimes                      # small and large CPU models, distill_reverse_kl
    python -m benchmarks.regimes --regime rl_token --model small
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.scores import MODELS, build, make_batch, objective
from covgrad.accum import MomentAccumulator
from covgrad.layout import select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad
from covgrad.regimes import Regime, RegimeGrad, RegimeMoments


def regime_objective(kind: str, logits: Tensor, zq: Tensor, ids: Tensor, w: Tensor, adv: Tensor) -> Tensor:
    """Σ_n J_n of the regime, batched (the floor's second backward): logits, zq (B, L, V); ids, w (B, L)."""
    logp = F.log_softmax(logits[:, :-1].float(), -1)
    ww = w[:, 1:]
    if kind == "distill_reverse_kl":
        logq = F.log_softmax(zq[:, :-1].float(), -1)
        return -(ww * (logp.exp() * (logp - logq)).sum(-1)).sum()
    drawn = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return (ww * adv[:, 1:] * drawn).sum()  # rl_token with per-token advantages


def run(name: str, kind: str, reps: int) -> float:
    device = torch.device("cpu")
    model = build(name, device)
    B, prompt, response = MODELS[name][8:11]
    ids, w = make_batch(MODELS[name][1], B, prompt, response, seed=0, device=device)
    layout = select_parameters(model, None)
    plist = [dict(model.named_parameters())[n] for n in layout.names]
    mask, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    torch.manual_seed(1)
    teacher = build(name, device)
    with torch.no_grad():
        zq = teacher(input_ids=ids).logits
    adv = torch.randn(ids.shape, dtype=torch.float64) * (w != 0)
    half = np.arange(B) % 2
    psg = PerSampleGrads(model, layout, check=False)
    acc = MomentAccumulator(layout.P, device, "float64", compiled=True)
    moments = RegimeMoments(layout.P, device, compiled=True)
    seq_adv = np.random.default_rng(0).standard_normal(B)
    regime = Regime(kind)

    def ours() -> None:
        psg.accumulate(ids, mask, lambda z: score_logit_grad(z, ids, w), acc, seq_adv, half, position_ids=pos)
        if kind == "distill_reverse_kl":
            fn = RegimeGrad(regime, ids, w, teacher_logits=zq)
        else:
            fn = RegimeGrad(regime, ids, w, advantages=adv)
        moments.fold(psg, ids, mask, fn, half, pos)

    def floor() -> None:
        torch.autograd.grad(objective(model(input_ids=ids).logits, ids, w), plist)
        torch.autograd.grad(regime_objective(kind, model(input_ids=ids).logits, zq, ids, w, adv), plist)

    ours(), floor()  # warm-up (compiles the fold)
    ratios = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        floor()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
    ratio = statistics.median(ratios)
    print(f"| {name} | P = {layout.P} | B = {B}, L = {ids.shape[1]} | {kind} | {ratio:.3f} |")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["small", "large"], choices=["small", "large"])
    ap.add_argument("--regime", default="distill_reverse_kl", choices=["distill_reverse_kl", "rl_token"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print("| model | params | batch | regime | (scores + regime) / (2 batched backwards) |\n|---|---|---|---|---|")
    for name in args.model:
        run(name, args.regime, args.reps)


if __name__ == "__main__":
    main()
