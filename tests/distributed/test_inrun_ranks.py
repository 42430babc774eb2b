"""In-run statistics on the trainer's ranks (covgrad.integrations.ranks): 2 gloo ranks hold a tiny Llama that the
"trainer" (this test) shards with ``fully_shard`` itself, each rank folds its own shard's columns, and rank 0's
files must be

- with every rank passing the whole batch (``shared_batch``): the single-process ``InRunFolder``'s bytes;
- with each rank passing its own rows: the bytes of the offline engine folding the ranks' rows as two batches
  into one state (the scores stage's fold), within 1e-6 relative of the single-process fold of all rows at once,
  and the exact top sets of the offline statistics;

and the trainer's sharded gradient must be the same bytes with and without a fold before its backward. A replicated
policy (data parallel: every rank holds the whole model) gives the sharded policy's files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from covgrad.distributed.launch import Placement, launch_ranks
from covgrad.integrations.inrun import METRICS, InRunFolder, statistics
from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.moments.topk import count_for_fraction, topk_indices
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.inrun_files import assert_same_files, same_bytes, step_files
from tests.helpers.persample import llama, make_batch

B, R = 6, 2
GROUP = np.arange(B) // 2


def _batch() -> tuple[dict, np.ndarray]:
    """A left-padded batch of B rows and its advantages (B,)."""
    batch = make_batch(7, [3, 5, 2, 4, 3, 2], [4, 3, 6, 2, 5, 3])
    return batch, np.random.default_rng(7).standard_normal(B)


def _rows(rank: int) -> slice:
    return slice(rank * B // R, (rank + 1) * B // R)


def _loss_backward(model: torch.nn.Module, batch: dict, A: np.ndarray) -> None:
    """The trainer's loss −Σ_n A_n Σ_t log p(y_t), backward into the (sharded) gradients."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    (-(torch.as_tensor(A, dtype=lp.dtype)[:, None] * batch["target_mask"][:, 1:] * lp).sum()).backward()


def _local_grads(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.grad.to_local().numpy().copy() for p in model.parameters()]


def _rank(out: str) -> None:
    """One rank: prepare, shard as a trainer would, fold own rows and the shared batch, check the gradients."""
    from torch.distributed.fsdp import fully_shard

    from covgrad.integrations.ranks import RankInRunFolder, prepare_ranks

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = llama(tied=True)  # the tied embedding is a parameter of the root's group
    plan = prepare_ranks(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for m in (*model.model.layers, model):
        m.set_force_sum_reduction_for_comms(True)  # gloo reduce-scatters a plain sum
    model.train()
    batch, A = _batch()
    mine = {k: batch[k][_rows(rank)] for k in ("input_ids", "attention_mask", "target_mask")}
    a, g = A[_rows(rank)], GROUP[_rows(rank)]
    own = RankInRunFolder(model, plan, every_n=1, out_dir=Path(out) / "own")
    got = own.fold(0, mine["input_ids"], mine["attention_mask"], mine["target_mask"], a, group=g)
    assert (got is None) == (rank != 0) and own.steps == [0]
    shared = RankInRunFolder(model, plan, every_n=1, out_dir=Path(out) / "shared", shared_batch=True)
    shared.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A, group=GROUP)
    whole = llama(tied=True)  # not sharded: each rank folds the columns its dim-0 shard would hold
    replicated = RankInRunFolder(whole, prepare_ranks(whole), every_n=1, out_dir=Path(out) / "replicated")
    replicated.fold(0, mine["input_ids"], mine["attention_mask"], mine["target_mask"], a, group=g)

    _loss_backward(model, mine, a)
    want = _local_grads(model)
    model.zero_grad(set_to_none=True)
    own.fold(1, mine["input_ids"], mine["attention_mask"], mine["target_mask"], a, group=g)
    _loss_backward(model, mine, a)
    same = all(np.array_equal(x, y) for x, y in zip(want, _local_grads(model), strict=True))
    np.save(Path(out) / f"grads-{rank}.npy", np.array([same, model.training]))
    _blocked_folds(model, plan, Path(out) / "blocks", mine, a, g)


def _blocked_folds(model: torch.nn.Module, plan: Any, out: Path, mine: dict, a: np.ndarray, g: np.ndarray) -> None:
    """Fold the rank's own rows and the shared batch with blocks of 7, 101 and one block (``keep=()`` at 101),
    rank 0 saving the vectors its step kept."""
    from covgrad.integrations.ranks import RankInRunFolder

    batch, A = _batch()
    for block in (10**9, 7, 101):
        for shared in (False, True):
            b, aa, gg = (batch, A, GROUP) if shared else (mine, a, g)
            folder = RankInRunFolder(
                model,
                plan,
                out_dir=out / f"{block}-{shared}",
                q=0.2,
                block=block,
                keep=() if block == 101 else None,
                shared_batch=shared,
            )
            got = folder.fold(0, b["input_ids"], b["attention_mask"], b["target_mask"], aa, group=gg)
            assert (got is None) == (dist.get_rank() != 0)
            if got is not None:
                kept = {k: np.asarray(v) for k, v in got.stats.items() if np.ndim(v)}
                np.savez(out / f"{block}-{shared}-kept.npz", **kept)


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inrun_ranks")
    launch_ranks(Placement("local", R), _rank, (str(out),), out)
    return out


