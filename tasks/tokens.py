"""tokens stage: how the sequence Fisher splits over response positions, in three estimators.

Over the first ``tokens.max_samples`` samples of the analysed rollouts, in batches of at most
``BATCH_ROWS`` rows (and at most a quarter of them, so the error can be read at three sample counts),
the stage computes the token Fisher Σ_t f_t of every sample three ways: ``exact`` (all V candidates
per position, only when V <= ``EXACT_VOCAB_LIMIT``), ``topk`` (the ``tokens.topk`` most likely,
renormalised; the covered mass is recorded) and ``mc`` (``tokens.mc_samples`` draws from p, run as
two independent halves so that their disagreement estimates the Monte Carlo error). On the same
samples it computes the sequence scores s_n and the token scores s_{n,t}, checks Σ_t s_{n,t} = s_n,
and keeps Σ_n s_n² and Σ_n Σ_t s_{n,t}² for the sequence Fisher F = mean(s²) and the cross-term
measure ‖mean(s² − Σ_t s_t²)‖ / ‖mean(s²)‖. All scores are centered under the policy p.

Store ``tokens.zarr`` (dims: sample, position = response position, param, batch):
- ``trace_{mode}``, ``entropy``, ``p_drawn``, ``covered_mass`` (sample, position) float64 (0 beyond a
  row's response), ``trace_mc`` is the K-draw estimate; ``score_sum_relerr`` (sample,) float64,
  ‖Σ_t s_t − s‖ / ‖s‖ per sample;
- batch rows (batch, param) float64: ``rows_{name}`` = the batch's Σ_n Σ_t f_{n,t} for name in
  (exact, topk, mc_a, mc_b), Σ_n s_n² (``seq_sq``) and Σ_n Σ_t s_{n,t}² (``tok_sq``); ``batch_count``
  (batch,) rows per batch; ``lm_head_relerr`` (batch,) closed form vs exact (NaN when not checked);
- ``fisher_{mode}`` (param,) = Σ f / N per mode and ``fisher_seq`` (param,) = mean(s²);
- ``batch_done`` progress; attrs: ``scalars`` (cross-term ratio, errors against F at three N, mode
  agreement, expected MC error, sum check, LM-head check), ``errors_vs_seq`` (rows of the three-N
  table), the tensor table, sampler and modes.
Resumable by batch; same config and seed give identical stores.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from prefect import task
from torch import nn

from covgrad.config import PipelineConfig
from covgrad.layout import ParamLayout, select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad
from covgrad.token_fisher import lm_head_token_fisher, token_fisher, token_scores
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from tasks.base_model import load_models
from tasks.common import StageResult, progress_bar, run_stage
from tasks.plan import on_policy
from tasks.rollouts import STORE as ROLLOUTS
from tasks.scores import PARAM_CHUNK, pick_device

STORE = "tokens.zarr"
BATCH_ROWS = 16  # most samples per batch: the per-sample gradients are BATCH_ROWS x P float32
EXACT_VOCAB_LIMIT = 4096  # the exact mode costs V backward passes per response position
ROW_NAMES = ("exact", "topk", "mc_a", "mc_b", "seq_sq", "tok_sq")
POSITION_ARRAYS = ("trace_exact", "trace_topk", "trace_mc", "entropy", "p_drawn", "covered_mass")


def batch_bounds(n: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of ``min(BATCH_ROWS, ceil(n / 4))`` rows (the last may be shorter)."""
    rows = max(1, min(BATCH_ROWS, math.ceil(n / 4)))
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def mc_split(k: int) -> tuple[int, int]:
    """Draws of the two independent Monte Carlo halves: (ceil(k/2), floor(k/2))."""
    return (k + 1) // 2, k // 2


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (NaN when ref is zero)."""
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(x - ref)) / denom if denom > 0 else float("nan")


def lm_head_entry(model: nn.Module, layout: ParamLayout) -> str | None:
    """Layout name of an untied LM head weight, or None when it is tied or not selected."""
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        return None
    name = next((n for n, p in model.named_parameters() if p is head.weight), None)
    return name if name in layout.names else None


def lm_head_check(
    model: nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    target: torch.Tensor,
    exact_sum: torch.Tensor,
    shape: tuple[int, ...],
) -> float:
    """Relative L2 error of the LM-head closed form against the exact token Fisher of one batch.

    ``ids``, ``attn``, ``target`` (B, L): rows, attention mask and response-token mask; ``exact_sum``:
    the exact mode's Σ f restricted to the LM head weight, ``numel`` float64 values of shape ``shape``.
    """
    captured: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, inp, out: captured.append(inp[0]))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits  # (B, L, V)
    finally:
        hook.remove()
    weights = torch.zeros_like(target)
    weights[:, :-1] = target[:, 1:]  # logit row t predicts token t + 1
    closed = lm_head_token_fisher(captured[0], torch.softmax(logits.double(), dim=-1), weights)
    return rel_l2(closed.reshape(shape).cpu().numpy(), exact_sum.reshape(shape).cpu().numpy())


def _create_arrays(g: Any, N: int, T: int, P: int, n_batches: int, chunk_rows: int) -> None:
    def arr(name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dims: list[str], fill: float = 0.0) -> None:
        if name not in g:
            g.create_array(name, shape=shape, chunks=chunks, dtype="float64", fill_value=fill, dimension_names=dims)

    for name in POSITION_ARRAYS:
        arr(name, (N, T), (chunk_rows, T), ["sample", "position"])
    arr("score_sum_relerr", (N,), (chunk_rows,), ["sample"])
    for name in ROW_NAMES:
        arr(f"rows_{name}", (n_batches, P), (1, min(P, PARAM_CHUNK)), ["batch", "param"])
    arr("batch_count", (n_batches,), (1,), ["batch"])
    arr("lm_head_relerr", (n_batches,), (1,), ["batch"], float("nan"))


def _batch(
    model: nn.Module,
    layout: ParamLayout,
    psg: PerSampleGrads,
    cfg: PipelineConfig,
    ro: Any,
    lo: int,
    hi: int,
    b: int,
    exact: bool,
    head: str | None,
    device: torch.device,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray, float]:
    """One batch: (param,) row sums, (rows, T_b) position arrays, (rows,) sum-check errors, LM-head error."""
    pl = torch.from_numpy(ro["prompt_len"][lo:hi]).long()
    rl = torch.from_numpy(ro["response_len"][lo:hi]).long()
    L = int((pl + rl).max())
    ids = torch.from_numpy(ro["tokens"][lo:hi, :L]).long().to(device)
    attn = (torch.arange(L)[None, :] < (pl + rl)[:, None]).long().to(device)
    target = torch.from_numpy(ro["response_mask"][lo:hi, :L]).float().to(device)
    pl, rl = pl.to(device), rl.to(device)
    pos = torch.arange(L, device=device).expand_as(ids)  # right-padded rows, as in the scores stage
    fn = lambda i, a, d: psg(i, a, d, position_ids=pos)  # noqa: E731

    def run(mode: str, k: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
        limit = EXACT_VOCAB_LIMIT
        return token_fisher(model, layout, ids, attn, pl, rl, mode, k, seed, fn, exact_vocab_limit=limit)

    outs = {"topk": run("topk", k=cfg.tokens.topk)}
    if exact:
        outs["exact"] = run("exact")
    ka, kb = mc_split(cfg.tokens.mc_samples)
    base_seed = cfg.tokens.seed * 1_000_003 + 2 * b
    outs["mc_a"] = run("mc", k=ka, seed=base_seed)
    if kb:
        outs["mc_b"] = run("mc", k=kb, seed=base_seed + 1)
    seq = fn(ids, attn, lambda logits: score_logit_grad(logits, ids, target)).double()  # (B, P)
    tok = token_scores(model, layout, ids, attn, pl, rl, per_sample_grads=fn).double()  # (B, T_b, P)
    diff = torch.linalg.vector_norm(tok.sum(1) - seq, dim=1)
    norm = torch.linalg.vector_norm(seq, dim=1)
    relerr = torch.where(norm > 0, diff / norm.clamp(min=torch.finfo(torch.float64).tiny), diff)

    rows = {name: out["fisher_sum"] for name, out in outs.items()}
    rows["seq_sq"] = seq.square().sum(0)
    rows["tok_sq"] = tok.square().sum((0, 1))
    K = cfg.tokens.mc_samples
    trace_mc = (ka * outs["mc_a"]["trace"] + (kb * outs["mc_b"]["trace"] if kb else 0)) / K
    positions = {
        "trace_topk": outs["topk"]["trace"],
        "trace_mc": trace_mc,
        "entropy": outs["topk"]["entropy"],
        "p_drawn": outs["topk"]["p_drawn"],
        "covered_mass": outs["topk"]["covered_mass"],
    }
    if exact:
        positions["trace_exact"] = outs["exact"]["trace"]
    head_err = float("nan")
    if exact and head is not None:
        e = layout.entry(head)
        head_err = lm_head_check(model, ids, attn, target, rows["exact"][e.offset : e.offset + e.numel], e.shape)
    return (
        {k: v.cpu().numpy() for k, v in rows.items()},
        {k: v.cpu().numpy() for k, v in positions.items()},
        relerr.cpu().numpy(),
        head_err,
    )


def summarize(
    g: Any, response: np.ndarray, exact: bool, K: int
) -> tuple[dict[str, np.ndarray], dict[str, Any], list[dict]]:
    """The (param,) Fisher arrays, scalars and the three-N error table from the arrays of ``g``.

    ``response``: (N, T) bool, True at response positions; ``K``: Monte Carlo draws per position.
    """
    N = response.shape[0]
    counts = g["batch_count"][:].astype(np.int64)
    cum_n = np.cumsum(counts)
    modes = ["exact", "topk", "mc"] if exact else ["topk", "mc"]
    ka, kb = mc_split(K)
    rows = {name: g[f"rows_{name}"][:] for name in ROW_NAMES}
    cums = {name: np.cumsum(v, axis=0) for name, v in rows.items()}
    cums["mc"] = (ka * cums["mc_a"] + kb * cums["mc_b"]) / K
    table = []
    for target in (N / 4, N / 2, N):
        i = int(np.argmin(np.abs(cum_n - target)))
        n = int(cum_n[i])
        F_seq = cums["seq_sq"][i] / n
        for mode in modes:
            table.append({"mode": mode, "n": n, "relerr_vs_seq": rel_l2(cums[mode][i] / n, F_seq)})
    fisher = {f"fisher_{mode}": cums[mode][-1] / N for mode in modes}
    fisher["fisher_seq"] = cums["seq_sq"][-1] / N
    scalars: dict[str, Any] = {
        "N": N,
        "mc_samples": K,
        "cross_term_ratio": rel_l2(cums["tok_sq"][-1] / N, fisher["fisher_seq"]),
        "score_sum_relerr_max": float(np.max(g["score_sum_relerr"][:])),
        "covered_mass_topk_mean": float(g["covered_mass"][:][response].mean()),
        "entropy_mean": float(g["entropy"][:][response].mean()),
        "mc_vs_topk": rel_l2(fisher["fisher_mc"], fisher["fisher_topk"]),
    }
    for r in table:
        scalars[f"relerr_{r['mode']}_vs_seq_n{r['n']}"] = r["relerr_vs_seq"]
    if kb:
        gap = np.linalg.norm(cums["mc_a"][-1] - cums["mc_b"][-1]) / N
        scalars["mc_expected_relerr"] = float(gap * math.sqrt(ka * kb) / K / np.linalg.norm(fisher["fisher_mc"]))
    else:
        scalars["mc_expected_relerr"] = float("nan")
    if exact:
        scalars["topk_vs_exact"] = rel_l2(fisher["fisher_topk"], fisher["fisher_exact"])
        scalars["mc_vs_exact"] = rel_l2(fisher["fisher_mc"], fisher["fisher_exact"])
    head = g["lm_head_relerr"][:]
    scalars["lm_head_closed_form_relerr_max"] = float(np.max(head)) if np.isfinite(head).all() else None
    return fisher, scalars, table


def _compute(store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig, up: dict[str, ArtifactRef]) -> dict[str, Any]:
    sampler = cfg.rollouts.analyse
    ro = store.open_group(up[f"rollouts.{sampler}"], ROLLOUTS, mode="r")
    model, _ = load_models(store, up["base_model"], "policy", cfg)
    device = pick_device(cfg.scores.device)
    model.to(device).eval()
    V = model.get_output_embeddings().weight.shape[0]
    if cfg.tokens.topk > V:
        raise ValueError(f"tokens.topk = {cfg.tokens.topk} exceeds the vocabulary size V = {V}; set tokens.topk <= {V}")
    layout = select_parameters(model, cfg.scores.params)
    exact = V <= EXACT_VOCAB_LIMIT
    head = lm_head_entry(model, layout)
    N = min(cfg.tokens.max_samples, ro["tokens"].shape[0])
    T = ro["sampler_logp"].shape[1]
    batches = batch_bounds(N)
    g = store.open_group(ref, STORE, mode="a")
    _create_arrays(g, N, T, layout.P, len(batches), batches[0][1])
    create_progress(g, len(batches))
    psg = PerSampleGrads(model, layout, check=cfg.scores.self_check)
    todo = pending_batches(g)
    with progress_bar("tokens", len(batches)) as bar:
        bar.update(len(batches) - len(todo))
        for b in todo:
            lo, hi = batches[b]
            rows, positions, relerr, head_err = _batch(model, layout, psg, cfg, ro, lo, hi, b, exact, head, device)
            for name, value in rows.items():
                g[f"rows_{name}"][b] = value
            for name, value in positions.items():
                g[name][lo:hi, : value.shape[1]] = value
            g["score_sum_relerr"][lo:hi] = relerr
            g["batch_count"][b] = hi - lo
            g["lm_head_relerr"][b] = head_err
            mark_batch_done(g, b)
            bar.update(1)
    response = np.arange(T)[None, :] < ro["response_len"][:N][:, None]  # (N, T)
    fisher, scalars, table = summarize(g, response, exact, cfg.tokens.mc_samples)
    for name, values in fisher.items():
        g.create_array(
            name, data=values, chunks=(min(layout.P, PARAM_CHUNK),), dimension_names=["param"], overwrite=True
        )
    g.attrs.update(
        {
            "scalars": scalars,
            "errors_vs_seq": table,
            "tensors": layout.to_records(),
            "sampler": sampler,
            "on_policy": on_policy(cfg.rollouts.samplers[sampler]),
            "modes": [m.removeprefix("fisher_") for m in fisher if m != "fisher_seq"],
            "exact_vocab_limit": EXACT_VOCAB_LIMIT,
            "lm_head": head,
            "V": V,
        }
    )
    store.consolidate(ref, STORE)
    return {"scalars": scalars}


@task(name="tokens")
def tokens_task(ref: ArtifactRef, cfg: PipelineConfig, instance: str, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Token-level Fisher (exact / top-k / Monte Carlo) of the analysed rollouts."""
    return run_stage(
        ref,
        {**cfg.tokens.model_dump(), "params": cfg.scores.params},
        lambda store, r: _compute(store, r, cfg, upstream),
        resumable=True,
    )
