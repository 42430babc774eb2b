"""tokens stage: how the sequence Fisher splits over response positions, in several estimators.

Over the first ``tokens.max_samples`` samples of the analysed rollouts, in batches of at most
``BATCH_ROWS`` rows (and at most a quarter of them, so the error can be read at three sample counts),
the stage computes the token Fisher Σ_t f_t of every sample with each mode of ``tokens.modes`` (unset:
``exact``, ``topk``, ``mc`` and ``probe`` when exact's T·V rows per sample fit ``tokens.exact_budget``,
else ``probe`` alone; see :mod:`covgrad.token_fisher`). ``mc`` (``tokens.mc_samples`` draws per
position) and the probe modes (``tokens.probes`` probes) run as two independent halves so that their
disagreement estimates their own error. On the same samples it computes the sequence scores s_n and
the token scores s_{n,t}, checks Σ_t s_{n,t} = s_n, and keeps Σ_n s_n² and Σ_n Σ_t s_{n,t}² for the
sequence Fisher F = mean(s²) and the cross-term measure ‖mean(s² − Σ_t s_t²)‖ / ‖mean(s²)‖. All scores
are centered under the policy p. Every batch runs one forward for all of it (:class:`TokenBackward`);
the sequence scores come from :class:`PerSampleGrads` (self-checked against autograd), so the sum check
also checks the batched-cotangent path against it.

Store ``tokens.zarr`` (dims: sample, position = response position, param, batch):
- ``trace_{mode}`` (modes with a per-position estimate: all but ``probe_seq``), ``entropy``, ``p_drawn``,
  ``covered_mass`` (sample, position) float64 (0 beyond a row's response; ``covered_mass`` is the
  top-k mass, 1 without topk); ``score_sum_relerr`` (sample,) float64, ‖Σ_t s_t − s‖ / ‖s‖ per sample;
- batch rows (batch, param) float64, while the stage runs: ``rows_{name}`` = the batch's Σ_n Σ_t f_{n,t}
  for name in ``row_names(modes)`` (``mc_a``/``mc_b`` etc. for the halved modes), Σ_n s_n² (``seq_sq``)
  and Σ_n Σ_t s_{n,t}² (``tok_sq``). They are the resume state and the summary's input (errors at three
  sample counts), and are dropped once the summary is written: at P = 134.5M they were 12.8 GB of a
  15.3 GB store; ``batch_count`` (batch,) rows per batch; ``lm_head_relerr`` (batch,) closed form vs exact
  (NaN when not checked);
- ``fisher_{mode}`` (param,) = Σ f / N per mode and ``fisher_seq`` (param,) = mean(s²);
- ``batch_done`` progress; attrs: ``scalars`` (cross-term ratio, errors against F at three N,
  Spearman against F, mode agreement, expected error of each halved mode, sum check, LM-head check,
  ``trace_mode`` and ``spearman_trace_entropy``: the plotted trace against the entropy),
  ``errors_vs_seq`` (rows of the three-N table), the tensor table, sampler, modes and main mode.
Resumable by batch; same config and seed give identical stores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from prefect import task
from torch import nn

from covgrad.config import TokensSection
from covgrad.devices import pick_device
from covgrad.heap import release_free_memory
from covgrad.layout import ParamLayout, select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad
from covgrad.stats import dot64
from covgrad.token_fisher import (
    TokenBackward,
    candidate_weights,
    check_exact_budget,
    default_mode,
    response_policy,
    token_fisher,
    token_score_squares,
)
from covgrad.topk import as_values, spearman, spearman_blocked
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from storage.models import load_models
from storage.rollouts import read_batch
from storage.schema import ROLLOUTS, annotate, create, param_chunk
from storage.schema import TOKENS as STORE
from tasks.common import StageResult, progress_bar, run_stage
from tasks.specs import TokensSpec

BATCH_ROWS = 16  # most samples per batch: the per-sample gradients are BATCH_ROWS x P float32
HALVED = ("mc", "probe", "probe_seq")  # random modes, run as two independent halves
POSITION_ARRAYS = ("entropy", "p_drawn", "covered_mass")
SEED_OFFSET = {"mc": 0, "probe": 1 << 40, "probe_seq": 2 << 40}  # independent draws for each random mode


def resolve_modes(modes: list[str] | None, T: int, V: int, exact_budget: int) -> list[str]:
    """The modes to run, main mode first: ``modes`` as given (exact checked against the budget), or by V."""
    if modes is None:
        if default_mode(T, V, exact_budget) == "exact":
            return ["exact", "topk", "mc", "probe"]
        return ["probe"]
    if "exact" in modes:
        check_exact_budget(T, V, exact_budget)
    return list(modes)


def row_names(modes: list[str]) -> list[str]:
    """Names of the (batch, param) row arrays: each mode (halves ``_a``/``_b`` for random modes), seq_sq, tok_sq."""
    names = [n for m in modes for n in ((f"{m}_a", f"{m}_b") if m in HALVED else (m,))]
    return [*names, "seq_sq", "tok_sq"]


def draws(tb: TokensSection, mode: str) -> int:
    """Candidates or probes per position (per sequence for probe_seq) of ``mode``; 0 for exact."""
    return {"exact": 0, "topk": tb.topk, "mc": tb.mc_samples}.get(mode, tb.probes)


def batch_bounds(n: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of ``min(BATCH_ROWS, ceil(n / 4))`` rows (the last may be shorter)."""
    rows = max(1, min(BATCH_ROWS, math.ceil(n / 4)))
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def mc_split(k: int) -> tuple[int, int]:
    """Draws of the two independent halves of a random mode: (ceil(k/2), floor(k/2))."""
    return (k + 1) // 2, k // 2


