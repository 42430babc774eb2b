"""Optimizer trajectories: K steps of one regime from a policy, and which parameters each step changes.

:func:`run_trajectory` steps a :class:`~covgrad.updates.stepping.Stepper` K times on a data source and yields
one compact record per step from a :class:`~covgrad.updates.tracking.ChangeTracker`: reward, loss, the
per-token KL to the start, the gradient norm and the tracker's record. :func:`checkpoint_records` gives the
same records for the checkpoints of an external run; :func:`persistence` summarises a run's records.

Resume: :func:`trajectory_state` is a plain dict of tensors and ints (weights, optimizer state, tracker state,
step, seed); a run rebuilt from it by :func:`load_trajectory_state` continues byte-identically.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from covgrad.layout import ParamLayout
from covgrad.updates.stepping import FixedBatches, OnPolicy, Stepper, log_probs, token_kl_sum
from covgrad.updates.tracking import ChangeTracker


def run_trajectory(
    stepper: Stepper,
    source: FixedBatches | OnPolicy,
    layout: ParamLayout,
    steps: int,
    tracker: ChangeTracker | None = None,
    reference: nn.Module | None = None,
) -> Iterator[dict]:
    """Step from ``stepper.step`` up to ``steps``, yielding after each step its record: ``step``, ``lr``,
    ``loss``, ``grad_norm`` (the gradient's global norm before clipping; only with ``max_grad_norm``),
    ``adv_rms`` (the regime's bound scalar a on the step's rows, :class:`StepLoss`: sqrt(mean A²) for rl),
    ``reward`` (mean, NaN for fixed data), ``kl`` (per token to ``reference``, the start model; NaN without
    one) and, with ``tracker``, its :meth:`ChangeTracker.record`.

    The stepper's and tracker's state after a yield is the state to store (:func:`trajectory_state`).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    while stepper.step < steps:
        t = stepper.step + 1
        batch = source.batch(t, stepper.model)
        out = stepper.backward(batch, keep_logp=reference is not None)
        kl = float("nan") if reference is None else reference_kl(reference, batch, out.pop("logp"), out.pop("keep"))
        rec = {
            "step": t,
            "lr": stepper.spec.lr_at(t),
            "loss": out["loss"],
            "adv_rms": out["bound_a"],
            "reward": float(batch["reward"].double().mean()) if "reward" in batch else float("nan"),
            "kl": kl,
        }
        if stepper.spec.max_grad_norm is not None:
            rec["grad_norm"] = stepper.clip()
        grad = stepper.flat(layout, grad=True) if tracker is not None else None
        stepper.update()
        if tracker is not None:
            rec.update(tracker.record(stepper.flat(layout), grad, rec["lr"], rec["adv_rms"]))
        yield rec


KL_ROWS = 4  # rows of the reference's log-softmax (rows, L-1, V) held at a time


def reference_kl(
    reference: nn.Module, batch: Mapping[str, torch.Tensor], logp: torch.Tensor, keep: torch.Tensor
) -> float:
    """Mean per-token KL(p_t ‖ p_ref,t) over the response positions ``keep`` (N, L-1), nats: the step's
    log-softmax ``logp`` (N, L-1, V) against that of ``reference`` on the same rows, summed in float64 over row
    blocks of KL_ROWS (:func:`~covgrad.updates.stepping.token_kl_sum`; the reference's log-softmax is never held
    for all N rows); NaN without response positions."""
    total, positions = 0.0, int(keep.sum())
    if positions == 0:
        return float("nan")
    rows = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    for lo in range(0, logp.shape[0], KL_ROWS):
        part = slice(lo, lo + KL_ROWS)
        with torch.no_grad():
            ref_logp = log_probs(reference, *(r[part] for r in rows))[1]
        total += token_kl_sum(logp[part], ref_logp, keep[part])
    return total / positions


def checkpoint_records(
    series: Iterable[tuple[int, torch.Tensor]],
    tracker: ChangeTracker,
    logged: Mapping[int, Mapping[str, float]] | None = None,
) -> Iterator[dict]:
    """The records of an external run from its checkpoints after the first: ``series`` yields (trainer step,
    (P,) selected weights in the run's stored dtype) in step order, starting after the tracker's start. Each
    record is :meth:`ChangeTracker.record` (no rule predictors: the steps' gradients are unknown) with ``step``
    the trainer's step, ``adv_rms``, ``reward``, ``kl`` NaN, and ``lr``, ``loss`` as the trainer logged them at
    that step in ``logged`` (step -> {"lr", "loss", "grad_norm"}; NaN where it logged none), with a
    ``grad_norm`` column when ``logged`` is given."""
    nan = float("nan")
    for step, flat in series:
        log = {} if logged is None else logged.get(int(step), {})
        rec = {"step": int(step), "lr": log.get("lr", nan), "loss": log.get("loss", nan)}
        rec.update({"adv_rms": nan, "reward": nan, "kl": nan})
        if logged is not None:
            rec["grad_norm"] = log.get("grad_norm", nan)
        rec.update(tracker.record(flat, None, nan, nan))
        yield rec


def persistence(records: Sequence[Mapping], P: int, ks: Sequence[int] = (1, 2, 4, 8)) -> dict[str, float]:
    """Persistence over the n = len(records) steps of a run: ``jaccard_prev_mean`` (mean Jaccard of
    consecutive steps' changed sets, steps 2..n), ``frac_ge_{k}`` (fraction of the P coordinates changed
    in at least k of the n steps, from the last ``persist_hist``), ``frac_step_mean`` (mean per-step changed
    fraction) and ``frac_cum`` (cumulative changed fraction after step n)."""
    if not records:
        raise ValueError("persistence needs at least one step record")
    hist = np.asarray(records[-1]["persist_hist"], dtype=np.int64)
    consecutive = [float(r["jaccard_prev"]) for r in records[1:]]
    out = {
        "jaccard_prev_mean": float(np.mean(consecutive)) if consecutive else float("nan"),
        "frac_step_mean": float(np.mean([r["n_changed_step"] for r in records])) / P,
        "frac_cum": records[-1]["n_changed_cum"] / P,
    }
    out.update({f"frac_ge_{k}": int(hist[k:].sum()) / P for k in ks})
    return out


def trajectory_state(stepper: Stepper, tracker: ChangeTracker | None, seed: int) -> dict:
    """Everything a resumed run needs, a plain dict of tensors and ints: ``step``, ``seed``, ``stepper``
    (weights, optimizer state) and ``tracker`` (None without one)."""
    return {
        "step": stepper.step,
        "seed": seed,
        "stepper": stepper.state_dict(),
        "tracker": None if tracker is None else tracker.state_dict(),
    }


def load_trajectory_state(state: Mapping, stepper: Stepper, tracker: ChangeTracker | None, seed: int) -> None:
    """Restore :func:`trajectory_state`'s output into a freshly built stepper (and tracker) of the same run."""
    if int(state["seed"]) != seed:
        raise ValueError(f"the stored trajectory state has seed {state['seed']}, this run has seed {seed}")
    stepper.load_state_dict(state["stepper"])
    if tracker is not None:
        tracker.load_state_dict(state["tracker"])


def checkpoint_steps(steps: int, ratio: float) -> list[int]:
    """The steps that get a Hugging Face checkpoint: floor(ratio**i) for i = 0, 1, … up to ``steps``, and
    ``steps`` itself (ratio 2: 1, 2, 4, 8, …, K); none for ratio 0."""
    if ratio == 0:
        return []
    out, i = {steps}, 0
    while ratio**i <= steps:
        out.add(int(ratio**i))
        i += 1
    return sorted(out)
