"""The regime stores: a regime fold's bound scalars beside its scores-layout state, and the regimes store.

A regime fold (``regime/<key>/scores.zarr``) is a :class:`storage.stores.scores.ScoresStore` of the regime's g_n
(``mean_s`` = mean g per row, ``advantage`` = 0) plus ``bound_sum, bound_count (batch, half)``: each batch's
Σ of the bound scalar c²_n and its samples, per prompt-group parity, written before the batch's
checkpoint (a resumed run rewrites the batches it refolds with the same numbers). The regimes store
(``regimes/<key>/regimes.zarr``) holds per regime the (param,) arrays of ``storage.schema.REGIMES_VARS``.
The preflight's regime checks live here too; they import neither torch nor transformers (storage.schema
imports torch, so the functions that write arrays import it when they run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from covgrad.regimes import GroupRows

BOUND = ("bound_sum", "bound_count")
IMPORTED = {"advantages": "token_advantage", "teacher_logprobs": "teacher_logprob"}  # rollouts arrays


def create_bound_arrays(g: Any, n_batches: int) -> None:
    """Create ``bound_sum`` and ``bound_count`` (n_batches, 2) in the fold's scores group ``g`` (idempotent)."""
    from storage.schema import SCORES, create

    for name in BOUND:
        create(g, SCORES, name, (n_batches, 2))


def write_bound(g: Any, b: int, sums: np.ndarray, counts: np.ndarray) -> None:
    """Batch ``b``'s (2,) bound sums and sample counts per half."""
    g["bound_sum"][b] = sums
    g["bound_count"][b] = counts


HEAD_FISHER = "head_token_fisher"


def write_head_fisher(g: Any, entry: Any, sums: np.ndarray, counts: np.ndarray) -> None:
    """The LM head's token-Fisher sums (2, numel) per half (``covgrad.regimes.fold.head_token_fisher``) of a
    full-distribution regime's fold, with attrs naming the tensor, its place on the param axis and the
    samples per half."""
    from storage.schema import SCORES, create

    create(g, SCORES, HEAD_FISHER, sums.shape, overwrite=True)[:] = sums
    g.attrs[HEAD_FISHER] = {
        "tensor": entry.name,
        "offset": int(entry.offset),
        "numel": int(entry.numel),
        "count": [float(c) for c in counts],
    }


def head_fisher_sums(g: Any, cols: slice) -> tuple[slice, np.ndarray, np.ndarray] | None:
    """Where the fold ``g``'s head token-Fisher sums meet the param columns ``cols``: (the slice of ``cols``'
    block they cover, the sums there per half (2, b), the samples per half (2,) float64); None when the fold has
    none or they miss ``cols`` (their means: ``covgrad.regimes.stats.regime_stats``)."""
    info = g.attrs.get(HEAD_FISHER)
    if info is None:
        return None
    lo, hi = max(cols.start, info["offset"]), min(cols.stop, info["offset"] + info["numel"])
    if lo >= hi:
        return None
    sums = g[HEAD_FISHER][:, lo - info["offset"] : hi - info["offset"]]
    return slice(lo - cols.start, hi - cols.start), sums, np.asarray(info["count"], dtype=np.float64)


def bound_a2(g: Any) -> tuple[float, list[float]]:
    """a² = Σ c²_n / #samples over every batch and per half (NaN where no sample has a bound scalar)."""
    s, n = g["bound_sum"][:].sum(0), g["bound_count"][:].sum(0)  # (2,)
    per_half = [float(s[h] / n[h]) if n[h] > 0 else float("nan") for h in (0, 1)]
    return (float(s.sum() / n.sum()) if n.sum() > 0 else float("nan")), per_half


