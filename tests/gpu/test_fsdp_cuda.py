"""Scores under FSDP2 on one GPU (R = 1, nccl) against the plain path on the same GPU: the sharded fold's state and
kept per-sample rows must be the plain fold's bytes (scripts/gpu_check.sh runs it; skipped without a CUDA device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from covgrad.distributed.fsdp import rank_scores
from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.families import FAMILIES
from tests.helpers.persample import make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a cuda device")]
CUDA = torch.device("cuda", 0)
CHUNK_BYTES = 1 << 12  # several row chunks per weight, as tests/distributed/test_fsdp.py


@pytest.fixture
def one_rank(tmp_path: Path):
    """A process group of this process alone on nccl."""
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fold(psg: PerSampleGrads, acc: object, P: int) -> torch.Tensor:
    """Three batches of 4 on the GPU folded into ``acc``; the last batch's per-sample rows (4, P)."""
    rows = torch.empty(4, P, device=CUDA)
    for seed in range(3):
        batch = make_batch(seed, [3, 5, 2, 4], [6, 3, 8, 5])
        batch = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        gen = torch.Generator().manual_seed(100 + seed)
        a = torch.randn(4, generator=gen, dtype=torch.float64).to(CUDA)
        h = torch.tensor([0, 1, 1, 0], device=CUDA)
        fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        out = rows if seed == 2 else None
        psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, h, batch["position_ids"], out=out)
    return rows


@pytest.mark.parametrize("family", ["llama-untied", "llama-tied", "qwen3", "qwen3-moe"])
def test_one_gpu_rank_under_fsdp2_is_the_plain_path(one_rank, family: str) -> None:
    torch.manual_seed(0)
    plain = FAMILIES[family]().to(torch.float32).to(CUDA)
    layout = select_parameters(plain)
    acc = MomentAccumulator(layout.P, CUDA)
    want_rows = _fold(PerSampleGrads(plain, layout, check=True, chunk_bytes=CHUNK_BYTES), acc, layout.P)
    want = acc.rows()
    torch.manual_seed(0)
    model = FAMILIES[family]().to(torch.float32)  # rank 0's host copy: fully_shard moves each module to the GPU
    rs = rank_scores(model, layout, make_batch(0, [3, 5, 2, 4], [6, 3, 8, 5]), check=True, chunk_bytes=CHUNK_BYTES)
    got_rows = _fold(rs.psg, rs.shard, layout.P)
    got = rs.acc.rows()
    assert torch.equal(got_rows, want_rows), f"{family}: per-sample rows"
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), f"{family}: {name} differs"
