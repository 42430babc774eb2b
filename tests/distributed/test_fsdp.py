"""Scores under FSDP2 (covgrad.distributed.fsdp): R ranks of gloo processes on the CPU against the single-process fold.

Every rank shards the model (fully_shard per decoder layer), forms the per-sample blocks from the
all-gathered layers (a weight's row chunks only where they hold some of its columns) and folds only its own
shard's columns; the ranks' states side by side must be the single-process state's bytes, and the kept
per-sample rows every rank sees must equal the single-process rows. Only rank 0 needs the weights: the last
rank builds its model on the meta device (with 3 ranks rank 1 holds weights of another seed), and every rank
computes with rank 0's.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from covgrad.config import DemoModel
from covgrad.distributed.fsdp import RankColumns, ShardAccumulator, merge_states, shard_rows
from covgrad.distributed.plan import formed_columns
from covgrad.layout import select_parameters, split_blocks
from covgrad.moments.accum import MomentAccumulator
from covgrad.rollouts.batch import RolloutBatch
from covgrad.scores.centering import policy_logit_grad, score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.fold import fold_batches
from tests.helpers.families import FAMILIES
from tests.helpers.persample import make_batch

# (family, parameter selection, (K, k): block k of K of the selection): every parameter, a typical
# selection (MLPs and norms of the layers), and a parameter block (the plan's rounds)
CASES = [
    ("llama-untied", None, (1, 0)),
    ("llama-tied", None, (1, 0)),
    ("qwen3", None, (1, 0)),
    ("qwen3-moe", None, (1, 0)),
    ("llama-untied", ["model.layers.*.mlp.*", "model.layers.*.input_layernorm.weight"], (1, 0)),
    ("qwen3", None, (3, 1)),
]


def _layout(model: torch.nn.Module, params: list[str] | None, blocks: tuple[int, int]) -> tuple[object, int]:
    """Block k of K of the selection, and the selection's P."""
    whole = select_parameters(model, params)
    return split_blocks(whole, blocks[0])[blocks[1]], whole.P


def _batches() -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """Three left-padded batches of 4 with advantages and halves (the last one keeps its rows)."""
    out = []
    for seed in range(3):
        batch = make_batch(seed, [3, 5, 2, 4], [6, 3, 8, 5])
        gen = torch.Generator().manual_seed(100 + seed)
        out.append((batch, torch.randn(4, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 1, 0])))
    return out


# Row chunks of 4 KiB (8 rows of a 32-wide weight at B = 4): the tiny models' weights span several chunks, so
# a rank skips the chunks outside its columns (compute sharding); the single process has the same chunk grid.
CHUNK_BYTES = 1 << 12


def _fold(psg: PerSampleGrads, acc: object, P: int) -> tuple[torch.Tensor, int]:
    """Fold the batches into ``acc``; the last batch's per-sample rows (4, P) (that batch forms every column),
    and the columns of row chunks left unformed over all batches."""
    rows, skipped = torch.empty(4, P), 0
    for j, (batch, a, h) in enumerate(_batches()):
        fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        out = rows if j == 2 else None
        psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, h, batch["position_ids"], out=out)
        skipped += psg.skipped_columns
    return rows, skipped


def _model(family: str) -> torch.nn.Module:
    return FAMILIES[family]().to(torch.float32)


def _rank_model(family: str, rank: int, ranks: int) -> torch.nn.Module:
    """Rank 0's model holds the weights; the last rank's is on the meta device, a middle rank's has other
    weights (rank 0's replace them)."""
    if rank == ranks - 1:
        with torch.device("meta"):
            return _model(family)
    if rank > 0:
        torch.manual_seed(1000 + rank)
        model = _model(family)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        return model
    return _model(family)


def _worker(rank: int, ranks: int, init: str, outdir: str) -> None:
    from covgrad.distributed.fsdp import rank_scores

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        for i, (family, params, blocks) in enumerate(CASES):
            model = _rank_model(family, rank, ranks)
            layout, P = _layout(model, params, blocks)
            rs = rank_scores(model, layout, _batches()[0][0], check=True, switch_P=P, chunk_bytes=CHUNK_BYTES)
            rows, skipped = _fold(rs.psg, rs.shard, layout.P)
            np.savez(Path(outdir) / f"{i}-{rank}.npz", rows=rows.numpy(), skipped=skipped, **rs.acc.rows())
    finally:
        dist.destroy_process_group()