def state_rows(g: Any, cols: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The moment-state rows of a scores group over parameters ``cols``: count (R,), mean (R, b) float64
    (hi + lo for float32 state), m2 (R, b) float64 and each row's half (R,) (row 2i + h: half h)."""
    count = g["count"][:]
    mean = g["mean_s"][:, cols].astype(np.float64)
    if "mean_s_lo" in g:
        mean = mean + g["mean_s_lo"][:, cols].astype(np.float64)
    return count, mean, g["m2_s"][:, cols].astype(np.float64), np.arange(len(count)) % 2


def group_rows(g: Any, cols: slice) -> GroupRows:
    """A regime fold's group moment rows over parameters ``cols`` (:class:`covgrad.regimes.stats.GroupRows`), from
    its scores group ``g`` (or the ``rows()`` of a :class:`covgrad.moments.accum.GroupAccumulator`)."""
    from covgrad.regimes import GroupRows

    count, mean, m2, half = state_rows(g, cols)
    c = g["c_as"][:, cols].astype(np.float64) if "c_as" in g else None
    return GroupRows(count, g["mean_a"][:], g["m2_a"][:], mean, m2, c, half)


def regime_gradient(g: Any, cols: slice) -> list[tuple[np.ndarray, np.ndarray, float, float]]:
    """A regime fold's G, its prompt-clustered standard error (b,) float64 (NaN with fewer than 2 groups), its
    number of samples N and of prompt groups C over parameters ``cols``: of all rows, then of each half
    (:func:`covgrad.regimes.stats.regime_halves` of :func:`group_rows`)."""
    from covgrad.regimes import regime_halves

    return regime_halves(group_rows(g, cols))


def create_imported_token_arrays(g: Any, data: dict[str, np.ndarray], rows: int) -> None:
    """Create the imported per-token arrays that ``data`` (records_to_rollouts' output) holds, in the
    rollouts group ``g`` (their rows are written with the others)."""
    from storage.schema import ROLLOUTS, create

    for name in IMPORTED.values():
        if name in data:
            create(g, ROLLOUTS, name, data[name].shape, rows=rows)


def _vocab_size(path: str) -> int | None:
    """``vocab_size`` of a model directory's config.json (None when it does not say)."""
    import json
    from pathlib import Path

    v = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    return int(v) if isinstance(v, int) else None


def check_teacher_prompts(cfg: Any, name: str, r: Any) -> None:
    """A context-distillation regime's teacher prompts, one-line errors: the template fills from every task
    record (``file:line`` of the first that lacks a field), and every teacher prompt with the sampler's
    ``max_new_tokens`` fits the teacher's context (counted with its ``tokenizer.json`` when it has one)."""
    from covgrad.rollouts import Problem, check_context
    from storage.stores.prompts import prompt_lengths, prompt_places

    what = f"regimes.{name}.teacher_prompt"
    texts = teacher_prompt_texts(r.teacher_prompt, cfg.task, what)
    section = f"rollouts.samplers.{r.sampler or cfg.rollouts.analyse}"
    sampler = cfg.rollouts.samplers[r.sampler or cfg.rollouts.analyse]
    model = cfg.model.path if r.teacher in ("policy", "stale", "trained") else r.teacher
    counted = prompt_lengths(model, [Problem(t, "") for t in texts], cfg.model.max_length)
    if counted is not None and counted[1] is not None:  # an untold context: the stage checks with the loaded model
        lengths, limit = counted
        try:
            check_context(lengths, prompt_places(cfg.task, len(texts)), sampler.max_new_tokens, limit, section)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None


def check_regime_inputs(cfg: Any) -> None:
    """The preflight's regime checks of a ``PipelineConfig``, one-line errors: every teacher and reference
    directory is a causal LM with the policy's vocabulary size, every teacher prompt fills from the task and
    fits the teacher's context (:func:`check_teacher_prompts`), and every imported per-token field a regime
    reads is in every record of its sampler's file with one entry per response token (``file:line``)."""
    from covgrad.rollouts.formats import check_imported_field
    from storage.models import check_model_dir
    from storage.readers import read_located_records

    if cfg.model.path is not None:
        policy_vocab = _vocab_size(cfg.model.path)
    else:
        from covgrad.rollouts import char_tokenizer

        policy_vocab = char_tokenizer().get_vocab_size()
    for name, r in cfg.regimes.items():
        for role in ("teacher", "reference"):
            path = getattr(r, role)
            if path is None or path in ("policy", "stale", "trained"):
                continue
            check_model_dir(path, f"regimes.{name}.{role}")
            v = _vocab_size(path)
            if policy_vocab is not None and v is not None and v != policy_vocab:
                raise ValueError(
                    f"regimes.{name}.{role} {path!r} has vocabulary {v}, the policy {policy_vocab}: "
                    "a teacher or reference must share the policy's vocabulary"
                )
        if r.teacher_prompt is not None:
            check_teacher_prompts(cfg, name, r)
        fields = [
            f for f, on in (("advantages", r.advantages == "imported"), ("teacher_logprobs", r.teacher_logprobs)) if on
        ]
        if not fields:
            continue
        sampler = r.sampler or cfg.rollouts.analyse
        source = cfg.rollouts.samplers[sampler].import_path
        if source is None:
            raise ValueError(
                f"regimes.{name}: imported {fields[0]} need a sampler with import_path; {sampler!r} has none"
            )
        fmt = cfg.rollouts.samplers[sampler].format
        for at, rec in read_located_records(source):
            for field in fields:
                try:
                    check_imported_field(fmt, rec, at, field)
                except ValueError as err:
                    raise ValueError(f"regimes.{name}: {err}") from None


def task_records(t: Any) -> list[dict[str, Any]]:
    """The records of task section ``t`` whose fields a teacher-prompt template reads: ``prompt`` and ``answer``
    of the built-in task, every field of a JSONL task's lines (the first ``n_prompts``)."""
    from storage.readers import read_prompt_file
    from storage.stores.prompts import load_problems

    if t.kind == "jsonl":
        return read_prompt_file(t.path)[: t.n_prompts]
    return [{"prompt": p.prompt, "answer": p.answer} for p in load_problems(t)]


def teacher_prompt_texts(template: str, t: Any, what: str) -> list[str]:
    """The teacher prompt of every prompt of task ``t``: ``template`` filled from its record
    (:func:`covgrad.config.fill_template`); ValueError naming ``what`` and the record's ``file:line`` when a
    record lacks a field the template names."""
    from covgrad.config import fill_template
    from storage.stores.prompts import prompt_places

    records = task_records(t)
    where = prompt_places(t, len(records))
    out = []
    for rec, at in zip(records, where, strict=True):
        try:
            out.append(fill_template(template, rec))
        except ValueError as err:
            raise ValueError(f"{what}: {at}: {err}") from None
    return out
