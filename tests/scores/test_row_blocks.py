"""Parameter blocks that cut inside a tensor (row ranges along dim 0): the split's arithmetic, and row-cut blocks
against one block on tiny tied and untied Llama, tiny Gemma 3 and a fused-experts MoE (whose expert tensors take the
whole-tensor fallback), every parameter selected, left padding: the per-sample rows of ``__call__`` are equal bit
for bit and the folded state is within 1e-12 of one block's (the same batches merged in the same order; the fold's
float64 GEMMs run over other column tiles where a block boundary cuts a tensor, which moves last bits)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T

from covgrad.config import PipelineConfig
from covgrad.distributed.shardplan import ModelShape, Workload, make_plan
from covgrad.layout import ParamLayout, TensorEntry, select_parameters, split_blocks
from covgrad.scores.engine import PerSampleGrads
from storage.artifacts import ArtifactStore
from storage.stores.scores import load_moments
from tasks.specs import plan
from tests.helpers.families import FAMILIES, build
from tests.helpers.moments import assert_close, fused
from tests.helpers.persample import BATCH, hook_scores, make_batch
from tests.helpers.pipeline import run_planned
from tests.helpers.user import user_config, write_checkpoint

SCORES = "scores.policy.policy"

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


def _configured(cfg: PipelineConfig, root: Path, **scores: object) -> PipelineConfig:
    data = cfg.model_dump(mode="json")
    data["root"] = str(root)
    data["scores"].update(scores)
    return PipelineConfig.model_validate(data)


@pytest.mark.slow
def test_the_scores_stage_of_row_cut_blocks_is_one_artifact(tmp_path, monkeypatch):
    """scores.cut_tensors with 5 blocks (every block boundary inside a tensor, state chunks of 512 columns, so
    that edges are assembled) against one block: the same tensor table and per-batch bookkeeping, the state
    within 1e-12, the key apart (cut) and the stats readers' view the same."""
    import storage.schema

    monkeypatch.setattr(storage.schema, "PARAM_CHUNK", 512)
    cfg = user_config(tmp_path / "root", write_checkpoint(tmp_path / "ckpt"), tmp_path / "task.jsonl")
    cfg = _configured(cfg, tmp_path / "root", groups_per_batch=1, checkpoint_batches=1, byte_budget=0)
    run_planned(cfg, {"base_model", "rollouts.policy"})
    groups = {}
    for name, scores in {"one": {"shards": [1, 1]}, "cut": {"shards": [1, 5], "cut_tensors": True}}.items():
        shutil.copytree(tmp_path / "root", tmp_path / name)
        c = _configured(cfg, tmp_path / name, **scores)
        run_planned(c, {SCORES})
        ref = plan(c)[SCORES].ref
        groups[name] = (ref.key, ArtifactStore(c.root).open_group(ref, "scores.zarr", mode="r"))
    (key1, one), (key5, cut) = groups["one"], groups["cut"]
    assert key1 != key5 and cut.attrs["shards"] == [1, 5]
    layout = ParamLayout.from_records(one.attrs["tensors"])
    starts = cut.attrs["block_starts"]
    inside = [s for s in starts[1:-1] if s not in {e.offset for e in layout.entries}]
    assert len(inside) == 4  # every boundary cuts a tensor
    assert cut.attrs["tensors"] == one.attrs["tensors"]
    for name in ("count", "mean_a", "m2_a", "advantage", "group", "batch_done"):
        assert one[name][...].tobytes() == cut[name][...].tobytes(), name
    want = {name: one[name][...] for name in ("mean_s", "m2_s", "c_as")}
    assert_close({name: cut[name][...] for name in want}, want, 1e-12)
    for name, arr in cut.arrays():  # the edge chunks were assembled: every chunk is on disk
        assert arr.nchunks_initialized == arr.nchunks, name
    m_one, m_cut = load_moments(one, halves=False)[0], load_moments(cut, halves=False)[0]
    assert np.allclose(np.asarray(m_cut.m2_s), np.asarray(m_one.m2_s), rtol=1e-12, atol=0)


def test_plan_of_gemma3_270m_fits_6_gb_only_with_row_cut_blocks():
    """Gemma 3 270M's shape on the meta device, every parameter, B = 4 at L = 36, float32 state, on a CPU of
    6 GB: whole-tensor blocks cannot fit (the tied embedding is one block), "auto" row-cut blocks do, each
    job with the first batch's self-check counted."""
    config = T.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = T.Gemma3ForCausalLM(config)
    layout, shape = select_parameters(model), ModelShape.of(model)
    assert layout.P == 268_098_176 and shape.tied_embedding == "model.embed_tokens.weight"
    assert "model.embed_tokens.weight" in shape.row_parts
    work = Workload(B=4, L=36, N=64, n_batches=16, state_dtype="float32", device="cpu", byte_budget=0,
                    equal_batches=True)  # fmt: skip
    with pytest.raises(ValueError, match="scores.cut_tensors=true"):
        make_plan(layout, shape, work, (1, "auto"), workers=1, device_bytes=6 * 10**9)
    chosen = make_plan(layout, shape, work, (1, "auto"), workers=1, device_bytes=6 * 10**9, cut=True)
    assert chosen.fits and chosen.blocks > 1
    assert all(n.check > 2 * 167_772_160 * 4 for n in chosen.needs[:1])  # the embedding's two gradients
    fewer = make_plan(layout, shape, work, (1, chosen.blocks - 1), workers=1, device_bytes=6 * 10**9, cut=True)
    assert not fewer.fits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_self_check_sums_column_pieces_against_the_reference(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The self-check's sum over samples, added in column pieces of any size (the row-chunk fold) and summed
    in chunks of its own, reports the relative error of numpy's float64 sum, on a row-cut entry, and catches
    an error confined to the last piece."""
    import covgrad.scores.selfcheck as selfcheck

    monkeypatch.setattr(selfcheck, "_CHECK_COLUMNS", 24)  # several of the check's own chunks per piece
    gen = np.random.default_rng(seed)
    rows, row, r0, r1, B = 10, 7, 2, 9, 3
    entry = TensorEntry("w", 0, (r1 - r0) * row, (r1 - r0, row), "float32", row0=r0, full_rows=rows)
    block = gen.standard_normal((B, (r1 - r0) * row)).astype(np.float32)
    full = gen.standard_normal((rows, row)).astype(np.float32)
    full[r0:r1] = block.astype(np.float64).sum(0).reshape(r1 - r0, row)
    full[r1 - 1, -1] += 0.5  # wrong in the last column only
    param = torch.zeros(rows, row)
    check = selfcheck.SelfCheck(ParamLayout([entry]), [param], (torch.from_numpy(full),))
    cuts = sorted(gen.choice(np.arange(1, block.shape[1]), size=4, replace=False).tolist())
    for a, b in zip([0, *cuts], [*cuts, block.shape[1]], strict=True):
        check.add(entry, a, torch.from_numpy(block[:, a:b]))
    check.close(entry)
    s, r = block.astype(np.float64).sum(0), full[r0:r1].reshape(-1).astype(np.float64)
    want = np.linalg.norm(s - r) / max(np.linalg.norm(s), np.linalg.norm(r), check.floor)
    assert [name for name, _ in check.errors] == ["w"]
    assert check.errors[0][1] == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="self-check failed for parameter 'w'"):
        check.raise_first()
