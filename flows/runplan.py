"""``covgrad plan`` for the whole run: every stage's disk and peak memory, from the stores' schemas and the
stages' memory models, before anything runs.

The scores stage's per-job memory comes from ``covgrad.distributed.shardplan`` (``flows.shards.plan_for_config``);
this module turns it into the stage's host peak and adds the other stages with the arithmetic below
(bytes; N samples of a sampler, T = max_new_tokens, L = longest prompt + T, P selected parameters, n all
parameters, V vocabulary, d the policy dtype's bytes, B_t the tokens stage's batch rows, R its batch-sum
rows). Every stage runs in the pipeline's process, so every host peak starts from ``PROCESS_BYTES``, the
resident set of that process before a stage allocates anything (the imports of torch, transformers,
zarr and dask, Prefect's flow engine). Time is not predicted: it depends on the device and is stated as
unknown.

Per stage, disk when complete; peak host memory ("base" = ``PROCESS_BYTES``):

- base_model: n·d (the policy and, for the demo, the stale checkpoint); base + n·(d + 16) (AdamW
  state, the demo's SFT), for a model directory base + n·d (an upper bound: weights mapped from the
  safetensors file stay untouched).
- rollouts: N·(4L + 9T + 40) (+ N·T·V·4 with μ in full, N·T·k·12 with top-k μ); base + n·d +
  16·L·V·(d + 8) (a batch of logits, their gradient and softmax).
- scores: the shard plan's store; base + the largest job's bytes on cpu, base + n·d on cuda (the job's
  bytes are then on the device).
- stats: 7·8·P per stats instance; base + 28·P (F, G and abs G in float64 for the overlap, the top
  sets' work).
- masks: at most 6·q·P (bool (q, P) masks by F, abs G, abs rho in two scopes; compressed on disk);
  base + 10.9·P.
- tokens: 8·P per estimator + 8·P (F) + per-position rows, R·batches·8·P while it runs; base + n·d +
  B_t·4·P (the sequence scores) + 2·8·P (two (P,) float64 sums) + B_t·L·V·(d + 8).
- update_check: per-cell rows only; base + n·(d + 4 + 4 + 8 + 2) (the loaded policy, a cell's fp32
  weights, gradient, Adam moments and bf16 start) + 2·8·P (a statistic and its partition index).
- report: PNGs and tables, about 1 MB; base + 4·P (a statistic read for the plots) + 2·4·P·B
  bootstrap replicates (B·P ≤ 5e7, only with per-sample rows) + the N × N Gram matrices.

The coefficients 28 (stats) and 10.9 (masks) bytes per parameter are measured (the SmolLM2-135M run in
docs/memory.md), the rest is arithmetic on the stores' and the stages' arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from covgrad.report.uncertainty import REPLICATE_BUDGET

PROCESS_BYTES = int(0.65 * 2**30)  # the pipeline process before a stage allocates (offpolicy's peak: 0.67 GiB)
STATS_BYTES_PER_PARAM = 28.0  # (4.27 − 0.65) GiB over P = 134.5M, docs/memory.md
MASKS_BYTES_PER_PARAM = 10.9  # (2.01 − 0.65) GiB over P = 134.5M, docs/memory.md
TOKENS_BATCH_ROWS = 16  # covgrad.tokens.study.BATCH_ROWS


@dataclass(frozen=True)
class RunShape:
    """The sizes the whole-run plan needs (counts; bytes per element in ``dtype_bytes``)."""

    P: int  # selected parameter elements
    n_params: int  # every parameter element of the policy
    dtype_bytes: int
    vocab: int
    samples: dict[str, int]  # N per sampler
    T: dict[str, int]  # max_new_tokens per sampler
    mu: dict[str, tuple[str, int]]  # (store_mu, mu_topk) per sampler
    L: int  # longest prompt + largest T, tokens
    stats_instances: int
    n_qs: int
    tokens: bool
    update_check: bool
    demo: bool
    tokens_samples: int = 0  # samples of the token study (min(tokens.max_samples, N))
    tokens_modes: int = 1  # its estimators
    tokens_rows: int = 4  # its batch-sum rows per batch (covgrad.tokens.study.row_names)


@dataclass(frozen=True)
class ScoresShape:
    """What the whole-run plan takes from the scores stage's shard plan
    (``covgrad.distributed.shardplan.ShardPlan``)."""

    job_bytes: int  # the largest job's bytes on its device (ShardPlan.need)
    store_bytes: int  # one finished scores artifact
    artifacts: int  # scores artifacts of the run
    device: str  # "cpu" | "cuda"
    rows: bool  # the per-sample rows are kept (the report's bootstrap runs over them)


def tokens_batches(samples: int) -> tuple[int, int]:
    """(rows per batch, batches) of the token study over ``samples`` samples, as
    ``covgrad.tokens.study.batch_bounds`` splits them."""
    if samples <= 0:
        return 0, 0
    rows = max(1, min(TOKENS_BATCH_ROWS, math.ceil(samples / 4)))
    return rows, math.ceil(samples / rows)


def stage_sizes(s: RunShape, scores: ScoresShape | None = None) -> list[dict[str, object]]:
    """One row per stage, in run order: ``stage``, ``disk`` (bytes when complete), ``peak`` (host bytes)
    and ``note``, by the module's table; the scores row only with ``scores``."""
    d, base = s.dtype_bytes, PROCESS_BYTES
    rollouts = 0
    for name, n in s.samples.items():
        T = s.T[name]
        rollouts += n * (4 * s.L + 9 * T + 40)
        kind, k = s.mu[name]
        rollouts += n * T * s.vocab * 4 if kind == "full" else n * T * k * 12 if kind == "topk" else 0
    logits = 16 * s.L * s.vocab * (d + 8)  # a 16-sample batch of logits, their gradient and softmax
    boot = min(REPLICATE_BUDGET, 200 * s.P)
    N = max(s.samples.values(), default=0)
    sft = s.n_params * (d + 16) if s.demo else s.n_params * d
    rows: list[dict[str, object]] = [
        {"stage": "base_model", "disk": s.n_params * d * (2 if s.demo else 0), "peak": base + sft, "note": ""},
        {"stage": "rollouts", "disk": rollouts, "peak": base + s.n_params * d + logits, "note": ""},
    ]
    if scores is not None:
        on_host = scores.job_bytes if scores.device == "cpu" else s.n_params * d
        note = "" if scores.device == "cpu" else f"device: {human(scores.job_bytes)} per job"
        rows.append(
            {"stage": "scores", "disk": scores.store_bytes * scores.artifacts, "peak": base + on_host, "note": note}
        )
    rows += [
        {
            "stage": "stats",
            "disk": 7 * 8 * s.P * s.stats_instances,
            "peak": base + int(STATS_BYTES_PER_PARAM * s.P),
            "note": "",
        },
        {
            "stage": "masks",
            "disk": 6 * s.n_qs * s.P,
            "peak": base + int(MASKS_BYTES_PER_PARAM * s.P),
            "note": "disk: the uncompressed bound",
        },
    ]
    if s.tokens:
        b, batches = tokens_batches(s.tokens_samples)
        peak = base + s.n_params * d + b * 4 * s.P + 2 * 8 * s.P + b * s.L * s.vocab * (d + 8)
        running = s.tokens_rows * batches * 8 * s.P
        disk = (s.tokens_modes + 1) * 8 * s.P
        rows.append({"stage": "tokens", "disk": disk, "peak": peak, "note": f"{human(running)} on disk while running"})
    if s.update_check:
        peak = base + s.n_params * (d + 4 + 4 + 8 + 2) + 2 * 8 * s.P
        rows.append({"stage": "update_check", "disk": 0, "peak": peak, "note": ""})
    boot = boot if scores is None or scores.rows else 0
    rows.append({"stage": "report", "disk": 2**20, "peak": base + 4 * s.P + 2 * 4 * boot + 2 * 8 * N * N, "note": ""})
    return rows


def human(n: int) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