def _single(
    family: str, params: list[str] | None, blocks: tuple[int, int]
) -> tuple[dict[str, np.ndarray], np.ndarray, object]:
    model = _model(family)
    layout, P = _layout(model, params, blocks)
    acc = MomentAccumulator(layout.P, "cpu", switch_P=P)
    rows, skipped = _fold(PerSampleGrads(model, layout, check=True, chunk_bytes=CHUNK_BYTES), acc, layout.P)
    assert skipped == 0
    return acc.rows(), rows.numpy(), layout


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_state_is_the_single_process_bytes(tmp_path: Path, ranks: int) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(ranks, init, str(tmp_path)), nprocs=ranks, join=True)
    for i, (family, params, blocks) in enumerate(CASES):
        want, want_rows, layout = _single(family, params, blocks)
        parts = [dict(np.load(tmp_path / f"{i}-{r}.npz")) for r in range(ranks)]
        columns = [RankColumns.of(layout, ranks, r) for r in range(ranks)]
        for r, part in enumerate(parts):
            np.testing.assert_array_equal(part.pop("rows"), want_rows, err_msg=f"{family} rank {r} rows")
            # compute sharding: every rank leaves the row chunks outside its columns unformed
            assert int(part.pop("skipped")) > 0, f"{family} rank {r} formed every row chunk"
        got = merge_states(parts, columns, layout.P)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert got[name].tobytes() == want[name].tobytes(), f"{family} {params}: {name} differs"


def test_rank_columns_tile_the_layout() -> None:
    model = _model("llama-tied")
    layout = select_parameters(model)
    for ranks in (1, 2, 3, 5, 64):
        cols = [RankColumns.of(layout, ranks, r) for r in range(ranks)]
        index = np.concatenate([c.index() for c in cols])
        assert np.array_equal(np.sort(index), np.arange(layout.P))
        assert sum(c.P for c in cols) == layout.P
    assert [shard_rows(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [shard_rows(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]  # torch.chunk: the last is empty
    assert [c.shape[0] for c in torch.chunk(torch.empty(10), 4)] == [3, 3, 3, 1]


def test_shard_accumulator_folds_only_its_columns() -> None:
    """Two ShardAccumulators over the halves of a layout, fed the whole blocks, give the unsharded state."""
    model = _model("llama-untied")
    layout = select_parameters(model)
    whole = MomentAccumulator(layout.P, "cpu")
    _fold(PerSampleGrads(model, layout, check=False), whole, layout.P)
    parts, columns = [], []
    for r in range(2):
        cols = RankColumns.of(layout, 2, r)
        acc = MomentAccumulator(cols.P, "cpu", switch_P=layout.P)
        _fold(PerSampleGrads(model, layout, check=False), ShardAccumulator(acc, cols, layout.P), layout.P)
        parts.append(acc.rows())
        columns.append(cols)
    got, want = merge_states(parts, columns, layout.P), whole.rows()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    with pytest.raises(ValueError, match="cover"):
        merge_states(parts[:1], columns[:1], layout.P)


@pytest.mark.parametrize("one_chunk", [False, True], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("family", ["llama-tied", "llama-untied"])
def test_plan_counts_the_columns_each_rank_forms(family: str, ranks: int, one_chunk: bool) -> None:
    """``covgrad.distributed.plan.formed_columns`` against the engine: a rank's PerSampleGrads with its
    ShardAccumulator leaves unformed exactly the columns the plan does not count (a selection whose (B, P) block
    fits one chunk: every rank forms all of it)."""
    model = _model(family)
    layout = select_parameters(model)
    chunk_bytes = 4 * 4 * layout.P if one_chunk else CHUNK_BYTES
    want = formed_columns(layout, ranks, 4, chunk_bytes)
    batch, a, h = _batches()[0]
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    for r in range(ranks):
        cols = RankColumns.of(layout, ranks, r)
        psg = PerSampleGrads(model, layout, check=False, chunk_bytes=chunk_bytes)
        shard = ShardAccumulator(MomentAccumulator(cols.P, "cpu"), cols, layout.P)
        psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, shard, a, h, batch["position_ids"])
        assert layout.P - psg.skipped_columns == want[r], f"rank {r}"
    if one_chunk:
        assert want == [layout.P] * ranks
    else:  # the tiny models' row chunks straddle rank boundaries: some formed twice
        assert sum(want) > layout.P


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "qwen3"])
def test_aligned_rank_chunks_form_each_column_once(family: str, ranks: int) -> None:
    """scores.rank_chunks=aligned: a rank forms the row chunks of its own rows only, so the ranks form every
    chunked weight's columns once (the plan's count, fewer than on the unsharded grid), folds its columns of
    any block without the unsharded fold's whole tiles, and the ranks' states side by side agree with the
    single-process state to 1e-6 of each array's largest entry: the float32 per-sample products of another
    chunk grid differ in their last bits (measured: up to 1.3e-9 of the largest entry, in 9-10% of them)."""
    model = _model(family)
    layout = select_parameters(model)
    batches = _batches()

    def run(psg: PerSampleGrads, acc: object) -> list[int]:
        formed = []
        for batch, a, h in batches:
            fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
            psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, h, batch["position_ids"])
            formed.append(layout.P - psg.skipped_columns)
        return formed

    whole = MomentAccumulator(layout.P, "cpu")
    run(PerSampleGrads(model, layout, check=False, chunk_bytes=CHUNK_BYTES), whole)
    want = formed_columns(layout, ranks, 4, CHUNK_BYTES, aligned=True)
    assert sum(want) < sum(formed_columns(layout, ranks, 4, CHUNK_BYTES))
    parts, columns = [], [RankColumns.of(layout, ranks, r) for r in range(ranks)]
    for r, cols in enumerate(columns):
        acc = MomentAccumulator(cols.P, "cpu")
        shard = ShardAccumulator(acc, cols, layout.P, aligned=True)
        cut: list[tuple[int, int]] = []
        shard._fold_cut = lambda tile, a, b, at, cut=cut: cut.append((a, b))  # no whole tiles to keep
        assert run(PerSampleGrads(model, layout, check=True, chunk_bytes=CHUNK_BYTES), shard) == [want[r]] * 3
        assert cut == []
        parts.append(acc.rows())
    merged, single = merge_states(parts, columns, layout.P), whole.rows()
    assert merged.keys() == single.keys()
    for name, value in single.items():
        assert np.abs(merged[name] - value).max() <= 1e-6 * np.abs(value).max(), name


