"""The scores fold: the exact per-sample scores of batch after batch folded into moment state.

No store here: the caller reads each batch, builds its logit-gradient function, and persists the state
(``checkpoint``) and any per-sample rows (``on_batch``), so one loop serves a whole artifact in one
process and each (sample shard, parameter block) job of a sharded run, and a run resumed from a
checkpoint folds the same batches in the same order as an uninterrupted one.

Shape notation: B rows of a batch, L tokens, V vocabulary, P parameter elements of the layout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from torch import Tensor

from covgrad.moments.accum import MomentAccumulator
from covgrad.rollouts.batch import RolloutBatch
from covgrad.scores.centering import LogitGrad
from covgrad.scores.engine import PerSampleGrads


def fold_batches(
    psg: PerSampleGrads,
    acc: MomentAccumulator,
    todo: Sequence[int],
    read: Callable[[int], RolloutBatch],
    logit_grad: Callable[[int, RolloutBatch], LogitGrad],
    checkpoint: Callable[[int, bool, list[int]], None],
    *,
    done: int = 0,
    rows: Tensor | None = None,
    on_batch: Callable[[int, Tensor | None], None] | None = None,
    every: int = 1,
    seconds: float = math.inf,
) -> None:
    """Fold batches ``todo`` (indices, in this order) into ``acc``, which already holds ``done`` batches.

    Batch b: ``read(b)`` gives its rows on the CPU and ``logit_grad(b, batch)`` the function of its
    logits (B, L, V) that the score differentiates; ``psg.accumulate`` folds its per-sample scores into
    ``acc`` on ``acc``'s device (row = prompt-group parity), writing them into ``rows[:B]`` too when
    ``rows`` (a (B_max, P) float32 buffer) is given; then ``on_batch(b, rows[:B] or None)``.
    ``checkpoint(folded, final, batches)`` follows the last batch and every ``every`` batches or
    ``seconds`` seconds: ``folded`` batches are in ``acc``, ``final`` is True after the last, ``batches``
    are those folded since the previous checkpoint.
    """
    device = acc.device
    since: list[int] = []
    last_save = time.monotonic()
    for j, b in enumerate(todo):
        batch = read(b)
        fn = logit_grad(b, batch)
        out = None if rows is None else rows[: batch.size]
        psg.accumulate(
            batch.input_ids.to(device),
            batch.attention_mask.to(device),
            fn,
            acc,
            batch.advantages,
            batch.group % 2,
            position_ids=batch.position_ids.to(device),
            out=out,
        )
        if on_batch is not None:
            on_batch(b, out)
        since.append(b)
        final = j == len(todo) - 1
        if final or len(since) >= every or time.monotonic() - last_save >= seconds:
            checkpoint(done + j + 1, final, since)
            since, last_save = [], time.monotonic()
