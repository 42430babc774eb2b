"""Token-Fisher study: how the sequence Fisher splits over response positions, in several estimators.

Over the first N samples of the analysed rollouts, in batches of at most :data:`BATCH_ROWS` rows (and at
most a quarter of them, so the error can be read at three sample counts, :func:`batch_bounds`),
:class:`TokenStudy` computes the token Fisher Σ_t f_t of every sample with each mode (the estimators
of :mod:`covgrad.tokens.fisher`; :func:`resolve_modes` picks them when unset). The random modes
(:data:`HALVED`: ``mc``, ``probe``, ``probe_seq``) run as two independent halves (:func:`mc_split`), so
that their disagreement estimates their own error. On the same samples it computes the sequence scores
s_n and the token scores s_{n,t}, checks Σ_t s_{n,t} = s_n, and keeps Σ_n s_n² and Σ_n Σ_t s_{n,t}² for
the sequence Fisher F = mean(s²) and the cross-term measure ‖mean(s² − Σ_t s_t²)‖ / ‖mean(s²)‖. All
scores are centered under the policy p. Every batch runs one forward for all of it
(:class:`~covgrad.tokens.backward.TokenBackward`); the sequence scores come from
:class:`~covgrad.scores.engine.PerSampleGrads` (self-checked against autograd), so the sum check also checks
the batched-cotangent path against it.

Each batch hands out (param,) float64 batch sums, one per name of :func:`row_names`, as soon as each is
computed; :func:`summarize` turns the stored sums of all batches into the (param,) Fisher estimates,
the errors against F at three sample counts, Spearman's ρ, the agreement of the modes and the expected
error of each halved mode, all over the parameter axis in column blocks. The errors against F get a 95%
interval from a delete-one-batch jackknife (:func:`relerr_jackknife`): the batches' sums are
independent blocks of samples, and the (batch × batch) Gram matrices of their sums, accumulated over
the column blocks, give the error with any batch left out without a second pass over P.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from covgrad.config import TokensSection
from covgrad.distributed.fsdp import RankColumns, ShardedPerSampleGrads, shard_from_rank0
from covgrad.layout import ParamLayout, select_parameters
from covgrad.moments.numerics import dot64
from covgrad.moments.quantiles import t975
from covgrad.moments.topk import as_values, spearman, spearman_blocked
from covgrad.rollouts.batch import RolloutBatch
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.tokens.backward import TokenBackward
from covgrad.tokens.fisher import (
    candidate_weights,
    check_exact_budget,
    default_mode,
    response_policy,
    token_fisher,
    token_score_squares,
)

BATCH_ROWS = 16  # most samples per batch: the per-sample gradients are BATCH_ROWS x P float32
HALVED = ("mc", "probe", "probe_seq")  # random modes, run as two independent halves
POSITION_ARRAYS = ("entropy", "p_drawn", "covered_mass")  # per-position outputs besides the traces
SEED_OFFSET = {"mc": 0, "probe": 1 << 40, "probe_seq": 2 << 40}  # independent draws for each random mode

Emit = Callable[[str, np.ndarray], None]  # (row name, (P,) float64 batch sum) -> None


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
    """Names of the (param,) batch sums: each mode (halves ``_a``/``_b`` for random modes), seq_sq, tok_sq."""
    names = [n for m in modes for n in ((f"{m}_a", f"{m}_b") if m in HALVED else (m,))]
    return [*names, "seq_sq", "tok_sq"]


def trace_names(modes: list[str]) -> list[str]:
    """Names of the (sample, position) traces: ``trace_{mode}`` of every mode with a per-position estimate."""
    return [f"trace_{m}" for m in modes if m != "probe_seq"]


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


def square_sum(x: torch.Tensor, block: int = 1 << 20) -> torch.Tensor:
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
    layout: ParamLayout | None = None,
) -> float:
    """Relative L2 error of the LM head's closed-form exact token Fisher against the backward's.

    ``closed``: the exact mode's Σ f restricted to the head weight ``head`` (float64, ``shape`` elements).
    The reference runs mode exact on a layout of the head alone (``layout``; None: selected now, which a
    sharded model's frozen parameters do not allow) with the closed form disabled, so its backward stops at
    the head's output (cheap).
    """
    layout = layout or select_parameters(model, [head])
    ref = token_fisher(model, layout, ids, attn, pl, rl, "exact", exact_budget=2**62, closed_form_head=False)
    return rel_l2(closed.reshape(shape).cpu().numpy(), ref["fisher_sum"].reshape(shape).cpu().numpy())


def output_rows(model: nn.Module) -> int:
    """V, the rows of ``model``'s output embedding (from its shape: a model on the meta device will do)."""
    return int(model.get_output_embeddings().weight.shape[0])


def study_setup(
    model: nn.Module, settings: TokensSection, T: int, params: list[str] | None
) -> tuple[list[str], ParamLayout, str | None]:
    """The modes, the layout of ``params`` and the checked LM head of a study (see :meth:`TokenStudy.build`), from
    the model's modules and shapes (a model on the meta device will do)."""
    V = output_rows(model)
    modes = resolve_modes(settings.modes, T, V, settings.exact_budget)
    if "topk" in modes and settings.topk > V:
        raise ValueError(f"tokens.topk = {settings.topk} exceeds the vocabulary size V = {V}; set tokens.topk <= {V}")
    layout = select_parameters(model, params)
    return modes, layout, lm_head_entry(model, layout)


@dataclass(frozen=True)
class BatchResult:
    """The per-sample outputs of one batch of B rows (its (param,) sums went to ``emit``)."""

    positions: dict[str, np.ndarray]  # POSITION_ARRAYS and trace_names(modes) -> (B, T_b) float64
    score_sum_relerr: np.ndarray  # (B,) float64: ‖Σ_t s_t − s‖ / ‖s‖ per sample
    lm_head_relerr: float  # LM head closed form against the backward (NaN when not checked)


@dataclass
class TokenStudy:
    """The study's model and settings: :meth:`batch` computes one batch of rollouts."""

    model: nn.Module  # causal LM in eval mode, on the batches' device
    layout: ParamLayout  # the selected parameters (the P axis)
    psg: PerSampleGrads  # sequence scores of ``layout``
    settings: TokensSection
    modes: list[str]  # main mode first (resolve_modes)
    head: str | None  # untied LM head checked against its closed form (lm_head_entry), or None

    columns: RankColumns | None = None  # this rank's columns of a sharded model (build_sharded), None: all
    head_layout: ParamLayout | None = None  # the head alone, selected before sharding (build_sharded)

    @classmethod
    def build(
        cls, model: nn.Module, settings: TokensSection, T: int, params: list[str] | None = None, check: bool = True
    ) -> TokenStudy:
        """The study of ``model`` (in eval mode, on its device) over rollouts of T response positions:
        modes resolved, parameters ``params`` selected (None: all), sequence scores self-checked when
        ``check``. ValueError when ``settings.topk`` exceeds the vocabulary or exact its budget."""
        modes, layout, head = study_setup(model, settings, T, params)
        return cls(model, layout, PerSampleGrads(model, layout, check=check), settings, modes, head)

    @classmethod
    def build_sharded(
        cls,
        model: nn.Module,
        settings: TokensSection,
        T: int,
        example: dict[str, torch.Tensor | None],
        params: list[str] | None = None,
        check: bool = True,
    ) -> TokenStudy:
        """This rank's study (in an initialised process group) of ``model``, not yet sharded: as :meth:`build`,
        then the first call's trace on the batch ``example`` and the model sharded over the group with rank 0's
        weights (:func:`covgrad.distributed.fsdp.shard_from_rank0`: the other ranks may hold it on the meta device),
        and the
        rank's columns (:class:`RankColumns`):
        every (param,) sum it hands out is the rank's (P_r,) columns of the in-process sum, bit for bit; the
        per-position outputs are every rank's alike."""
        modes, layout, head = study_setup(model, settings, T, params)
        head_layout = select_parameters(model, [head]) if head is not None else None
        trace, modules = shard_from_rank0(model, layout, example)
        columns = RankColumns.of(layout, dist.get_world_size(), dist.get_rank())
        psg = ShardedPerSampleGrads(model, layout, trace, modules, check=check)
        return cls(model, layout, psg, settings, modes, head, columns, head_layout)

    @property
    def V(self) -> int:
        """Vocabulary size (rows of the output embedding)."""
        return output_rows(self.model)

    def draws(self) -> dict[str, int]:
        """Candidates or probes of each mode (:func:`draws`)."""
        return {m: draws(self.settings, m) for m in self.modes}

    def batch(self, batch: RolloutBatch, b: int, emit: Emit) -> BatchResult:
        """Batch number ``b`` (it seeds the random modes) of rollouts ``batch`` (on the model's device), one
        forward: each (P,) float64 sum of :func:`row_names` is handed to ``emit(name, row)`` as soon as it
        is computed and then dropped (a row is 8 B × P; the rank's P_r columns with ``columns``); returns the
        per-sample outputs. With ``columns`` every rank of the group calls it on the same batch (collectives)."""
        model, layout, tb, modes, head = self.model, self.layout, self.settings, self.modes, self.head
        ids, attn, target, pos = batch.input_ids, batch.attention_mask, batch.response_mask, batch.position_ids
        pl, rl = batch.prompt_len, batch.response_len
        eng = TokenBackward(model, layout, ids, attn, pos, columns=self.columns)

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
        seq = self.psg(ids, attn, lambda logits: score_logit_grad(logits, ids, target), position_ids=pos)  # (B, P)
        seq_sq = square_sum(seq)  # (P,): formed whole, elementwise; the rank keeps its columns
        if self.columns is not None:
            seq_sq = seq_sq[torch.from_numpy(self.columns.index()).to(seq_sq.device)]
        emit("seq_sq", seq_sq.cpu().numpy())
        del seq_sq
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
                closed = eng.whole_entry(outs["exact"]["fisher_sum"], e)
                head_err = lm_head_check(model, head, ids, attn, pl, rl, closed, e.shape, self.head_layout)
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
        return BatchResult({k: v.cpu().numpy() for k, v in positions.items()}, relerr.cpu().numpy(), head_err)


@dataclass(frozen=True)
class StudyRecord:
    """What all batches of the study left, as :func:`summarize` reads it (N samples, T positions)."""

    rows: Mapping[str, Any]  # row_names(modes) -> (batch, P) float64 batch sums, read by column slices
    counts: np.ndarray  # (batch,) samples of each batch
    positions: Mapping[str, np.ndarray]  # POSITION_ARRAYS and trace_names(modes) -> (N, T) float64
    score_sum_relerr: np.ndarray  # (N,) float64
    lm_head_relerr: np.ndarray  # (batch,) float64, NaN where not checked
    response_len: np.ndarray  # (N,) response tokens of each sample


def relerr_jackknife(
    gram_diff: np.ndarray, gram_ref: np.ndarray, counts: np.ndarray, estimate: float
) -> tuple[float, float]:
    """95% interval of the relative L2 error θ = ‖Σ_b d_b‖ / ‖Σ_b r_b‖ of a sum over g batches by the
    delete-a-group jackknife (Busing, Meijer and van der Leeden 1999, for unequal batch sizes).

    θ without batch j is √(wᵀ K_d w / wᵀ K_r w), w = 1 − e_j (the 1/n of both means cancels), so only
    the Gram matrices of the batch sums are needed. With m_j samples in batch j, N in all and
    h_j = N / m_j, the pseudo-values are h_j·θ − (h_j − 1)·θ_(−j) and the variance is
    (1/g) Σ_j (pseudo_j − θ_J)² / (h_j − 1); the interval is ``estimate`` ± t_{g−1}·√variance,
    the lower end clipped at 0.

    Args:
        gram_diff: (g, g) float64, K_d[b, c] = ⟨d_b, d_c⟩ of the batches' difference sums (estimate − F).
        gram_ref: (g, g) float64, K_r[b, c] = ⟨r_b, r_c⟩ of the batches' reference sums (s²).
        counts: (g,) samples of each batch.
        estimate: the error as reported (the centre of the interval).

    Returns:
        (lo, hi); NaN with fewer than 2 batches or a zero reference without some batch.
    """
    g = len(counts)
    if g < 2 or not math.isfinite(estimate):
        return float("nan"), float("nan")
    m = np.asarray(counts, dtype=np.float64)
    n = m.sum()
    ones = np.ones(g)
    full = math.sqrt(max(ones @ gram_diff @ ones, 0.0) / (ones @ gram_ref @ ones))
    loo = np.empty(g)
    for j in range(g):
        w = ones.copy()
        w[j] = 0.0
        ref = w @ gram_ref @ w
        if not ref > 0:
            return float("nan"), float("nan")
        loo[j] = math.sqrt(max(w @ gram_diff @ w, 0.0) / ref)
    h = n / m
    pseudo = h * full - (h - 1) * loo
    centre = g * full - float(((1 - m / n) * loo).sum())
    var = float((((pseudo - centre) ** 2) / (h - 1)).sum()) / g
    half = t975(g - 1) * math.sqrt(var)
    return max(estimate - half, 0.0), estimate + half


def _differences(gram_cum: np.ndarray) -> np.ndarray:
    """(g, g) Gram matrix of the batch sums from the Gram matrix of their cumulative sums (first
    differences along both axes)."""
    D = np.eye(gram_cum.shape[0]) - np.eye(gram_cum.shape[0], k=-1)
    return D @ gram_cum @ D.T


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


def _column_blocks(
    record: StudyRecord,
    out: Mapping[str, Any],
    modes: list[str],
    draws_per_mode: dict[str, int],
    step: int,
    at: dict[float, tuple[int, int]],
) -> tuple[_Norms, dict[str, np.ndarray]]:
    """The pass of :func:`summarize` over the parameter axis in column blocks of ``step``: writes the (param,)
    Fisher estimates into ``out`` and returns the squared norms summed over the blocks (of the estimates, of
    their differences against F and each other, of the halves' gaps, and against F at each target sample count
    of ``at``: target → (batch index, cumulative count)) and the (g, g) Gram matrices of the batches' cumulative
    sums (``seq``, each mode, and each mode against ``seq`` as ``{mode}_seq``)."""
    N = record.response_len.shape[0]
    norms = _Norms()
    P = out["fisher_seq"].shape[0]
    g = len(record.counts)
    gram_cum = {key: np.zeros((g, g)) for key in ("seq", *(f"{m}{x}" for m in modes for x in ("", "_seq")))}
    for lo in range(0, P, step):
        cols = slice(lo, min(lo + step, P))
        cums = {name: np.cumsum(record.rows[name][:, cols], axis=0) for name in row_names(modes)}
        for m in modes:
            if m in HALVED:
                ka, kb = mc_split(draws_per_mode[m])
                cums[m] = (ka * cums[f"{m}_a"] + kb * cums[f"{m}_b"]) / (ka + kb)
                if kb:
                    norms.add(f"gap_{m}", (cums[f"{m}_a"][-1] - cums[f"{m}_b"][-1]) / N)
        gram_cum["seq"] += cums["seq_sq"] @ cums["seq_sq"].T
        for mode in modes:  # Gram matrices of the cumulative sums, for the jackknife
            gram_cum[mode] += cums[mode] @ cums[mode].T
            gram_cum[f"{mode}_seq"] += cums[mode] @ cums["seq_sq"].T
        for target, (i, n) in at.items():
            F_seq = cums["seq_sq"][i] / n
            norms.add(f"seq@{target}", F_seq)
            for mode in modes:
                norms.add(f"{mode}-seq@{target}", cums[mode][i] / n - F_seq)
        fisher = {f"fisher_{mode}": cums[mode][-1] / N for mode in modes}
        fisher["fisher_seq"] = cums["seq_sq"][-1] / N
        for name, values in fisher.items():
            out[name][cols] = values
            norms.add(name, values)
        norms.add("tok-seq", cums["tok_sq"][-1] / N - fisher["fisher_seq"])
        for mode in modes:
            norms.add(f"{mode}-seq", fisher[f"fisher_{mode}"] - fisher["fisher_seq"])
        if "topk" in modes and "mc" in modes:
            norms.add("mc-topk", fisher["fisher_mc"] - fisher["fisher_topk"])
        if "exact" in modes:
            for m in modes[1:]:
                norms.add(f"{m}-exact", fisher[f"fisher_{m}"] - fisher["fisher_exact"])
    return norms, gram_cum


def summarize(
    record: StudyRecord, out: Mapping[str, Any], modes: list[str], draws_per_mode: dict[str, int], step: int
) -> tuple[dict[str, Any], list[dict]]:
    """Write the (param,) Fisher estimates into ``out`` and return the scalars and the three-N error table.

    Args:
        record: the batches' sums and per-sample outputs.
        out: ``fisher_{mode}`` for each mode and ``fisher_seq`` -> writable (P,) float64 arrays (numpy, or
            any array written and read by slices); ``fisher_{mode}`` = Σ f / N, ``fisher_seq`` = mean(s²).
        modes: the modes, main mode first; ``draws_per_mode``: k of each mode (:func:`draws`).
        step: columns of the parameter axis read and written at a time; every sum over the parameter
            axis is accumulated in this order, Spearman's ρ reads ``out`` back in blocks.

    Returns:
        The scalars (cross-term ratio, errors against F at three N with the 95% jackknife interval of the
        error at N, ``relerr_{mode}_vs_seq_lo``/``_hi`` (:func:`relerr_jackknife`), Spearman against F, mode agreement,
        expected error of each halved mode, sum check, LM-head check, :func:`trace_entropy`) and the rows
        (mode, n, relerr_vs_seq) of the three-N table.
    """
    N = record.response_len.shape[0]
    response = np.arange(record.positions["entropy"].shape[1])[None, :] < record.response_len[:, None]  # (N, T)
    cum_n = np.cumsum(record.counts.astype(np.int64))
    at = {}  # the batch whose cumulative count is nearest each target sample count, and that count
    for target in (N / 4, N / 2, N):
        i = int(np.argmin(np.abs(cum_n - target)))
        at[target] = (i, int(cum_n[i]))
    norms, gram_cum = _column_blocks(record, out, modes, draws_per_mode, step, at)
    table = [
        {"mode": mode, "n": n, "relerr_vs_seq": norms.rel(f"{mode}-seq@{target}", f"seq@{target}")}
        for target, (_, n) in at.items()
        for mode in modes
    ]
    positions = record.positions
    scalars: dict[str, Any] = {
        "N": N,
        "main_mode": modes[0],
        "cross_term_ratio": norms.rel("tok-seq", "fisher_seq"),
        "score_sum_relerr_max": float(np.max(record.score_sum_relerr)),
        "covered_mass_topk_mean": float(positions["covered_mass"][response].mean()) if "topk" in modes else None,
        "entropy_mean": float(positions["entropy"][response].mean()),
    }
    gram_ref = _differences(gram_cum["seq"])
    for mode in modes:
        scalars[f"relerr_{mode}_vs_seq"] = norms.rel(f"{mode}-seq", "fisher_seq")
        cross = gram_cum[f"{mode}_seq"]
        gram_diff = _differences(gram_cum[mode] - cross - cross.T + gram_cum["seq"])
        lo, hi = relerr_jackknife(gram_diff, gram_ref, record.counts, scalars[f"relerr_{mode}_vs_seq"])
        scalars[f"relerr_{mode}_vs_seq_lo"], scalars[f"relerr_{mode}_vs_seq_hi"] = lo, hi
        fisher = as_values(out[f"fisher_{mode}"])
        scalars[f"spearman_{mode}_vs_seq"] = spearman_blocked(fisher, as_values(out["fisher_seq"]))
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
    head = record.lm_head_relerr
    scalars["lm_head_closed_form_relerr_max"] = float(np.max(head)) if np.isfinite(head).all() else None
    return scalars | trace_entropy(positions, modes), table


def trace_entropy(positions: Mapping[str, np.ndarray], modes: list[str]) -> dict[str, Any]:
    """The mode whose per-position trace the report plots (the main mode, else exact, else the first
    with a trace) as ``trace_mode``, and ``spearman_trace_entropy``: Spearman's ρ between that trace and
    the policy's entropy over the drawn positions (p_drawn > 0), when some trace there is positive and
    at least two positions are drawn. ``positions``: (N, T) arrays as in :class:`StudyRecord`."""
    traced = [m for m in [modes[0], "exact", *modes] if f"trace_{m}" in positions]
    if not traced:
        return {}
    mode = traced[0]
    trace, entropy = positions[f"trace_{mode}"], positions["entropy"]
    valid = positions["p_drawn"] > 0
    out: dict[str, Any] = {"trace_mode": mode}
    if np.any(trace[valid] > 0) and int(valid.sum()) >= 2:
        out["spearman_trace_entropy"] = spearman(entropy[valid], trace[valid])
    return out
