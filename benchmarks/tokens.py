"""Token Fisher: the tokens stage's batch against the scores stage's batch, and the former per-candidate loop.

Three sections, all on models built from config (random weights, norms perturbed, eval mode), one
process, timed in interleaved repetitions after one warm-up; ratios are the median over repetitions of
(method time / scores time in the same repetition).

1. Demo (the built-in demo's Llama and settings: hidden 96, 2 layers, V of the addition tokenizer, batches
   of 16 rows, 4 response tokens, topk 6, mc 8, probes 8): the tokens stage's batch (``TokenStudy.batch``)
   with the former modes (exact, topk, mc) and with today's default (+ probe), the former implementation
   (one PerSampleGrads forward and backward per position and candidate, written out compactly below as
   the reference), and the scores stage's batch (``PerSampleGrads.accumulate`` into float64 moment state).
2. Equal-cost error of the random modes on the demo model: mc (k draws per position), probe (k probes per
   position) and probe_seq (T·k probes per sequence), all T·k cotangent rows per sample, over many seeds:
   the relative L2 error of Σ f against exact, its RMS over seeds, and the mean per-tensor relative
   standard deviation.
3. A SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 / 3 heads, intermediate 1536, V 49152, tied),
   few samples: token_fisher in probe_seq and probe mode and the whole stage batch in its default
   (probe) mode against the scores batch. ``--skip-smollm`` leaves it out.

    python -m benchmarks.tokens                 # all sections, ~15 minutes on one core
    python -m benchmarks.tokens --skip-smollm --reps 3
    python -m benchmarks.tokens --skip-demo     # only the SmolLM2-shaped model (~4 GB peak)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

from functools import partial

import numpy as np
import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from covgrad.config import PipelineConfig
from covgrad.layout import ParamLayout, select_parameters
from covgrad.moments import MomentAccumulator
from covgrad.rollouts import RolloutBatch, build_char_tokenizer
from covgrad.scores import PerSampleGrads, score_logit_grad
from covgrad.tokens import (
    TokenBackward,
    TokenStudy,
    candidates,
    lm_head_entry,
    resolve_modes,
    response_positions,
    token_fisher,
)


def build(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> nn.Module:
    """A Llama from config with its norm weights perturbed (so they matter), in eval mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def rollouts(vocab: int, rows: int, prompt: int, response: int, seed: int) -> dict[str, np.ndarray]:
    """Arrays shaped like the rollouts store's: right-padded rows of random tokens, response lengths varied."""
    gen = np.random.default_rng(seed)
    L = prompt + response
    rl = gen.integers(max(1, response // 2), response + 1, rows)
    pl = np.full(rows, prompt)
    tokens = gen.integers(4, vocab, (rows, L))
    mask = np.zeros((rows, L), dtype=bool)
    for n in range(rows):
        tokens[n, pl[n] + rl[n] :] = 0
        mask[n, pl[n] : pl[n] + rl[n]] = True
    return {"tokens": tokens, "prompt_len": pl, "response_len": rl, "response_mask": mask}


def tensors(ro: dict[str, np.ndarray]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """ids, attention mask, target mask (B, L) and prompt / response lengths (B,) as torch tensors."""
    pl, rl = torch.from_numpy(ro["prompt_len"]).long(), torch.from_numpy(ro["response_len"]).long()
    ids = torch.from_numpy(ro["tokens"]).long()
    attn = (torch.arange(ids.shape[1])[None, :] < (pl + rl)[:, None]).long()
    return ids, attn, torch.from_numpy(ro["response_mask"]).float(), pl, rl


def rollout_batch(ro: dict[str, np.ndarray]) -> RolloutBatch:
    """The rows of ``ro`` as the tokens stage reads them (trimmed to the longest row; zero advantages)."""
    B = ro["tokens"].shape[0]
    return RolloutBatch.from_arrays(
        ro["tokens"], ro["prompt_len"], ro["response_len"], ro["response_mask"], np.zeros(B), np.zeros(B), trim=True
    )


def discard(name: str, row: np.ndarray) -> None:
    """An ``emit`` of :meth:`TokenStudy.batch` that drops each (P,) row."""


def scores_batch(psg: PerSampleGrads, ro: dict[str, np.ndarray], acc: MomentAccumulator) -> None:
    """The scores stage's work on one batch: per-sample scores folded into the moment state ``acc``."""
    ids, attn, target, _, _ = tensors(ro)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    B = ids.shape[0]
    dlogits = partial(score_logit_grad, input_ids=ids, target_mask=target)
    psg.accumulate(ids, attn, dlogits, acc, torch.randn(B), torch.arange(B) % 2, position_ids=pos)


def former_batch(model: nn.Module, layout: ParamLayout, psg: PerSampleGrads, ro: dict, cfg: PipelineConfig) -> None:
    """The former tokens batch: exact, topk, two mc halves, token scores and the sequence score, with one
    PerSampleGrads forward and backward per (position, candidate)."""
    ids, attn, target, pl, rl = tensors(ro)
    cols, active, drawn = response_positions(ids, pl, rl)
    B, T = cols.shape
    rows = torch.arange(B)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    p = torch.softmax(logits[rows[:, None], cols].double(), -1)

    def onehot(j: int, cand: Tensor) -> Callable[[Tensor], Tensor]:
        def fn(z: Tensor) -> Tensor:
            g = -torch.softmax(z[rows, cols[:, j]].float(), -1)
            g[rows, cand] += 1
            g[~active[:, j]] = 0
            d = torch.zeros_like(z)
            d[rows, cols[:, j]] = g
            return d

        return fn

    k_a, k_b = (cfg.tokens.mc_samples + 1) // 2, cfg.tokens.mc_samples // 2
    for mode, k, seed in (("exact", 0, 0), ("topk", cfg.tokens.topk, 0), ("mc", k_a, 1), ("mc", k_b, 2)):
        cand, weight, _ = candidates(p, mode, k, seed, 2**62)
        fisher = torch.zeros(layout.P, dtype=torch.float64)
        for j in range(T):
            for c in range(cand.shape[-1]):
                fisher += (weight[:, j, c] * active[:, j]) @ psg(ids, attn, onehot(j, cand[:, j, c])).double().square()
    tok = torch.stack([psg(ids, attn, onehot(j, drawn[:, j])) for j in range(T)], 1)
    tok.double().square().sum((0, 1))
    psg(ids, attn, lambda z: score_logit_grad(z, ids, target))


def timed(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """name -> seconds per repetition, in interleaved repetitions after one warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired(a: list[float], b: list[float]) -> float:
    """Median over repetitions of a / b in the same repetition."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def print_table(title: str, times: dict[str, list[float]]) -> None:
    floor = next(iter(times.values()))
    print(f"\n## {title}\n\n| method | median s | ratio to scores batch |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {paired(ts, floor):.2f} |")


def stage_cfg(modes: list[str] | None, **tokens: Any) -> PipelineConfig:
    return PipelineConfig.model_validate({"tokens": {"modes": modes, **tokens}})


def demo(reps: int) -> None:
    V = len(build_char_tokenizer())
    model = build(V, 96, 256, 2, 4, 4, tied=False)
    layout = select_parameters(model)
    ro = rollouts(V, 16, prompt=8, response=4, seed=0)
    B = ro["tokens"].shape[0]
    psg = PerSampleGrads(model, layout, check=False)
    acc = MomentAccumulator(layout.P, "cpu")
    settings = {"topk": 6, "mc_samples": 8, "probes": 8}
    T = int(ro["response_len"].max())
    former_modes = ["exact", "topk", "mc"]
    default = resolve_modes(None, T, V, stage_cfg(None).tokens.exact_budget)
    head = lm_head_entry(model, layout)
    batch = rollout_batch(ro)

    def stage(modes: list[str]) -> Callable[[], Any]:
        study = TokenStudy(model, layout, psg, stage_cfg(modes, **settings).tokens, modes, head)
        return lambda: study.batch(batch, 0, discard)

    fns = {
        "scores batch (PerSampleGrads.accumulate)": lambda: scores_batch(psg, ro, acc),
        "tokens batch, former per-candidate loop (exact, topk, mc)": lambda: former_batch(
            model, layout, psg, ro, stage_cfg(former_modes, **settings)
        ),
        f"tokens batch, batched cotangents ({', '.join(former_modes)})": stage(former_modes),
        f"tokens batch, batched cotangents, default ({', '.join(default)})": stage(default),
    }
    res = timed(fns, reps)
    print_table(
        f"demo: V = {V}, P = {layout.P:,}, B = {B}, prompt 8 + response <= {T}, topk 6, mc 8, probes 8, {reps} reps",
        res,
    )
    names = list(res)
    print(
        f"\nformer / batched, same modes (median of per-repetition ratios): {paired(res[names[1]], res[names[2]]):.1f}x"
    )


def equal_cost(k: int, seeds: int) -> None:
    V = len(build_char_tokenizer())
    model = build(V, 96, 256, 2, 4, 4, tied=False)
    layout = select_parameters(model)
    ids, attn, _, pl, rl = tensors(rollouts(V, 16, prompt=8, response=4, seed=1))
    T = int(rl.max())
    eng = TokenBackward(model, layout, ids, attn)
    exact = token_fisher(model, layout, ids, attn, pl, rl, "exact", engine=eng)["fisher_sum"]
    print(
        f"\n## equal cost ({T}·{k} = {T * k} cotangent rows per sample), demo model, {seeds} seeds: error of Σ f "
        "against exact\n\n| mode | k | mean rel. L2 | RMS rel. L2 | mean per-tensor rel. std |\n|---|---|---|---|---|"
    )
    for mode, kk in (("mc", k), ("probe", k), ("probe_seq", T * k)):
        est = torch.stack(
            [
                token_fisher(model, layout, ids, attn, pl, rl, mode, kk, s, engine=eng)["fisher_sum"]
                for s in range(seeds)
            ]
        )  # (seeds, P)
        err = torch.linalg.vector_norm(est - exact, dim=1) / torch.linalg.vector_norm(exact)
        sums = torch.stack([est[:, e.offset : e.offset + e.numel].sum(1) for e in layout.entries], 1)
        ref = torch.stack([exact[e.offset : e.offset + e.numel].sum() for e in layout.entries])
        rel_std = (sums.std(0) / ref).mean()
        print(f"| {mode} | {kk} | {err.mean():.3g} | {err.square().mean().sqrt():.3g} | {rel_std:.3g} |")


def smollm(reps: int, rows: int, prompt: int, response: int) -> None:
    V = 49152
    model = build(V, 576, 1536, 30, 9, 3, tied=True)
    layout = select_parameters(model)
    ro = rollouts(V, rows, prompt, response, seed=2)
    ids, attn, _, pl, rl = tensors(ro)
    B, T = rows, int(rl.max())
    psg = PerSampleGrads(model, layout, check=False)
    acc = MomentAccumulator(layout.P, "cpu")
    cfg = stage_cfg(None, probes=2)
    modes = resolve_modes(None, T, V, cfg.tokens.exact_budget)
    study = TokenStudy(model, layout, psg, cfg.tokens, modes, lm_head_entry(model, layout))
    batch = rollout_batch(ro)

    def fisher(mode: str, k: int) -> Callable[[], Any]:
        return lambda: token_fisher(model, layout, ids, attn, pl, rl, mode, k, 0)

    fns = {
        "scores batch (PerSampleGrads.accumulate)": lambda: scores_batch(psg, ro, acc),
        "token_fisher probe_seq, k = 2": fisher("probe_seq", 2),
        "token_fisher probe, k = 1 per position": fisher("probe", 1),
        f"tokens stage batch, default ({', '.join(modes)}, probes 2, + token scores)": lambda: study.batch(
            batch, 0, discard
        ),
    }
    res = timed(fns, reps)
    print_table(
        f"SmolLM2-135M-shaped (tied, V = {V}), P = {layout.P:,}, B = {B}, prompt {prompt} + response <= {T}, "
        f"{reps} reps; per-sample rows {B * layout.P * 4 / 2**30:.2f} GiB",
        res,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--seeds", type=int, default=40, help="seeds of the equal-cost error comparison")
    parser.add_argument("--k", type=int, default=8, help="draws / probes per position in the comparison")
    parser.add_argument("--skip-smollm", action="store_true")
    parser.add_argument("--smollm-rows", type=int, default=2)
    parser.add_argument("--smollm-prompt", type=int, default=8)
    parser.add_argument("--smollm-response", type=int, default=8)
    parser.add_argument("--smollm-reps", type=int, default=2)
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    if not args.skip_demo:
        demo(args.reps)
        equal_cost(args.k, args.seeds)
    if not args.skip_smollm:
        smollm(args.smollm_reps, args.smollm_rows, args.smollm_prompt, args.smollm_response)


if __name__ == "__main__":
    main()
