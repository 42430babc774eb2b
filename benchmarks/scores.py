"""Per-sample scores: covgrad's hooks against a plain batched backward, a naive loop and torch.func vmap.

All methods see the same batch of one process (prompt tokens masked out, response tokens scored,
objective Σ_t log p(y_t)), timed in interleaved repetitions after one warm-up; each repetition's time
is divided by the floor's (plain batched backward of the summed objective) in the same repetition and
the median ratio is reported. Peak memory is the torch profiler's allocator bytes above the level at the
call's start (``profile_memory=True``, running sum of its [memory] events), one call per method.
A last section streams N samples through PerSampleGrads + batch_moments in batches and reports the
peak for two values of N (it should not grow with N).

    python -m benchmarks.scores                       # both model sizes, ~2 minutes on one core
    python -m benchmarks.scores --sizes small --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from transformers import LlamaConfig, LlamaForCausalLM

from covgrad.layout import ParamLayout, select_parameters
from covgrad.persample import PerSampleGrads, batch_moments, score_logit_grad

# name: (vocab, hidden, intermediate, layers, heads)
SIZES = {"small": (16, 128, 256, 2, 4), "large": (256, 256, 640, 4, 4)}


def build(size: str) -> nn.Module:
    """A Llama from config (eager attention so vmap has batching rules), norms perturbed, eval mode."""
    vocab, hidden, inter, layers, heads = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def make_batch(vocab: int, batch: int, prompt: int, response: int, seed: int) -> tuple[Tensor, Tensor]:
    """Token ids (B, L) and response weights (B, L), L = prompt + response."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + response), generator=gen)
    w = torch.zeros(batch, prompt + response)
    w[:, prompt:] = 1.0
    return ids, w


def objective(logits: Tensor, ids: Tensor, w: Tensor) -> Tensor:
    """Σ over scored positions of log p(token); logits (..., L, V), ids and w (..., L)."""
    lp = F.log_softmax(logits[..., :-1, :], -1).gather(-1, ids[..., 1:, None])[..., 0]
    return (w[..., 1:] * lp).sum()


def methods(model: nn.Module, layout: ParamLayout, ids: Tensor, w: Tensor) -> dict[str, Callable[[], Tensor]]:
    """Each method returns its product: the summed gradient (P,) for the floor, scores (B, P) otherwise."""
    names = layout.names
    params = dict(model.named_parameters())
    plist = [params[n] for n in names]
    mask = torch.ones_like(ids)
    adv = torch.randn(ids.shape[0])
    psg = PerSampleGrads(model, layout, check=True)

    def floor() -> Tensor:
        gs = torch.autograd.grad(objective(model(input_ids=ids).logits, ids, w), plist)
        return torch.cat([g.reshape(-1) for g in gs])

    def naive() -> Tensor:
        rows = []
        for n in range(ids.shape[0]):
            gs = torch.autograd.grad(objective(model(input_ids=ids[n : n + 1]).logits[0], ids[n], w[n]), plist)
            rows.append(torch.cat([g.reshape(-1) for g in gs]))
        return torch.stack(rows)

    def one(p: dict[str, Tensor], x: Tensor, wx: Tensor) -> Tensor:
        return objective(functional_call(model, p, (x[None],)).logits[0], x, wx)

    per_sample_grad = vmap(grad(one), in_dims=(None, 0, 0))

    def vmapped() -> Tensor:
        gs = per_sample_grad({n: p.detach() for n, p in params.items()}, ids, w)
        return torch.cat([gs[n].reshape(ids.shape[0], -1) for n in names], dim=1)

    buffer = torch.empty(ids.shape[0], layout.P)

    def covgrad_scores(out: Tensor | None = None) -> Tensor:
        return psg(ids, mask, lambda z: score_logit_grad(z, ids, w), out=out)

    def covgrad_moments() -> Tensor:
        S = covgrad_scores(buffer)
        batch_moments(S, adv)
        return S

    return {
        "floor: batched backward": floor,
        "naive loop": naive,
        "vmap(grad)": vmapped,
        "covgrad scores, fresh output": covgrad_scores,
        "covgrad scores, reused output": lambda: covgrad_scores(buffer),
        "covgrad scores+moments, reused output": covgrad_moments,
    }


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak allocator MiB above the start level during fn(), from the profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return peak / 2**20


def run_size(size: str, batch: int, prompt: int, response: int, reps: int) -> None:
    model = build(size)
    layout = select_parameters(model)
    ids, w = make_batch(SIZES[size][0], batch, prompt, response, seed=1)
    fns = methods(model, layout, ids, w)
    products = {name: fn().clone() for name, fn in fns.items()}  # warm-up; covgrad's first call self-checks
    ref = products["naive loop"].double()
    errors = {
        "floor: batched backward": float((products["floor: batched backward"] - ref.sum(0)).norm() / ref.sum(0).norm())
    }
    for name, out in products.items():
        if name not in errors:
            errors[name] = float((out.double() - ref).norm() / ref.norm())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    floor = times["floor: batched backward"]
    print(
        f"\n## {size}: {layout.P:,} params, B={batch}, prompt {prompt} + response {response} tokens, "
        f"{reps} reps; per-sample scores {batch * layout.P * 4 / 2**20:.1f} MiB (a reused output buffer is "
        "allocated once, outside the measured peak)"
    )
    print(f"| method | median ms | samples/s | ratio to floor | peak MiB | rel err vs naive |\n|{'---|' * 6}")
    for name, fn in fns.items():
        med = statistics.median(times[name])
        ratio = statistics.median(t / f for t, f in zip(times[name], floor, strict=True))
        print(
            f"| {name} | {med * 1e3:.1f} | {batch / med:.0f} | {ratio:.2f} | {peak_mib(fn):.1f} | {errors[name]:.1e} |"
        )


def run_streaming(size: str, batch: int, prompt: int, response: int, ns: list[int]) -> None:
    model = build(size)
    layout = select_parameters(model)
    psg = PerSampleGrads(model, layout, check=False)

    def stream(n_samples: int) -> None:
        buffer = torch.empty(batch, layout.P)  # inside the measured window
        for b in range(n_samples // batch):
            ids, w = make_batch(SIZES[size][0], batch, prompt, response, seed=100 + b)
            S = psg(ids, torch.ones_like(ids), lambda z, ids=ids, w=w: score_logit_grad(z, ids, w), out=buffer)
            batch_moments(S, torch.randn(batch))  # the row a pipeline would write and drop

    stream(batch)
    print(f"\n## streaming ({size}, batches of {batch}, PerSampleGrads into one reused buffer + batch_moments)")
    print("| N samples | wall s | peak MiB |\n|---|---|---|")
    for n in ns:
        t0 = time.perf_counter()
        peak = peak_mib(lambda n=n: stream(n))
        print(f"| {n} | {time.perf_counter() - t0:.1f} | {peak:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "large"], choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=32, help="samples per batch")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (not scored)")
    parser.add_argument("--response", type=int, default=32, help="response tokens (scored)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up")
    parser.add_argument("--stream-size", default="small", choices=list(SIZES))
    parser.add_argument("--stream-n", type=int, nargs="+", default=[256, 4096], help="samples streamed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; peak memory: torch profiler allocator bytes above start")
    for size in args.sizes:
        run_size(size, args.batch, args.prompt, args.response, args.reps)
    run_streaming(args.stream_size, args.batch, args.prompt, args.response, args.stream_n)


if __name__ == "__main__":
    main()
