"""``covgrad plan`` for the whole run: every stage's disk and peak memory, from the stores' schemas and the
stages' memory models, before anything runs.

The scores stage's device memory comes from ``covgrad.shardplan`` (``flows.shards.plan_for_config``);
this module adds the other stages with the arithmetic below (bytes; N samples of a sampler, T =
max_new_tokens, L = longest prompt + T, P selected parameters, n all parameters, V vocabulary, d the
policy dtype's bytes). Time is not predicted: it depends on the device and is stated as unknown.

| stage | disk | peak memory (host) |
|---|---|---|
| base_model | n·d (policy and, for the demo, the stale checkpoint) | n·(d + 16) (AdamW state, demo SFT) |
| rollouts | N·(4L + 9T + 40) (+ N·T·V·4 with μ in full, N·T·k·12 with top-k μ) | n·d + batch logits |
| stats | 7·8·P per stats instance | 8 chunks of 8 bytes per parameter block + 2·8·P (overlap ranks F and G) |
| masks | 6·q·P bytes (bool (q, P) masks by F, abs G, abs rho, two scopes) | 12.6·P (measured: 1.69 GiB at P = 134.5M) |
| tokens | 8·P per estimator + per-position rows | n·d + batch logits |
| update_check | per-cell rows only | n·(4 + 4 + 8) (fp32 weights, gradient, Adam moments) + 2·4·P |
| report | PNGs and tables, about 1 MB | 2·4·P·B bootstrap replicates (B·P ≤ 5e7) + the N × N Gram matrices |
"""

from __future__ import annotations

from dataclasses import dataclass

from covgrad.report.uncertainty import REPLICATE_BUDGET

MASKS_BYTES_PER_PARAM = 1.69 * 2**30 / 134_515_008  # benchmarks.masks, tasks/masks.py docstring


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


def stage_sizes(s: RunShape) -> list[dict[str, object]]:
    """One row per stage other than scores: ``stage``, ``disk`` and ``peak`` (host bytes), by the module's table."""
    d = s.dtype_bytes
    rollouts = 0
    for name, n in s.samples.items():
        T = s.T[name]
        rollouts += n * (4 * s.L + 9 * T + 40)
        kind, k = s.mu[name]
        rollouts += n * T * s.vocab * 4 if kind == "full" else n * T * k * 12 if kind == "topk" else 0
    logits = 16 * s.L * s.vocab * (d + 8)  # a 16-sample batch of logits, their gradient and softmax
    boot = min(REPLICATE_BUDGET, 200 * s.P)
    N = max(s.samples.values(), default=0)
    rows: list[dict[str, object]] = [
        {"stage": "base_model", "disk": s.n_params * d * (2 if s.demo else 0), "peak": s.n_params * (d + 16)},
        {"stage": "rollouts", "disk": rollouts, "peak": s.n_params * d + logits},
        {"stage": "stats", "disk": 7 * 8 * s.P * s.stats_instances, "peak": 2 * 8 * s.P + 64 * 65536 * 8 * 8},
        {"stage": "masks", "disk": 6 * s.n_qs * s.P, "peak": int(MASKS_BYTES_PER_PARAM * s.P)},
    ]
    if s.tokens:
        rows.append({"stage": "tokens", "disk": 4 * 8 * s.P, "peak": s.n_params * d + logits})
    if s.update_check:
        rows.append({"stage": "update_check", "disk": 0, "peak": s.n_params * 16 + 8 * s.P})
    rows.append({"stage": "report", "disk": 2**20, "peak": 2 * 4 * boot + 2 * 8 * N * N})
    return rows


def human(n: int) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