@pytest.mark.parametrize("state_dtype", ["float64", "float32"])
@pytest.mark.parametrize("fold_elements", [8, 12, 40, 1 << 17])
def test_shard_accumulator_keeps_the_tiles(
    monkeypatch: pytest.MonkeyPatch, fold_elements: int, state_dtype: str
) -> None:
    """Random blocks folded through ShardAccumulators of 1..4 ranks, with column tiles of a few columns
    (shard boundaries inside tiles, pieces across two cut tiles), equal the unsharded fold's bytes."""
    import covgrad.moments.accum as accum

    monkeypatch.setitem(accum.FOLD_ELEMENTS, "cpu", fold_elements)
    layout = select_parameters(torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 5, bias=False)))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, layout.P, generator=gen), torch.randn(4, generator=gen)) for _ in range(3)]
    half = torch.tensor([0, 1, 0, 1])

    def run(acc: object) -> None:
        for x, a in batches:
            acc.begin_batch(a, half)
            for e in layout.entries:  # whole tensors, and one in two calls (a row-chunked fold)
                cut = e.numel // 2 if e.name.endswith("weight") else e.numel
                acc.fold(e.offset, x[:, e.offset : e.offset + cut])
                if cut < e.numel:
                    acc.fold(e.offset + cut, x[:, e.offset + cut : e.offset + e.numel])
            acc.end_batch()

    whole = MomentAccumulator(layout.P, "cpu", state_dtype)
    run(whole)
    for ranks in (1, 2, 3, 4):
        parts, columns = [], [RankColumns.of(layout, ranks, r) for r in range(ranks)]
        for cols in columns:
            acc = MomentAccumulator(cols.P, "cpu", state_dtype, switch_P=layout.P)
            run(ShardAccumulator(acc, cols, layout.P))
            parts.append(acc.rows())
        got = merge_states(parts, columns, layout.P)
        for name, want in whole.rows().items():
            assert got[name].tobytes() == want.tobytes(), (ranks, name)


def _rollout_batches(n: int) -> list[RolloutBatch]:
    """``n`` left-padded batches of 4 as the scores fold reads them (group parity = the half)."""
    out = []
    for seed in range(n):
        b = make_batch(seed, [3, 5, 2, 4], [6, 3, 8, 5])
        gen = torch.Generator().manual_seed(100 + seed)
        out.append(
            RolloutBatch(
                input_ids=b["input_ids"],
                attention_mask=b["attention_mask"],
                position_ids=b["position_ids"],
                response_mask=b["target_mask"],
                prompt_len=torch.tensor([3, 5, 2, 4]),
                response_len=torch.tensor([6, 3, 8, 5]),
                advantages=torch.randn(4, generator=gen, dtype=torch.float64),
                group=torch.tensor([4 * seed, 4 * seed + 1, 4 * seed + 3, 4 * seed + 2]),
            )
        )
    return out


