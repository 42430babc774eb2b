"""Per-sample scores: the scores stage's whole streaming step against a plain batched backward, vmap and a loop.

All methods see the same batch in one process (prompt tokens masked out, response tokens scored,
objective Σ_t log p(y_t)), timed in interleaved repetitions after one warm-up; each repetition's time
is divided by the floor's (one batched forward + backward of the summed objective, every parameter
requiring grad: what a trainer pays per step) in the same repetition and the median ratio is reported.

- "covgrad streaming step": what the scores stage runs per batch: ``PerSampleGrads.accumulate`` folds
  each tensor's per-sample block into the float64 moment accumulators on the device while the backward
  runs (nothing B × P is formed or copied to the host), Linear weights in row chunks folded while in
  cache, with the compiled fold whatever the model's size (the header says when compiling failed and the
  eager fold ran instead); ("float32 state": the same with ``scores.state_dtype: float32``; "whole
  blocks": every block formed whole, then folded, ``chunk_bytes=0``);
- "covgrad rows": the (B, P) float32 per-sample rows (``PerSampleGrads.__call__``, one reused buffer);
- vmap(grad) and the naive loop (one backward per sample); on cuda they run on ``--sub`` samples and
  their time is scaled to B (their per-sample cost does not fall with B).

The floor differentiates the selected parameters (all of them unless ``--params``). Peak memory: on
cuda the allocator's peak above the level at the call's start (``torch.cuda.max_memory_allocated``);
on CPU the torch profiler's allocator bytes above the start.
The bf16/fp16 per-sample products use ``torch.bmm(..., out_dtype=torch.float32)`` on cuda (tensor cores);
CPU kernels lack that overload, so there they run as fp32 GEMMs on upcast operands (printed per run).

    python -m benchmarks.scores --device cpu                     # small and large CPU models, ~2 min
    python -m benchmarks.scores --device cpu --model large --chunk-kib 0 2048 --stream-n   # chunk sizes
    python -m benchmarks.scores --device cuda --model llama-134m llama-0.85b
    python -m benchmarks.scores --device cpu --model smollm2-tied-2l --batch 4 --stream-n   # a tied embedding
    python -m benchmarks.scores --device cuda --model qwen2.5-7b --params "model.layers.1[4-9].mlp.*" \
        "model.layers.2[0-7].mlp.*"    # all 7.6e9 parameters need 366 GB of float64 state (README)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from covgrad.layout import ParamLayout, select_parameters
from covgrad.moments import MomentAccumulator
from covgrad.scores import PerSampleGrads, default_chunk_bytes, score_logit_grad

# name: (family, vocab, hidden, intermediate, layers, heads, kv heads, dtype, batch, prompt, response)
MODELS = {
    "small": ("llama", 16, 128, 256, 2, 4, 4, torch.float32, 32, 8, 32),
    "large": ("llama", 256, 256, 640, 4, 4, 4, torch.float32, 32, 8, 32),
    "llama-134m": ("llama", 32000, 768, 2048, 12, 12, 12, torch.float32, 16, 128, 384),
    "llama-0.85b": ("llama", 32000, 2048, 5632, 16, 32, 8, torch.bfloat16, 8, 128, 384),
    "qwen2.5-7b": ("qwen2", 152064, 3584, 18944, 28, 28, 4, torch.bfloat16, 4, 128, 384),
    "smollm2-tied-2l": ("llama", 49152, 576, 1536, 2, 9, 3, torch.float32, 16, 32, 32),
}
# models whose LM head is tied to the input embedding (SmolLM2's 49152 × 576 table, two of its layers)
TIED = frozenset({"smollm2-tied-2l"})


def build(name: str, device: torch.device) -> nn.Module:
    """Random-init model from config on ``device`` (eager attention on CPU so vmap has batching rules,
    sdpa on cuda), norms perturbed, eval mode."""
    family, vocab, hidden, inter, layers, heads, kv, dtype = MODELS[name][:8]
    torch.manual_seed(0)
    kwargs = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": name in TIED,
        "attn_implementation": "sdpa" if device.type == "cuda" else "eager",
    }
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = model_cls(config_cls(**kwargs))
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def make_batch(vocab: int, batch: int, prompt: int, response: int, seed: int, device: torch.device) -> tuple:
    """Token ids (B, L) and response weights (B, L), L = prompt + response."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + response), generator=gen)
    w = torch.zeros(batch, prompt + response)
    w[:, prompt:] = 1.0
    return ids.to(device), w.to(device)


