"""The model-sharded scores plan (covgrad.distributed.plan, `covgrad plan --shape --ranks`): its arithmetic by hand."""

from __future__ import annotations

import dataclasses

import pytest

from covgrad.distributed.plan import SHAPES, FsdpWork, LmShape, fixed_need, formed_columns, fsdp_plan, rank_need
from covgrad.distributed.shardplan import HEADROOM
from covgrad.layout import split_blocks

LLAMA, QWEN = SHAPES["llama-3-70b"], SHAPES["qwen2.5-72b"]
WORK = FsdpWork(B=2, L=512, N=4096)


def test_shapes_have_the_published_parameter_counts() -> None:
    """The Hugging Face models of these configs (built on the meta device) have exactly these counts."""
    assert LLAMA.layout().P == 70_553_706_496
    assert QWEN.layout().P == 72_706_203_648
    assert len(LLAMA.layout().entries) == 1 + 80 * 9 + 2
    assert len(QWEN.layout().entries) == 1 + 80 * 12 + 2
    assert LLAMA.layout(["model.layers.*.self_attn.*"]).P == 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192)
    with pytest.raises(ValueError, match="matches no parameter"):
        LLAMA.layout(["transformer.h.*"])


def test_rank_need_items_by_hand() -> None:
    P, d = 70_553_706_496, 2
    fixed = fixed_need(LLAMA, WORK, 8)
    assert fixed.weights == P * d // 8  # every dim 0 of Llama-3-70B divides by 8
    layer = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    assert fixed.gathered == (2 * 128256 * 8192 + 8192 + 2 * layer) * d
    assert fixed.activations == 80 * 2 * 512 * ((8 * 8192 + 4 * 28672) * d + 64 * 4)
    assert fixed.logits == 2 * 512 * 128256 * (d + 8)
    attn = LLAMA.layout(["model.layers.*.self_attn.*"])
    need = rank_need(LLAMA, attn, WORK, 8, fixed)
    assert need.state == attn.P // 8 * 32  # float32: 2 halves x (mean, lo, M2, co-moment) x 4 bytes
    assert need.in_flight == 2 * 4 * (256 << 20) // (4 * 2)  # one 256 MiB row chunk of a projection
    # uneven shards: rank 0 holds ceil(d0 / R) rows of every tensor (q: 8192 rows over 3 ranks: 2731)
    q = LLAMA.layout(["model.layers.0.self_attn.q_proj.weight"])
    assert rank_need(LLAMA, q, WORK, 3).state == 2731 * 8192 * 32


def test_formed_columns_by_hand() -> None:
    """Per-sample columns formed per rank: q_proj of Llama-3-70B (8192 × 8192) at B = 2 with 256 MiB row
    chunks is cut into chunks of 4096 rows; each of 8 ranks owns 1024 rows, so it forms the 4096 of its chunk
    (4 × its share); at B = 16 a chunk is 512 rows and each rank forms exactly its 1024. A norm weight is
    formed whole by every rank. With aligned chunks each rank forms its own rows only."""
    q = LLAMA.layout(["model.layers.0.self_attn.q_proj.weight"])
    chunk = 256 << 20
    assert formed_columns(q, 8, 2, chunk) == [4096 * 8192] * 8
    assert formed_columns(q, 8, 16, chunk) == [1024 * 8192] * 8
    # 3 ranks own 2731, 2731 and 2730 rows; chunks of 512 rows: rank 0 rows 0-2730 → chunks 0..5 (3072 rows),
    # rank 1 rows 2731-5461 → chunks 5..10 (3072), rank 2 rows 5462-8191 → chunks 10..15 (3072)
    assert formed_columns(q, 3, 16, chunk) == [3072 * 8192] * 3
    norm = LLAMA.layout(["model.layers.0.input_layernorm.weight"])
    assert formed_columns(norm, 8, 2, chunk) == [8192] * 8
    plan = fsdp_plan(LLAMA, q, WORK, 8, 141_000_000_000)
    assert plan.formed == 4.0
    assert "the ranks form 4.00 × P columns per batch in all" in plan.lines()[-1]
    # aligned row chunks (scores.rank_chunks): each rank forms its own rows, whatever the chunk size
    assert formed_columns(q, 8, 2, chunk, aligned=True) == [1024 * 8192] * 8
    assert formed_columns(q, 3, 16, chunk, aligned=True) == [2731 * 8192, 2731 * 8192, 2730 * 8192]
    assert formed_columns(norm, 8, 2, chunk, aligned=True) == [8192] * 8
    assert plan.formed_aligned == 1.0 and "1.00 × P with scores.rank_chunks=aligned" in plan.lines()[-1]


