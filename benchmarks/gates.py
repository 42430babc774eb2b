"""Cost of the experts rules' gate derivative δ = ∂(gate input): the backward kernels of
:mod:`covgrad.scores.activations` against autograd on the same activation, side by side in one process.

Per activation (SiLU and tanh-GELU of the default gate, GPT-OSS's clamped GLU with its clamped ``up``) and per shape
(m routed (token, k) pairs × I intermediate columns, float32, the column-major halves the rules hand over), the
median time of ``autograd.grad`` through the activation (the graph built per call, as the rules did) and of the
kernels (:func:`covgrad.scores.activations.act_vjp`, :func:`glu_vjp` and :func:`clamp_mask`), interleaved rep by
rep; the ratio kernels / autograd (< 1: the kernels are cheaper). Each row also checks that both give the same bytes.

    OMP_NUM_THREADS=1 python -m benchmarks.gates --threads 1
    python -m benchmarks.gates --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from covgrad.scores.activations import act_vjp, clamp_mask, glu_forward, glu_vjp

# (m, I): the matrix's tiny MoE at B 16 × L 64 × top-2; a 1B-class MoE layer's pairs of one 16 × 512 batch
SHAPES = ((2048, 48), (16 * 512 * 4, 768))
LIMIT, ALPHA = 7.0, 1.702


def _autograd_default(act: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def vjp(gate: Tensor, up: Tensor, da: Tensor) -> Tensor:
        with torch.enable_grad():
            leaf = gate.detach().requires_grad_()
            return torch.autograd.grad(act(leaf), leaf, da * up)[0]

    return vjp


def _kernel_default(act: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    return lambda gate, up, da: act_vjp(act, gate, da * up)


def _autograd_glu(gate: Tensor, up: Tensor, da: Tensor) -> tuple[Tensor, ...]:
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        c = g.clamp(min=None, max=LIMIT)
        out = (u.clamp(min=-LIMIT, max=LIMIT) + 1) * (c * torch.sigmoid(c * ALPHA))
        return torch.autograd.grad(out, (g, u), da)


def _kernel_glu(gate: Tensor, up: Tensor, da: Tensor) -> tuple[Tensor, ...]:
    f, c, s = glu_forward(gate, LIMIT, ALPHA)
    factor = up.clamp(min=-LIMIT, max=LIMIT) + 1
    m, I = gate.shape  # δ into the column-major (m, 2I) layout of the gate's input, as the experts rule writes it
    out = torch.empty(2 * I, m, dtype=gate.dtype, device=gate.device).t()
    glu_vjp(gate, c, s, da * factor, LIMIT, ALPHA, out=out[:, ::2])
    clamp_mask(da * f, up, -LIMIT, LIMIT, out=out[:, 1::2])
    return out[:, ::2], out[:, 1::2]


CASES = {
    "silu": (_autograd_default(F.silu), _kernel_default(F.silu)),
    "gelu tanh": (
        _autograd_default(lambda x: F.gelu(x, approximate="tanh")),
        _kernel_default(torch.nn.GELU(approximate="tanh")),
    ),
    "gpt-oss glu": (_autograd_glu, _kernel_glu),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device={device}, threads={torch.get_num_threads()}, reps={args.reps}, torch {torch.__version__}")
    print("| activation | m × I | autograd µs | kernels µs | kernels / autograd | same bytes |")
    print("|---|---|---:|---:|---:|---|")
    torch.manual_seed(0)
    for name, (slow, fast) in CASES.items():
        for m, I in SHAPES:
            gu = (6 * torch.randn(2 * I, m, device=device)).t()  # column-major (m, 2I), as the grouped GEMM gives
            gate, up = gu[:, ::2], gu[:, 1::2]
            da = torch.randn(I, m, device=device).t()
            a, b = slow(gate, up, da), fast(gate, up, da)
            same = all(map(torch.equal, a, b)) if isinstance(a, tuple) else torch.equal(a, b)
            times: dict[str, list[float]] = {"slow": [], "fast": []}
            for _ in range(args.reps):
                for label, fn in (("slow", slow), ("fast", fast)):
                    sync()
                    t = time.perf_counter()
                    fn(gate, up, da)
                    sync()
                    times[label].append(time.perf_counter() - t)
            a, k = (statistics.median(times[x]) for x in ("slow", "fast"))
            print(f"| {name} | {m} × {I} | {1e6 * a:.0f} | {1e6 * k:.0f} | {k / a:.2f} | {same} |")


if __name__ == "__main__":
    main()