def objective(logits: Tensor, ids: Tensor, w: Tensor) -> Tensor:
    """Σ over scored positions of log p(token); logits (..., L, V), ids and w (..., L)."""
    lp = F.log_softmax(logits[..., :-1, :].float(), -1).gather(-1, ids[..., 1:, None])[..., 0]
    return (w[..., 1:] * lp).sum()


def methods(
    model: nn.Module,
    layout: ParamLayout,
    ids: Tensor,
    w: Tensor,
    sub: int,
    accs: dict[str, MomentAccumulator],
    chunks: Sequence[int] = (),
) -> dict[str, tuple]:
    """name -> (fn, samples it covers); fns return their product (summed gradient, rows, or None). The
    streaming steps put their accumulators (one per state dtype) into ``accs`` on their first call;
    ``chunks``: row-chunk sizes (bytes) of extra float64 streaming steps beside the device's default."""
    names = layout.names
    params = dict(model.named_parameters())
    plist = [params[n] for n in names]
    B, device = ids.shape[0], ids.device
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
    adv = np.random.default_rng(0).standard_normal(B)
    half = np.arange(B) % 2
    psg = PerSampleGrads(model, layout, check=True)
    whole = PerSampleGrads(model, layout, check=False, chunk_bytes=0)
    fn = lambda z: score_logit_grad(z, ids, w)  # noqa: E731

    def floor() -> Tensor:
        gs = torch.autograd.grad(objective(model(input_ids=ids).logits, ids, w), plist)
        return torch.cat([g.reshape(-1).float() for g in gs])

    def naive() -> Tensor:
        rows = []
        for n in range(sub):
            gs = torch.autograd.grad(objective(model(input_ids=ids[n : n + 1]).logits[0], ids[n], w[n]), plist)
            rows.append(torch.cat([g.reshape(-1).float() for g in gs]))
        return torch.stack(rows)

    def one(p: dict[str, Tensor], x: Tensor, wx: Tensor) -> Tensor:
        return objective(functional_call(model, p, (x[None],)).logits[0], x, wx)

    per_sample_grad = vmap(grad(one), in_dims=(None, 0, 0))

    def vmapped() -> Tensor:
        gs = per_sample_grad({n: p.detach() for n, p in params.items()}, ids[:sub], w[:sub])
        return torch.cat([gs[n].reshape(sub, -1).float() for n in names], dim=1)

    def streaming(state_dtype: str, engine: PerSampleGrads = psg) -> None:
        # whole blocks fold into the same accumulator (48 bytes per parameter each: 41 GB at 0.85B)
        if state_dtype not in accs:  # allocated by the warm-up call (an OOM there is reported as such)
            accs[state_dtype] = MomentAccumulator(layout.P, device, state_dtype, compiled=True)
        engine.accumulate(ids, mask, fn, accs[state_dtype], adv, half, position_ids=pos)

    out: dict[str, tuple] = {
        "floor: batched backward": (floor, B),
        "covgrad streaming step": (lambda: streaming("float64"), B),
        "covgrad streaming step, float32 state": (lambda: streaming("float32"), B),
        "covgrad streaming step, whole blocks": (lambda: streaming("float64", whole), B),
    }
    for size in chunks:
        engine = PerSampleGrads(model, layout, check=False, chunk_bytes=size)
        out[f"covgrad streaming step, {size >> 10} KiB chunks"] = (lambda e=engine: streaming("float64", e), B)
    if _rows_limit(device) > B * layout.P * 4:
        buffer = torch.empty(B, layout.P, device=device)
        out["covgrad rows (B x P)"] = (lambda: psg(ids, mask, fn, position_ids=pos, out=buffer), B)
    out["vmap(grad)"] = (vmapped, sub)
    out["naive loop"] = (naive, sub)
    return out


def _rows_limit(device: torch.device) -> int:
    """Bytes allowed for a (B, P) rows buffer in the benchmark (a fifth of the device's memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 5
    return 4 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak allocator MiB above the start level during fn()."""
    if device.type == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - start) / 2**20
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


def _try(fn: Callable[[], object]) -> object | str:
    try:
        return fn()
    except torch.OutOfMemoryError:
        return "OOM"


