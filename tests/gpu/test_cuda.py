"""The same code on cuda: per-sample rows against the naive loop, the fused reduction against numpy float64,
and the bf16 tensor-core products against the fp32 products of the same values. Skipped without cuda."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.moments.accum import GroupAccumulator, MomentAccumulator
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import _bmm_into, _flat
from tests.helpers.moments import assert_close, check_row_chunks, fused, numpy_moments, state
from tests.helpers.persample import BATCH, MODELS, make_batch, naive_scores

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a cuda device")]


def on(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_rows_match_naive_loop_and_fused_state_matches_numpy(name):
    model = MODELS[name]()
    layout = select_parameters(model)
    batch = make_batch(40, **BATCH)
    ref = naive_scores(model, layout, batch).double()
    model.cuda()
    b = on(batch, "cuda")
    psg = PerSampleGrads(model, layout)
    fn = lambda z: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
    rows = psg(b["input_ids"], b["attention_mask"], fn, b["position_ids"])
    assert float((rows.double().cpu() - ref).norm() / ref.norm()) < 1e-5
    a, h = np.array([0.5, -1.0, 2.0, 0.25]), np.array([0, 1, 1, 0])
    acc = fused(model, layout, [(b, a, h)], device="cuda")
    assert acc.mean.is_cuda
    assert_close(state(acc), numpy_moments(rows.cpu().numpy(), a, h), 1e-9)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_products_on_tensor_cores_equal_fp32_products(low):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 40, 48, generator=gen).to(low).cuda()
    x = torch.randn(3, 40, 24, generator=gen).to(low).cuda()
    gf, xf = _flat(g, 3, 48), _flat(x, 3, 24)
    assert gf.dtype == torch.float32 and gf.covgrad_low == low
    got = torch.empty(3, 48, 24, device="cuda")
    _bmm_into(got, gf.transpose(1, 2), xf, True)
    _bmm_into(got, gf.transpose(1, 2), xf, False)
    want = 2 * torch.bmm(gf.transpose(1, 2).double(), xf.double())
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("state_dtype", ["float64", "float32"])
def test_cuda_compiled_fold_matches_numpy(state_dtype):
    """The compiled fold as a Triton kernel: mean/std = 1e4 blocks against a two-pass float64."""
    rng = np.random.default_rng(41)
    N, P = 64, 5000
    S = (rng.standard_normal((N, P)) + 1e4 * rng.standard_normal(P)).astype(np.float32)
    A, half = rng.standard_normal(N), rng.integers(0, 2, N)
    acc = MomentAccumulator(P, "cuda", state_dtype, compiled=True)
    for b in range(0, N, 16):
        acc.begin_batch(A[b : b + 16], half[b : b + 16])
        acc.fold(0, torch.from_numpy(S[b : b + 16, :3000]).cuda())
        acc.fold(3000, torch.from_numpy(S[b : b + 16, 3000:]).cuda())
        acc.end_batch()
    assert acc.fold_path == "compiled"
    assert_close(state(acc), numpy_moments(S, A, half), 1e-9 if state_dtype == "float64" else 1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_group_accumulator_matches_numpy(compiled):
    """A regime fold's prompt-group state on cuda (the groups' sums as a product, then the fold of C rows)
    against the float64 moments of the groups' sums, for groups of several sizes."""
    rng = np.random.default_rng(43)
    sizes = [3, 5, 1, 4, 2, 6, 3, 1]
    group = np.repeat(np.arange(len(sizes)), sizes)
    offsets = 3 * rng.standard_normal((len(sizes), 3000))
    S = (rng.standard_normal((len(group), 3000)) + offsets[group]).astype(np.float32)
    acc = GroupAccumulator(3000, "cuda", compiled=compiled, comoment=True)
    cuts = np.cumsum([0, *sizes])[::2]  # two groups per batch
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        acc.set_groups(group[lo:hi])
        acc.begin_batch(np.zeros(hi - lo), group[lo:hi] % 2)
        acc.fold(0, torch.from_numpy(S[lo:hi, :1000]).cuda())
        acc.fold(1000, torch.from_numpy(S[lo:hi, 1000:]).cuda())
        acc.end_batch()
    sums = np.stack([S[group == c].astype(np.float64).sum(0) for c in range(len(sizes))])
    want = numpy_moments(sums, np.asarray(sizes, np.float64), np.arange(len(sizes)) % 2)
    assert_close(state(acc), want, 2e-6)  # the sums are float32 products of the float32 rows


@pytest.mark.parametrize("name", ["llama-untied", "gpt2-conv1d"])
def test_cuda_weights_folded_in_row_chunks(name):
    """Row chunks on cuda (one row each instead of 256 MiB): the same checks as on CPU."""
    check_row_chunks(name, 1, "cuda")


@pytest.mark.parametrize("name", ["llama-untied", "llama-tied"])
def test_fsdp2_one_rank_on_cuda_is_the_plain_path(name, tmp_path):
    """FSDP2 with R = 1 (nccl, this process, every parameter) against the plain path on the same device: the
    same state bytes and the same kept rows (tests/distributed/test_fsdp.py runs 2 and 3 gloo ranks on the CPU)."""
    import torch.distributed as dist

    from covgrad.distributed.fsdp import rank_scores

    model = MODELS[name]().cuda()
    layout = select_parameters(model)
    batches = [(on(make_batch(50 + s, **BATCH), "cuda"), np.array([0.5, -1.0, 2.0, 0.25]) * (s + 1)) for s in range(3)]
    half = np.array([0, 1, 1, 0])
    plain = PerSampleGrads(model, layout)
    acc = MomentAccumulator(layout.P, "cuda")
    want_rows = torch.empty(4, layout.P, device="cuda")
    torch.cuda.set_device(0)
    sharded = MODELS[name]().cuda()
    sharded.load_state_dict(model.state_dict())
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        rs = rank_scores(sharded, layout, batches[0][0])
        got_rows = torch.empty(4, layout.P, device="cuda")
        for j, (b, a) in enumerate(batches):
            fn = lambda z, b=b: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
            args = (b["input_ids"], b["attention_mask"], fn)
            plain.accumulate(*args, acc, a, half, b["position_ids"], out=want_rows if j == 2 else None)
            rs.psg.accumulate(*args, rs.shard, a, half, b["position_ids"], out=got_rows if j == 2 else None)
    finally:
        dist.destroy_process_group()
    assert torch.equal(got_rows, want_rows)
    got, want = rs.acc.rows(), acc.rows()
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
