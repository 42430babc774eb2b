"""Moment-state references: numpy float64 moments of per-sample rows, the fused accumulator's state, and the row-chunk
exactness check."""

from __future__ import annotations

import numpy as np
import torch

from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.persample import BATCH, MODELS, make_batch


def numpy_moments(S: np.ndarray, A: np.ndarray, half: np.ndarray, H: int = 2) -> dict[str, np.ndarray]:
    """Per-half count, mean_a, m2_a (H,) and mean_s, m2_s, c_as (H, P), two-pass float64."""
    out = {k: [] for k in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as")}
    for h in range(H):
        s, a = S[half == h].astype(np.float64), A[half == h].astype(np.float64)
        ds, da = s - s.mean(0), a - a.mean()
        for k, v in zip(out, (len(a), a.mean(), da @ da, s.mean(0), (ds * ds).sum(0), da @ ds), strict=True):
            out[k].append(v)
    return {k: np.asarray(v) for k, v in out.items()}


def state(acc: MomentAccumulator) -> dict[str, np.ndarray]:
    """The accumulator's rows with the float32 mean pair summed in float64."""
    rows = acc.rows()
    rows["mean_s"] = rows["mean_s"].astype(np.float64) + rows.pop("mean_s_lo", 0.0)
    return rows


def assert_close(got: dict, want: dict, rtol: float) -> None:
    """Every array within ``rtol`` of the largest magnitude of its reference row."""
    for k, w in want.items():
        g = np.asarray(got[k], dtype=np.float64)
        scale = np.maximum(np.abs(w).max(axis=-1, keepdims=True) if w.ndim > 1 else np.abs(w), 1e-300)
        err = np.abs(g - w) / scale
        assert err.max() <= rtol, f"{k}: relative error {err.max():.3g} > {rtol:g}"


def fused(
    model, layout, batches, state_dtype="float64", rows=False, check=True, device="cpu", compiled=None, chunk_bytes=None
):
    """Accumulate ``batches`` (list of (batch, advantages, half)) through PerSampleGrads.accumulate."""
    psg = PerSampleGrads(model, layout, check=check, chunk_bytes=chunk_bytes)
    acc = MomentAccumulator(layout.P, device, state_dtype, compiled=compiled)
    for batch, a, h in batches:
        out = torch.empty(len(a), layout.P, device=device) if rows else None
        fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, h, batch["position_ids"], out=out)
    return acc


def check_row_chunks(name: str, chunk_bytes: int, device: str) -> None:
    """The chunks put together are the rows of ``__call__`` (fp32 products of other GEMM shapes: within 1e-6)
    and the state is the numpy float64 moments of exactly what was folded (1e-9; float32 state 1e-5), eager
    and (for llama-tied and gpt2-conv1d) compiled."""
    model = MODELS[name]().to(device)
    layout = select_parameters(model)
    batches = []
    for seed in (40, 41, 42):
        gen = np.random.default_rng(seed)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in make_batch(seed, **BATCH).items()}
        batches.append((batch, gen.standard_normal(4), np.array([0, 1, 1, seed % 2])))
    A = np.concatenate([a for _, a, _ in batches])
    half = np.concatenate([h for _, _, h in batches])
    cases = [("float64", None, 1e-9), ("float32", None, 1e-5)]
    if name in ("llama-tied", "gpt2-conv1d"):
        cases.append(("float64", True, 1e-9))
    for state_dtype, compiled, rtol in cases:
        psg = PerSampleGrads(model, layout, check=True, chunk_bytes=chunk_bytes)
        acc = MomentAccumulator(layout.P, device, state_dtype, compiled=compiled)
        folded, calls, real_fold = [], [], acc.fold

        def fold(offset, block, seen=folded, n=calls, f=real_fold):
            seen[-1][:, offset : offset + block[0].numel()] = block.reshape(block.shape[0], -1).double().cpu()
            n.append(offset)
            f(offset, block)

        acc.fold = fold
        rows = []
        for batch, a, h in batches:
            fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
            folded.append(torch.full((4, layout.P), float("nan"), dtype=torch.float64))
            psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, h, batch["position_ids"])
            rows.append(psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"]).double().cpu())
        S, R = torch.cat(folded), torch.cat(rows)
        assert len(calls) > 3 * len(batches) * len(layout.entries)  # chunks, not one fold per tensor
        assert not S.isnan().any()
        assert float((S - R).abs().max()) <= 1e-6 * float(R.abs().max())
        assert_close(state(acc), numpy_moments(S.numpy(), A, half), rtol)
