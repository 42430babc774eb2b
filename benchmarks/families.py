"""The generic per-sample rule is not the fast path: the same Llama with its RMSNorms on the generic rule
(torch.func vmap of each norm's own vector-Jacobian product) against the specialised RMSNorm rule.

Both models hold the same weights; the second swaps every LlamaRMSNorm for a subclass whose forward is
the same math written differently, so it is matched to :func:`covgrad.rules.generic_rule`. Each
repetition times one PerSampleGrads call (self-check off, reused output buffer) of each model,
interleaved after one warm-up; the median ratio generic / specialised is reported (goal ≤ 1.1: norm
parameters are a small part of P). The two score matrices are compared too.

    python -m benchmarks.families               # ~1 minute on one core
    python -m benchmarks.families --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from benchmarks.tokens import build as perturbed_llama
from covgrad.layout import select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad
from covgrad.rules import _rmsnorm_rule, generic_rule, rule_for


class RewrittenRMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm's math in a different forward: not a verified norm, so it gets the generic rule."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        h = hidden_states.to(torch.float32)
        h = h * (h.square().mean(-1, keepdim=True) + self.variance_epsilon).rsqrt()
        return self.weight * h.to(hidden_states.dtype)


def build(generic_norms: bool) -> nn.Module:
    """A 4-layer, hidden-256 Llama (vocab 512), norms perturbed; optionally with rewritten norms."""
    model = perturbed_llama(512, 256, 640, 4, 4, 4, tied=False)
    if generic_norms:
        for name, m in list(model.named_modules()):
            if type(m) is LlamaRMSNorm:
                new = RewrittenRMSNorm(m.weight.shape[0], m.variance_epsilon)
                new.weight = m.weight
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()
    B, L = args.batch, args.length
    fast, slow = build(False), build(True)
    norms = [m for m in slow.modules() if isinstance(m, LlamaRMSNorm)]
    assert all(rule_for(m)[0] is generic_rule for m in norms)
    assert all(rule_for(m)[0] is _rmsnorm_rule for m in fast.modules() if isinstance(m, LlamaRMSNorm))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (B, L), generator=gen)
    attn = torch.ones(B, L, dtype=torch.long)
    target = torch.zeros(B, L)
    target[:, L // 2 :] = 1.0
    pos = torch.arange(L).expand(B, L)
    fn = lambda z: score_logit_grad(z, ids, target)  # noqa: E731
    runs = {}
    for name, model in (("specialised", fast), ("generic", slow)):
        layout = select_parameters(model)
        psg = PerSampleGrads(model, layout, check=False)
        out = torch.empty(B, layout.P)
        runs[name] = (psg, out)
        psg(ids, attn, fn, pos, out=out)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, (psg, out) in runs.items():
            t = time.perf_counter()
            psg(ids, attn, fn, pos, out=out)
            times[name].append(time.perf_counter() - t)
    a, b = runs["specialised"][1], runs["generic"][1]
    rel = float((a.double() - b.double()).norm() / a.double().norm())
    P, n_norm = a.shape[1], sum(m.weight.numel() for m in norms)
    print(f"Llama 4x256, vocab 512, B={B}, L={L}, P={P:,} ({n_norm:,} in {len(norms)} RMSNorms), reps={args.reps}")
    print(f"{'rule for the norms':20s} {'median s':>9s} {'ratio':>6s}")
    base = statistics.median(times["specialised"])
    for name in runs:
        med = statistics.median(times[name])
        print(f"{name:20s} {med:9.3f} {med / base:6.2f}")
    ratios = [g / s for g, s in zip(times["generic"], times["specialised"], strict=True)]
    print(f"median per-repetition ratio generic/specialised: {statistics.median(ratios):.3f} (goal <= 1.1)")
    print(f"scores agree: relative difference {rel:.2e}")


if __name__ == "__main__":
    main()