def run_model(
    name: str,
    device: torch.device,
    reps: int,
    sub: int,
    batch: int | None,
    params: list[str] | None,
    chunks: Sequence[int] = (),
) -> None:
    model = build(name, device)
    layout = select_parameters(model, params)
    _, vocab, *_, dtype, B, prompt, response = MODELS[name]
    B = batch or B
    sub = min(sub, B) if device.type == "cuda" else B
    ids, w = make_batch(vocab, B, prompt, response, seed=1, device=device)
    accs: dict[str, MomentAccumulator] = {}
    fns = methods(model, layout, ids, w, sub, accs, chunks)
    products = {}
    for m, (fn, _) in fns.items():  # warm-up; covgrad's first call self-checks
        got = _try(fn)
        products[m] = got.clone() if isinstance(got, Tensor) else got
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ref = products["naive loop"]
    errors: dict[str, str] = {}
    if isinstance(ref, Tensor):
        ref = ref.double()
        for m, got in products.items():
            if isinstance(got, Tensor) and m != "floor: batched backward":
                errors[m] = f"{float((got[:sub].double() - ref).norm() / ref.norm()):.1e}"
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(reps):
        for m, (fn, _) in fns.items():
            if isinstance(products[m], str):
                continue
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[m].append(time.perf_counter() - t0)
    floor = times["floor: batched backward"]
    low = dtype in (torch.bfloat16, torch.float16)
    products_note = (
        "bf16 products on tensor cores (bmm out_dtype=float32)"
        if low and device.type == "cuda"
        else "fp32 GEMMs on upcast operands (CPU has no bmm out_dtype kernel)"
        if low
        else "fp32 products"
    )
    print(
        f"\n## {name} on {device.type}: {layout.P:,} params, {str(dtype).removeprefix('torch.')}, B={B}, prompt "
        f"{prompt} + response {response} tokens, {reps} reps; {products_note}; row chunks "
        f"{default_chunk_bytes(device.type) >> 10} KiB; float64 accumulators "
        f"{2 * 3 * 8 * layout.P / 2**20:.0f} MiB; B x P float32 rows would be {B * layout.P * 4 / 2**20:.0f} MiB; "
        + "; ".join(f"{dt} state: {acc.fold_path} fold" for dt, acc in accs.items())
    )
    print(f"| method | median ms (per B) | samples/s | ratio to floor | peak MiB | rel err vs naive |\n|{'---|' * 6}")
    for m, (fn, covered) in fns.items():
        if isinstance(products[m], str):
            print(f"| {m} | {products[m]} | | | | |")
            continue
        scale = B / covered
        med = statistics.median(times[m]) * scale
        ratio = statistics.median(t * scale / f for t, f in zip(times[m], floor, strict=True))
        peak = peak_mib(fn, device)
        print(f"| {m} | {med * 1e3:.1f} | {B / med:.0f} | {ratio:.2f} | {peak:.1f} | {errors.get(m, '')} |")
    del fns, products
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_streaming(name: str, device: torch.device, ns: list[int]) -> None:
    """The scores stage's loop over N samples: peak memory must not grow with N."""
    model = build(name, device)
    layout = select_parameters(model)
    vocab, B, prompt, response = MODELS[name][1], *MODELS[name][8:]
    psg = PerSampleGrads(model, layout, check=False)

    def stream(n_samples: int) -> None:
        acc = MomentAccumulator(layout.P, device)  # inside the measured window
        for b in range(n_samples // B):
            ids, w = make_batch(vocab, B, prompt, response, seed=100 + b, device=device)
            fn = lambda z, ids=ids, w=w: score_logit_grad(z, ids, w)  # noqa: E731
            psg.accumulate(ids, torch.ones_like(ids), fn, acc, np.ones(B), np.arange(B) % 2)

    stream(B)
    print(f"\n## streaming ({name}, batches of {B}, PerSampleGrads.accumulate into float64 accumulators)")
    print("| N samples | wall s | peak MiB |\n|---|---|---|")
    for n in ns:
        t0 = time.perf_counter()
        peak = peak_mib(lambda n=n: stream(n), device)
        print(f"| {n} | {time.perf_counter() - t0:.1f} | {peak:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", nargs="+", default=None, choices=list(MODELS), help="default: small large (cpu)")
    parser.add_argument("--batch", type=int, default=None, help="samples per batch (default: the model's)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up")
    parser.add_argument("--params", nargs="+", default=None, help="glob patterns of the selected parameters")
    parser.add_argument("--sub", type=int, default=4, help="cuda: samples for vmap and the naive loop")
    parser.add_argument("--stream-n", type=int, nargs="*", default=[256, 4096], help="samples streamed (cpu)")
    parser.add_argument(
        "--chunk-kib", type=int, nargs="*", default=[], help="extra streaming steps with these row chunks (KiB)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    names = args.model or (["small", "large"] if device.type == "cpu" else ["llama-134m", "llama-0.85b"])
    print(f"torch {torch.__version__} on {device.type}" + (", 1 thread" if device.type == "cpu" else ""))
    for name in names:
        run_model(name, device, args.reps, args.sub, args.batch, args.params, [k << 10 for k in args.chunk_kib])
    if device.type == "cpu" and args.stream_n:
        run_streaming("small", device, args.stream_n)


if __name__ == "__main__":
    main()
