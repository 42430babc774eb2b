"""Parameter blocks that cut inside a tensor (row ranges along dim 0): the split's arithmetic, and row-cut blocks
against one block on tiny tied and untied Llama, tiny Gemma 3 and a fused-experts MoE (whose expert tensors take the
whole-tensor fallback), every parameter selected, left padding: the per-sample rows of ``__call__`` are equal bit
for bit and the folded state is within 1e-12 of one block's (the same batches merged in the same order; the fold's
float64 GEMMs run over other column tiles where a block boundary cuts a tensor, which moves last bits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

from covgrad.layout import ParamLayout, TensorEntry, select_parameters, split_blocks
from covgrad.persample import PerSampleGrads
from tests.helpers.families import FAMILIES, build
from tests.helpers.moments import assert_close, fused
from tests.helpers.persample import BATCH, hook_scores, make_batch

BUILDERS = {
    "llama-untied": FAMILIES["llama-untied"],
    "llama-tied": FAMILIES["llama-tied"],
    "gemma3-tied": lambda: build(
        T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8, sliding_window=4, tie_word_embeddings=True
    ),
    "qwen3-moe": FAMILIES["qwen3-moe"],
}


def toy_layout() -> ParamLayout:
    return ParamLayout(
        (
            TensorEntry("e", 0, 40, (10, 4), "float32"),
            TensorEntry("b", 40, 3, (3,), "float32"),
            TensorEntry("w", 43, 12, (4, 3), "float32"),
        )
    )


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7, 13])
def test_cut_blocks_tile_the_flat_axis_at_row_boundaries(k):
    layout = toy_layout()
    blocks = split_blocks(layout, k, cut=True)
    assert len(blocks) == k
    # concatenated, the blocks' entries are every element of every tensor once, in order, rows whole
    col, seen = 0, []
    for block in blocks:
        at = 0
        for e in block.entries:
            assert e.offset == at and e.numel == int(np.prod(e.shape))
            whole = layout.entry(e.name)
            assert e.full_shape == whole.shape
            r0, r1 = e.rows
            assert 0 <= r0 < r1 <= whole.shape[0]
            assert e.is_part == ((r0, r1) != (0, whole.shape[0]))
            seen.append((e.name, whole.offset + r0 * whole.row_size, e.numel))
            at += e.numel
        col += block.P
    assert col == layout.P
    assert [s for _, s, _ in seen] == list(np.cumsum([0] + [n for _, _, n in seen[:-1]]))
    assert all(len(layout.entry(n).shape) >= 2 or n == "b" for n, _, _ in seen)
    # each block ends at the place nearest to its share of P (the toy has a place every 3 or 4 columns)
    ends = np.cumsum([b.P for b in blocks])[:-1]
    assert all(abs(end - (j + 1) * layout.P / k) <= 4 for j, end in enumerate(ends))
    # the records of a part carry its rows; a whole tensor's records are unchanged
    for block in blocks:
        assert ParamLayout.from_records(block.to_records()) == block
    assert layout.to_records()[0] == {"name": "e", "offset": 0, "numel": 40, "shape": [10, 4], "dtype": "float32"}


def test_without_cut_blocks_stay_whole_tensors():
    layout = toy_layout()
    for k in (1, 2, 3):
        assert all(not e.is_part for b in split_blocks(layout, k) for e in b.entries)
    with pytest.raises(ValueError, match="4 parameter blocks cannot be made from 3 selected tensors"):
        split_blocks(layout, 4)
    with pytest.raises(ValueError, match="16 parameter blocks cannot be made from 15 places"):
        split_blocks(layout, 16, cut=True)


def _batches():
    out = []
    for i, seed in enumerate((50, 51, 52)):
        a = np.random.default_rng(seed).standard_normal(4)
        out.append((make_batch(seed, **BATCH), a, np.array([0, 1, i % 2, 1])))
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("k", [3, 7])
def test_row_cut_blocks_fold_the_state_of_one_block(name, k):
    model = BUILDERS[name]()
    layout = select_parameters(model)
    blocks = split_blocks(layout, k, cut=True)
    assert any(e.is_part for b in blocks for e in b.entries)
    if name == "qwen3-moe":  # a fused-experts tensor is cut: its rule writes whole tensors (the fallback)
        assert any(e.is_part and "experts" in e.name for b in blocks for e in b.entries)
    batches = _batches()
    # small row chunks, so chunk grids cross the block boundaries too
    for chunk_bytes in (None, 512):
        whole = fused(model, layout, batches, chunk_bytes=chunk_bytes).rows()
        at = 0
        for block in blocks:
            part = fused(model, block, batches, chunk_bytes=chunk_bytes).rows()
            assert all(np.array_equal(part[key], whole[key]) for key in ("count", "mean_a", "m2_a"))
            assert_close(part, {key: whole[key][:, at : at + block.P] for key in ("mean_s", "m2_s", "c_as")}, 1e-12)
            at += block.P
        assert at == layout.P
    # the kept per-sample rows (__call__) of every block are the one block's columns
    batch = batches[0][0]
    rows = hook_scores(model, layout, batch)
    at = 0
    for block in blocks:
        got = hook_scores(model, block, batch)
        assert torch.equal(got, rows[:, at : at + block.P]), (name, k, block.entries[0])
        at += block.P


def test_self_check_of_a_row_cut_block_compares_its_rows():
    """A wrong rule on a cut tensor is caught by the self-check of the block that holds its rows."""
    model = BUILDERS["llama-untied"]()
    layout = select_parameters(model, ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"])
    blocks = split_blocks(layout, 5, cut=True)
    up = [b for b in blocks if any(e.name.endswith("up_proj.weight") and e.is_part for e in b.entries)]
    assert up
    original = model.model.layers[0].mlp.up_proj.forward
    model.model.layers[0].mlp.up_proj.forward = lambda x: 2 * original(x)
    batch = make_batch(60, **BATCH)
    with pytest.raises(ValueError, match="self-check failed for parameter 'model.layers.0.mlp.up_proj.weight'"):
        PerSampleGrads(model, up[0], check=True)(
            batch["input_ids"],
            batch["attention_mask"],
            lambda z: torch.ones_like(z),
            position_ids=batch["position_ids"],
        )