def test_plan_picks_the_fewest_blocks_that_fit() -> None:
    layout = LLAMA.layout()
    plan = fsdp_plan(LLAMA, layout, WORK, 8, 141_000_000_000)
    assert plan.fits and plan.blocks > 1  # 70.5e9 x 32 bytes / 8 = 282 GB of state per rank: several rounds
    fewer = fsdp_plan(LLAMA, layout, WORK, 8, 141_000_000_000, blocks=plan.blocks - 1)
    assert not fewer.fits and "state/R" in fewer.reason()
    biggest = max((rank_need(LLAMA, b, WORK, 8) for b in split_blocks(layout, plan.blocks)), key=lambda n: n.total)
    assert plan.need == biggest and plan.need.total <= HEADROOM * 141e9
    assert plan.store_bytes == layout.P * 32
    assert plan.peak_store_bytes == layout.P * 32 + 2 * 8 * plan.need.state


@pytest.mark.parametrize("shape", ["llama-3-70b", "qwen2.5-72b"])
@pytest.mark.parametrize("ranks,memory", [(8, 141e9), (16, 80e9)])
def test_70b_shapes_fit_both_machines(shape: str, ranks: int, memory: float) -> None:
    for patterns in (None, ["model.layers.*.self_attn.*"], ["model.layers.*.mlp.*"]):
        plan = fsdp_plan(SHAPES[shape], SHAPES[shape].layout(patterns), WORK, ranks, int(memory))
        assert plan.fits, plan.lines()


def test_what_cannot_fit_says_why() -> None:
    big_batch = FsdpWork(B=32, L=512, N=4096)
    plan = fsdp_plan(LLAMA, LLAMA.layout(), big_batch, 16, 80_000_000_000)
    assert not plan.fits and "activations alone" in plan.reason() and "groups_per_batch" in plan.reason()
    # the embedding, tied (with the LM head's contribution added chunk by chunk) or not, is made and folded in
    # row chunks like a projection: its whole per-sample block (B·4·V·H = 67 GB at B = 16) is never formed
    wide = FsdpWork(B=16, L=64, N=4096)
    for shape in (LLAMA, dataclasses.replace(LLAMA, tied=True)):
        plan = fsdp_plan(shape, shape.layout(), wide, 16, 80_000_000_000)
        assert plan.fits and plan.need.in_flight == 256 << 20
    with pytest.raises(ValueError, match="ranks"):
        fsdp_plan(LLAMA, LLAMA.layout(), WORK, 0, 80_000_000_000)
    tiny = LmShape(vocab=8, hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="blocks=99"):
        fsdp_plan(tiny, tiny.layout(), WORK, 2, 10**9, blocks=99)


@pytest.mark.slow
def test_cli_plan_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main

    ok = ["plan", "--shape", "qwen2.5-72b", "--ranks", "8", "--device-memory", "141"]
    small = ["--set", "scores.groups_per_batch=1", "--set", "scores.state_dtype=float32"]
    assert main([*ok, *small]) == 0
    out = capsys.readouterr().out
    assert "fsdp: 8 ranks" in out and "(fits" in out and "store:" in out
    assert main(["plan", "--shape", "llama-3-70b", "--ranks", "16", "--device-memory", "80"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "use " in out