def _offline(model: torch.nn.Module, batch: dict, A: np.ndarray, parts: list[slice]) -> dict:
    """The scores stage's fold: the engine folds each part of the batch into one float64 state, in order."""
    layout = select_parameters(model)
    acc = MomentAccumulator(layout.P, "cpu", halves=2)
    psg = PerSampleGrads(model.eval(), layout, check=False)
    for rows in parts:
        ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows]
        fn = lambda z, i=ids, w=batch["target_mask"][rows]: score_logit_grad(z, i, w)  # noqa: E731
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        psg.accumulate(ids, mask, fn, acc, torch.as_tensor(A[rows]), GROUP[rows] % 2, position_ids=pos)
    return statistics(acc.rows())


@pytest.mark.slow
def test_ranks_fold_their_shards_to_the_single_process_statistics(ranks_out: Path) -> None:
    batch, A = _batch()
    single = InRunFolder(llama(tied=True), every_n=1).fold(
        0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A, group=GROUP
    )
    assert single is not None
    shared = np.load(ranks_out / "shared" / "step_000000.npz")
    for name in ("F", "G", "rho"):
        assert shared[name].tobytes() == single.stats[name].tobytes(), name
    for metric in METRICS:
        np.testing.assert_array_equal(shared[f"top_{metric}"], single.top[metric])
    summary = json.loads((ranks_out / "shared" / "step_000000.json").read_text())
    assert summary["N"] == B and summary["bound_violations"] == int(single.stats["bound_violations"])

    offline = _offline(llama(tied=True), batch, A, [_rows(r) for r in range(R)])
    own = np.load(ranks_out / "own" / "step_000000.npz")
    k = count_for_fraction(0.01, own["F"].shape[0])
    for name in ("F", "G", "rho"):
        assert own[name].tobytes() == offline[name].tobytes(), name
        scale = np.nanmax(np.abs(single.stats[name]))
        np.testing.assert_allclose(own[name], single.stats[name], rtol=1e-6, atol=1e-9 * scale)
    for metric, src in METRICS.items():
        np.testing.assert_array_equal(own[f"top_{metric}"], topk_indices(np.abs(offline[src]), k))
    index = json.loads((ranks_out / "own" / "inrun.json").read_text())
    assert index["steps"] == [0, 1] and own["F"].max() > 0
    assert_same_files(ranks_out / "replicated", ranks_out / "own")
    assert sorted(p.name for p in (ranks_out / "own").iterdir()) == sorted(
        ["inrun.json", *(f"step_00000{t}.{x}" for t in (0, 1) for x in ("json", "npz"))]
    )  # rank 0 alone writes


@pytest.mark.slow
def test_a_fold_leaves_the_sharded_trainers_gradients_as_they_were(ranks_out: Path) -> None:
    for rank in range(R):
        same, training = np.load(ranks_out / f"grads-{rank}.npy")
        assert same and training, f"rank {rank}"


@pytest.mark.slow
def test_ranks_fold_by_blocks_to_the_one_block_bytes(ranks_out: Path) -> None:
    """Blocks of 7 and 101 columns of each rank's own axis (many lockstep rounds, runs cut at the blocks) give rank
    0 the one-block files; the shared batch folded in blocks gives the single-process folder's bytes."""
    out = ranks_out / "blocks"
    for shared in (False, True):
        want, want_summary = step_files(out / f"{10**9}-{shared}")
        for block in (7, 101):
            got, summary = step_files(out / f"{block}-{shared}")
            assert list(got) == list(want) and summary == want_summary
            assert all(same_bytes(got[k], want[k]) for k in want), (block, shared)
        with np.load(out / f"{10**9}-{shared}-kept.npz") as kept:
            assert sorted(kept.files) == ["F", "G", "rho"] and all(same_bytes(kept[v], want[v]) for v in kept.files)
        with np.load(out / f"101-{shared}-kept.npz") as kept:
            assert kept.files == []
    batch, A = _batch()
    single = InRunFolder(llama(tied=True), out_dir=ranks_out / "blocks-single", q=0.2)
    single.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A, group=GROUP)
    assert_same_files(out / f"7-{True}", ranks_out / "blocks-single")
