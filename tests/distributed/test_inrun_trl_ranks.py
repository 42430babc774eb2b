"""``CovgradInRun`` on a real TRL ``GRPOTrainer`` of two processes started by the real torchrun (DDP on CPU, gloo:
the trainer's own launcher and process group): process 0's files of a step must be the bytes of the scores stage's
fold of both processes' rows (rank 0's, then rank 1's) at the step's weights, the groups numbered across processes."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from covgrad.integrations.inrun import METRICS, statistics
from covgrad.layout import ParamLayout
from covgrad.moments.accum import MomentAccumulator
from covgrad.moments.topk import count_for_fraction, topk_indices
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.pipeline import REPO
from tests.helpers.user import write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _offline(out: Path, step: int, layout: ParamLayout) -> dict:
    """The scores stage's fold of both processes' rows of ``step``, in rank order, at the weights before step 0."""
    model = AutoModelForCausalLM.from_pretrained(out / "step0", dtype=torch.float32).eval()
    acc = MomentAccumulator(layout.P, "cpu", halves=2)
    psg = PerSampleGrads(model, layout, check=False)
    for rank in range(2):
        rows = torch.load(out / f"rows-{step}-{rank}.pt")
        ids, mask, w = rows["ids"], rows["mask"], rows["loss"].float()
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)
        fn = partial(score_logit_grad, input_ids=ids, target_mask=w, temperature=1.0)
        a = rows["advantages"].double()
        psg.accumulate(ids, mask, fn, acc, a, (rows["group"] % 2).numpy(), position_ids=pos)
    return statistics(acc.rows())


def test_a_two_process_trl_run_folds_every_process_rows(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    write_checkpoint(tmp_path / "model")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    proc = subprocess.run(
        [*cmd, "-m", "tests.helpers.trl_ranks", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    index = json.loads((tmp_path / "inrun" / "inrun.json").read_text())
    assert index["steps"] == [0, 1]
    layout = ParamLayout.from_records(index["tensors"])
    rows = [torch.load(tmp_path / f"rows-0-{r}.pt") for r in range(2)]
    assert [r["group"].tolist() for r in rows] == [[0] * 4, [1] * 4]  # one prompt group per process
    assert all(r["advantages"].abs().sum() > 0 for r in rows)
    summary = json.loads((tmp_path / "inrun" / "step_000000.json").read_text())
    assert summary["N"] == 8
    want = _offline(tmp_path, 0, layout)
    got = np.load(tmp_path / "inrun" / "step_000000.npz")
    for name in ("F", "G", "rho"):
        assert got[name].tobytes() == want[name].tobytes(), name
    k = count_for_fraction(0.01, layout.P)
    for metric, src in METRICS.items():
        np.testing.assert_array_equal(got[f"top_{metric}"], topk_indices(np.abs(want[src]), k))