def _square_sum(x: torch.Tensor, block: int = 1 << 20) -> torch.Tensor:
    """Σ_n x[n]² (P,) float64 of a (B, P) tensor, squared in float64 in column blocks written in place (no
    list of blocks and concatenated copy: two more (P,) float64 vectors at once)."""
    out = torch.empty(x.shape[1], dtype=torch.float64, device=x.device)
    for j in range(0, x.shape[1], block):
        torch.sum(x[:, j : j + block].double().square(), dim=0, out=out[j : j + block])
    return out


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (NaN when ref is zero)."""
    x, ref = np.ravel(x).astype(np.float64), np.ravel(ref).astype(np.float64)
    d = x - ref
    denom = dot64(ref, ref)
    return math.sqrt(dot64(d, d) / denom) if denom > 0 else float("nan")


def lm_head_entry(model: nn.Module, layout: ParamLayout) -> str | None:
    """Layout name of an untied LM head weight, or None when it is tied or not selected."""
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        return None
    name = next((n for n, p in model.named_parameters() if p is head.weight), None)
    return name if name in layout.names else None


def lm_head_check(
    model: nn.Module,
    head: str,
    ids: torch.Tensor,
    attn: torch.Tensor,
    pl: torch.Tensor,
    rl: torch.Tensor,
    closed: torch.Tensor,
    shape: tuple[int, ...],
) -> float:
    """Relative L2 error of the LM head's closed-form exact token Fisher against the backward's.

    ``closed``: the exact mode's Σ f restricted to the head weight ``head`` (float64, ``shape`` elements).
    The reference runs mode exact on a layout of the head alone with the closed form disabled, so its
    backward stops at the head's output (cheap).
    """
    layout = select_parameters(model, [head])
    ref = token_fisher(model, layout, ids, attn, pl, rl, "exact", exact_budget=2**62, closed_form_head=False)
    return rel_l2(closed.reshape(shape).cpu().numpy(), ref["fisher_sum"].reshape(shape).cpu().numpy())


def _create_arrays(g: Any, N: int, T: int, P: int, n_batches: int, chunk_rows: int, modes: list[str]) -> None:
    for name in (*POSITION_ARRAYS, *(f"trace_{m}" for m in modes if m != "probe_seq")):
        create(g, STORE, name, (N, T), rows=chunk_rows)
    create(g, STORE, "score_sum_relerr", (N,), rows=chunk_rows)
    for name in row_names(modes):
        create(g, STORE, f"rows_{name}", (n_batches, P))
    create(g, STORE, "batch_count", (n_batches,))
    create(g, STORE, "lm_head_relerr", (n_batches,))


def _batch(
    model: nn.Module,
    layout: ParamLayout,
    psg: PerSampleGrads,
    tb: TokensSection,
    ro: Any,
    lo: int,
    hi: int,
    b: int,
    modes: list[str],
    head: str | None,
    device: torch.device,
    emit: Callable[[str, np.ndarray], None],
) -> tuple[dict[str, np.ndarray], np.ndarray, float]:
    """One batch, one forward: each (param,) float64 row sum is handed to ``emit(name, row)`` as soon as it
    is computed and then dropped (at P = 134.5M a row is 1.1 GB); returns the (rows, T_b) position arrays,
    the (rows,) sum-check errors and the LM-head error."""
    batch = read_batch(ro, lo, hi).to(device)
    ids, attn, target, pos = batch.input_ids, batch.attention_mask, batch.response_mask, batch.position_ids
    pl, rl = batch.prompt_len, batch.response_len
    eng = TokenBackward(model, layout, ids, attn, pos)

    def run(mode: str, k: int = 0, seed: int = 0, also: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        return token_fisher(
            model,
            layout,
            ids,
            attn,
            pl,
            rl,
            mode,
            k,
            seed,
            tb.exact_budget,
            engine=eng,
            row_bytes=tb.row_bytes,
            also=also,
        )

    # sequence scores first, then freed: at real sizes each (B, P) block is large, so Σ_t s_t from the
    # batched-cotangent engine (one row, the summed cotangent of the token scores) is subtracted in place
    seq = psg(ids, attn, lambda logits: score_logit_grad(logits, ids, target), position_ids=pos)  # (B, P)
    emit("seq_sq", _square_sum(seq).cpu().numpy())
    norm = torch.linalg.vector_norm(seq, dim=1).double()
    eng.add_grads_(seq, score_logit_grad(eng.logits.detach(), ids, target)[None].neg_())  # s − Σ_t s_t
    diff = torch.linalg.vector_norm(seq, dim=1).double()
    del seq
    relerr = torch.where(norm > 0, diff / norm.clamp(min=torch.finfo(torch.float64).tiny), diff)

    outs: dict[str, dict[str, torch.Tensor]] = {}  # each mode's per-position outputs (its row is emitted)
    tok_sq = None
    head_err = float("nan")
    if "exact" in modes:  # one pass over all V candidates serves exact, topk, mc and Σ_t s_t²
        p, active, drawn = response_policy(eng, ids, pl, rl)
        also = {"tok": torch.zeros_like(p).scatter_(-1, drawn[..., None], 1.0)}
        if "topk" in modes:
            also["topk"], covered = candidate_weights(p, active, "topk", k=tb.topk)
        if "mc" in modes:
            ka, kb = mc_split(tb.mc_samples)
            seed = tb.seed * 1_000_003 + 2 * b
            also["mc_a"] = candidate_weights(p, active, "mc", ka, seed)[0]
            if kb:
                also["mc_b"] = candidate_weights(p, active, "mc", kb, seed + 1)[0]
        outs["exact"] = run("exact", also=also)
        if head is not None and eng.head_entry is not None:
            e = eng.head_entry
            closed = outs["exact"]["fisher_sum"][e.offset : e.offset + e.numel]
            head_err = lm_head_check(model, head, ids, attn, pl, rl, closed, e.shape)
        for name, out in outs["exact"].pop("also").items():
            if name == "tok":
                tok_sq = out.pop("fisher_sum")
            else:
                emit(name, out.pop("fisher_sum").cpu().numpy())
                outs[name] = {**outs["exact"], **out, **({"covered_mass": covered} if name == "topk" else {})}
        emit("exact", outs["exact"].pop("fisher_sum").cpu().numpy())
    for mode in modes:
        if mode in HALVED and f"{mode}_a" not in outs:
            ka, kb = mc_split(draws(tb, mode))
            base_seed = tb.seed * 1_000_003 + 2 * b + SEED_OFFSET[mode]
            outs[f"{mode}_a"] = run(mode, k=ka, seed=base_seed)
            emit(f"{mode}_a", outs[f"{mode}_a"].pop("fisher_sum").cpu().numpy())
            if kb:
                outs[f"{mode}_b"] = run(mode, k=kb, seed=base_seed + 1)
                emit(f"{mode}_b", outs[f"{mode}_b"].pop("fisher_sum").cpu().numpy())
        elif mode not in HALVED and mode not in outs:
            outs[mode] = run(mode, k=draws(tb, mode))
            emit(mode, outs[mode].pop("fisher_sum").cpu().numpy())
    if tok_sq is None:  # no exact pass: the token scores' squares, T rows
        tok_sq = token_score_squares(eng, ids, pl, rl, tb.row_bytes)
    emit("tok_sq", tok_sq.cpu().numpy())
    del tok_sq

    first = next(iter(outs.values()))
    positions = {
        "entropy": first["entropy"],
        "p_drawn": first["p_drawn"],
        "covered_mass": outs["topk"]["covered_mass"] if "topk" in outs else first["covered_mass"],
    }
    for mode in modes:
        if mode == "probe_seq":
            continue
        if mode in HALVED:
            ka, kb = mc_split(draws(tb, mode))
            trace_b = kb * outs[f"{mode}_b"]["trace"] if kb else 0
            positions[f"trace_{mode}"] = (ka * outs[f"{mode}_a"]["trace"] + trace_b) / (ka + kb)
        else:
            positions[f"trace_{mode}"] = outs[mode]["trace"]
    return {k: v.cpu().numpy() for k, v in positions.items()}, relerr.cpu().numpy(), head_err


class _Norms:
    """Squared Euclidean norms summed over column chunks: ``add(name, v)`` adds ‖v‖², ``rel(num, den)`` is
    √(num / den) (NaN when den is 0), the chunked form of :func:`rel_l2`."""

    def __init__(self) -> None:
        self.sq: dict[str, float] = {}

    def add(self, name: str, v: np.ndarray) -> None:
        v = np.ravel(v).astype(np.float64, copy=False)
        self.sq[name] = self.sq.get(name, 0.0) + dot64(v, v)

    def rel(self, num: str, den: str) -> float:
        return math.sqrt(self.sq[num] / self.sq[den]) if self.sq[den] > 0 else float("nan")


def summarize(
    g: Any, response: np.ndarray, modes: list[str], draws_per_mode: dict[str, int]
) -> tuple[dict[str, Any], list[dict]]:
    """Write the (param,) Fisher arrays ``fisher_{mode}`` and ``fisher_seq`` of ``g`` (created beforehand)
    and return the scalars and the three-N error table, from the batch rows of ``g``.

    ``response``: (N, T) bool, True at response positions; ``draws_per_mode``: k of each halved mode.
    Everything over the parameter axis runs in column chunks (a few hundred MB whatever P), and Spearman's
    ρ reads the written arrays back in blocks (:func:`covgrad.topk.spearman_blocked`).
    """
    N = response.shape[0]
    counts = g["batch_count"][:].astype(np.int64)
    cum_n = np.cumsum(counts)
    at = {}  # the batch whose cumulative count is nearest each target sample count, and that count
    for target in (N / 4, N / 2, N):
        i = int(np.argmin(np.abs(cum_n - target)))
        at[target] = (i, int(cum_n[i]))
    norms = _Norms()
    P = g["fisher_seq"].shape[0]
    step = param_chunk(P) * max(1, (1 << 22) // param_chunk(P))
    for lo in range(0, P, step):
        cols = slice(lo, min(lo + step, P))
        cums = {name: np.cumsum(g[f"rows_{name}"][:, cols], axis=0) for name in row_names(modes)}
        for m in modes:
            if m in HALVED:
                ka, kb = mc_split(draws_per_mode[m])
                cums[m] = (ka * cums[f"{m}_a"] + kb * cums[f"{m}_b"]) / (ka + kb)
                if kb:
                    norms.add(f"gap_{m}", (cums[f"{m}_a"][-1] - cums[f"{m}_b"][-1]) / N)
        for target, (i, n) in at.items():
            F_seq = cums["seq_sq"][i] / n
            norms.add(f"seq@{target}", F_seq)
            for mode in modes:
                norms.add(f"{mode}-seq@{target}", cums[mode][i] / n - F_seq)
        fisher = {f"fisher_{mode}": cums[mode][-1] / N for mode in modes}
        fisher["fisher_seq"] = cums["seq_sq"][-1] / N
        for name, values in fisher.items():
            g[name][cols] = values
            norms.add(name, values)
        norms.add("tok-seq", cums["tok_sq"][-1] / N - fisher["fisher_seq"])
        for mode in modes:
            norms.add(f"{mode}-seq", fisher[f"fisher_{mode}"] - fisher["fisher_seq"])
        if "topk" in modes and "mc" in modes:
            norms.add("mc-topk", fisher["fisher_mc"] - fisher["fisher_topk"])
        if "exact" in modes:
            for m in modes[1:]:
                norms.add(f"{m}-exact", fisher[f"fisher_{m}"] - fisher["fisher_exact"])
    table = [
        {"mode": mode, "n": n, "relerr_vs_seq": norms.rel(f"{mode}-seq@{target}", f"seq@{target}")}
        for target, (_, n) in at.items()
        for mode in modes
    ]
    scalars: dict[str, Any] = {
        "N": N,
        "main_mode": modes[0],
        "cross_term_ratio": norms.rel("tok-seq", "fisher_seq"),
        "score_sum_relerr_max": float(np.max(g["score_sum_relerr"][:])),
        "covered_mass_topk_mean": float(g["covered_mass"][:][response].mean()) if "topk" in modes else None,
        "entropy_mean": float(g["entropy"][:][response].mean()),
    }
    for mode in modes:
        scalars[f"relerr_{mode}_vs_seq"] = norms.rel(f"{mode}-seq", "fisher_seq")
        fisher = as_values(g[f"fisher_{mode}"])
        scalars[f"spearman_{mode}_vs_seq"] = spearman_blocked(fisher, as_values(g["fisher_seq"]))
    for r in table:
        scalars[f"relerr_{r['mode']}_vs_seq_n{r['n']}"] = r["relerr_vs_seq"]
    for m in modes:
        if m not in HALVED:
            continue
        scalars[f"{m}_samples"] = draws_per_mode[m]
        ka, kb = mc_split(draws_per_mode[m])
        if kb:
            # the halves differ by (mean_a − mean_b), whose variance is (1/ka + 1/kb)·σ²; the full estimate's
            # variance is σ²/(ka + kb), so its expected error is the gap times √(ka·kb)/(ka + kb)
            scalars[f"{m}_expected_relerr"] = norms.rel(f"gap_{m}", f"fisher_{m}") * math.sqrt(ka * kb) / (ka + kb)
        else:
            scalars[f"{m}_expected_relerr"] = float("nan")
    if "topk" in modes and "mc" in modes:
        scalars["mc_vs_topk"] = norms.rel("mc-topk", "fisher_topk")
    if "exact" in modes:
        for m in modes[1:]:
            scalars[f"{m}_vs_exact"] = norms.rel(f"{m}-exact", "fisher_exact")
    head = g["lm_head_relerr"][:]
    scalars["lm_head_closed_form_relerr_max"] = float(np.max(head)) if np.isfinite(head).all() else None
    return scalars, table


def trace_entropy(g: Any, modes: list[str]) -> dict[str, Any]:
    """The mode whose per-position trace the report plots (the main mode, else exact, else the first
    with a trace) as ``trace_mode``, and ``spearman_trace_entropy``: Spearman's ρ between that trace and
    the policy's entropy over the drawn positions (p_drawn > 0), when some trace there is positive and
    at least two positions are drawn."""
    traced = [m for m in [modes[0], "exact", *modes] if f"trace_{m}" in g]
    if not traced or "entropy" not in g:
        return {}
    mode = traced[0]
    trace, entropy = g[f"trace_{mode}"][:], g["entropy"][:]
    valid = g["p_drawn"][:] > 0 if "p_drawn" in g else trace > 0
    out: dict[str, Any] = {"trace_mode": mode}
    if np.any(trace[valid] > 0) and int(valid.sum()) >= 2:
        out["spearman_trace_entropy"] = spearman(entropy[valid], trace[valid])
    return out


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: TokensSpec, up: dict[str, ArtifactRef]) -> dict[str, Any]:
    tb = spec.settings
    ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
    model, _ = load_models(store, up["base_model"], "policy", spec.policy)
    device = pick_device(spec.device)
    model.to(device).eval()
    V = model.get_output_embeddings().weight.shape[0]
    T = ro["sampler_logp"].shape[1]
    modes = resolve_modes(tb.modes, T, V, tb.exact_budget)
    if "topk" in modes and tb.topk > V:
        raise ValueError(f"tokens.topk = {tb.topk} exceeds the vocabulary size V = {V}; set tokens.topk <= {V}")
    layout = select_parameters(model, spec.params)
    head = lm_head_entry(model, layout)
    N = min(tb.max_samples, ro["tokens"].shape[0])
    batches = batch_bounds(N)
    g = store.open_group(ref, STORE, mode="a")
    _create_arrays(g, N, T, layout.P, len(batches), batches[0][1], modes)
    create_progress(g, STORE, len(batches))
    psg = PerSampleGrads(model, layout, check=spec.self_check)
    todo = pending_batches(g)
    with progress_bar("tokens", len(batches)) as bar:
        bar.update(len(batches) - len(todo))
        for b in todo:
            lo, hi = batches[b]

            def emit(name: str, row: np.ndarray, b: int = b) -> None:
                g[f"rows_{name}"][b] = row

            positions, relerr, head_err = _batch(model, layout, psg, tb, ro, lo, hi, b, modes, head, device, emit)
            for name, value in positions.items():
                g[name][lo:hi, : value.shape[1]] = value
            g["score_sum_relerr"][lo:hi] = relerr
            g["batch_count"][b] = hi - lo
            g["lm_head_relerr"][b] = head_err
            mark_batch_done(g, b)
            release_free_memory()
            bar.update(1)
    del model, psg  # the summary reads the stored rows in chunks; only it runs from here on
    if "scalars" not in g.attrs:  # set last by the summary: a rerun after it only drops the rows
        response = np.arange(T)[None, :] < ro["response_len"][:N][:, None]  # (N, T)
        for name in [*(f"fisher_{mode}" for mode in modes), "fisher_seq"]:
            create(g, STORE, name, (layout.P,), overwrite=True)
        scalars, table = summarize(g, response, modes, {m: draws(tb, m) for m in modes})
        scalars |= trace_entropy(g, modes)
        g.attrs.update(
            {
                "scalars": scalars,
                "errors_vs_seq": table,
                "tensors": layout.to_records(),
                "sampler": spec.sampler,
                "on_policy": spec.on_policy,
                "modes": modes,
                "main_mode": modes[0],
                "exact_budget": tb.exact_budget,
                "lm_head": head,
                "V": V,
            }
        )
    for name in row_names(modes):  # resume state: the summary holds all that is kept of them
        if f"rows_{name}" in g:
            del g[f"rows_{name}"]
    annotate(g, STORE, layout)
    store.consolidate(ref, STORE)
    return {"scalars": g.attrs["scalars"]}


@task(name="tokens")
def tokens_task(ref: ArtifactRef, spec: TokensSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Token-level Fisher (exact / top-k / Monte Carlo / probes) of the analysed rollouts."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