def _fold_resumable(root: str, kill: tuple[int, int] | None) -> None:
    """One rank of a resumable sharded fold of 4 batches, checkpointed after every batch; ``kill`` =
    (rank, batches): that rank SIGKILLs itself right after checkpointing that many batches."""
    from covgrad.distributed.fsdp import RankCheckpoints, rank_scores

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model("llama-untied")
    layout = select_parameters(model)
    batches = _rollout_batches(4)
    example = {"input_ids": batches[0].input_ids, "attention_mask": batches[0].attention_mask}
    example["position_ids"] = batches[0].position_ids
    rs = rank_scores(model, layout, example, check=False)
    ck = RankCheckpoints(root, rs.acc)
    done = ck.restore()
    (Path(root) / f"start-{rank}-{done}").touch()

    def checkpoint(folded: int, final: bool, since: list[int]) -> None:
        ck.save(folded, final)
        if kill == (rank, folded):
            os.kill(os.getpid(), signal.SIGKILL)

    todo = list(range(len(batches)))[done:]
    fold_batches(
        rs.psg, rs.shard, todo, batches.__getitem__, lambda b, x: policy_logit_grad(x, "cpu"), checkpoint, done=done
    )


@pytest.mark.slow
def test_killed_rank_is_named_and_the_rerun_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    from covgrad.distributed.launch import Placement, RankFailedError, launch_ranks

    root = str(tmp_path / "ckpt")
    with pytest.raises(RankFailedError, match=r"^rank 1 of 2 was killed by SIGKILL; rerun") as info:
        launch_ranks(Placement("local", 2), _fold_resumable, (root, (1, 2)), tmp_path)
    assert "\n" not in str(info.value)
    launch_ranks(Placement("local", 2), _fold_resumable, (root, None), tmp_path)
    starts = sorted(p.name for p in Path(root).glob("start-*"))
    assert starts == ["start-0-0", "start-0-2", "start-1-0", "start-1-2"]  # the rerun resumed at batch 2

    model = _model("llama-untied")
    layout = select_parameters(model)
    acc = MomentAccumulator(layout.P, "cpu")
    batches = _rollout_batches(4)
    psg = PerSampleGrads(model, layout, check=False)
    fold_batches(psg, acc, range(4), batches.__getitem__, lambda b, x: policy_logit_grad(x, "cpu"), lambda *a: None)
    parts = []
    for r in range(2):
        with np.load(Path(root) / f"rank{r}" / "final.npz") as f:
            parts.append({k: f[k] for k in f.files})
        assert not list((Path(root) / f"rank{r}").glob("n*.npz"))  # only the final state is left
    got = merge_states(parts, [RankColumns.of(layout, 2, r) for r in range(2)], layout.P)
    for name, want in acc.rows().items():
        assert got[name].tobytes() == want.tobytes(), name


def _raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad input on this rank")


@pytest.mark.slow
def test_a_rank_that_raises_is_named_in_one_line(tmp_path: Path) -> None:
    from covgrad.distributed.launch import Placement, RankFailedError, launch_ranks

    with pytest.raises(RankFailedError, match=r"^rank 1 of 2 failed: ValueError: bad input on this rank$"):
        launch_ranks(Placement("local", 2), _raises, (), tmp_path)


def _meta_on_rank0() -> None:
    from covgrad.distributed.fsdp import rank_scores

    with torch.device("meta"):
        model = _model("llama-untied")
    rank_scores(model, select_parameters(model), _batches()[0][0])


@pytest.mark.slow
def test_rank0_without_weights_is_refused(tmp_path: Path) -> None:
    from covgrad.distributed.launch import Placement, RankFailedError, launch_ranks

    with pytest.raises(RankFailedError, match=r"^rank 0 of 2 failed: ValueError: rank 0 holds the model on the meta"):
        launch_ranks(Placement("local", 2), _meta_on_rank0, (), tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_a_meta_load_has_the_loaded_models_names_shapes_dtypes_and_ties(tmp_path: Path, tied: bool) -> None:
    """``load_model(meta=True)`` (a rank other than 0) builds the directory's model from its config on the meta
    device: the same parameters and buffers, shapes and dtypes as ``from_pretrained``, the same ties, no storage."""
    from covgrad.distributed.fsdp import on_meta
    from covgrad.models import build_demo_model
    from covgrad.rollouts.problems import build_char_tokenizer
    from storage.models import load_model

    tok = build_char_tokenizer()
    demo = DemoModel(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, tie_embeddings=tied)
    build_demo_model(demo, tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    real, meta = load_model(tmp_path), load_model(tmp_path, meta=True)
    assert on_meta(meta) and not on_meta(real)
    for a, b in ((real.named_parameters(), meta.named_parameters()), (real.named_buffers(), meta.named_buffers())):
        want, got = dict(a), dict(b)
        assert sorted(want) == sorted(got)
        for name, t in want.items():
            assert (got[name].shape, got[name].dtype) == (t.shape, t.dtype), name
    assert (meta.lm_head.weight is meta.model.embed_tokens.weight) == tied
    assert (real.lm_head.weight is real.model.embed_tokens.weight) == tied
    assert not meta.training
