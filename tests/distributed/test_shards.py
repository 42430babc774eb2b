"""Shards over samples and parameter blocks, in one process: blocks never change a byte of the state,
the sample partition is part of the artifact, and the shard plan's arithmetic (a Qwen2.5-7B-shaped model
on 8 × 80 GB GPUs, built on the meta device)."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from covgrad.config import PipelineConfig
from covgrad.layout import select_parameters, split_blocks
from storage.artifacts import ArtifactStore
from tasks.specs import plan
from tests.helpers.pipeline import run_planned
from tests.helpers.user import user_config, write_checkpoint

SCORES = "scores.policy.policy"
STATE = ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as")


def configured(cfg: PipelineConfig, root: Path, **scores: object) -> PipelineConfig:
    data = cfg.model_dump(mode="json")
    data["root"] = str(root)
    data["scores"].update(scores)
    return PipelineConfig.model_validate(data)


def run_stage(cfg: PipelineConfig, name: str) -> None:
    run_planned(cfg, {name})


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> tuple[PipelineConfig, Path]:
    """Base model and rollouts of the tiny user-model config (8 batches of one prompt group)."""
    tmp = tmp_path_factory.mktemp("shards")
    cfg = user_config(tmp / "root", write_checkpoint(tmp / "ckpt"), tmp / "task.jsonl")
    cfg = configured(cfg, tmp / "root", groups_per_batch=1, checkpoint_batches=1, byte_budget=0)
    run_stage(cfg, "base_model")
    run_stage(cfg, "rollouts.policy")
    return cfg, tmp / "root"


def scores_group(upstream, tmp: Path, name: str, **scores: object):
    """The scores store of the upstream config with ``scores`` overrides, computed in a copy of the root."""
    cfg, root = upstream
    shutil.copytree(root, tmp / name)
    cfg = configured(cfg, tmp / name, **scores)
    run_stage(cfg, SCORES)
    return cfg, ArtifactStore(cfg.root).open_group(plan(cfg)[SCORES].ref, "scores.zarr", mode="r")


def test_split_blocks_partition_the_layout():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    layout = select_parameters(model)
    for n in range(1, len(layout.entries) + 1):
        blocks = split_blocks(layout, n)
        assert len(blocks) == n and all(b.entries for b in blocks)
        assert [e.name for b in blocks for e in b.entries] == layout.names
        assert sum(b.P for b in blocks) == layout.P
        assert all(b.entries[0].offset == 0 for b in blocks)
    assert [b.P for b in split_blocks(layout, 2)] == [40, 90]  # cut at the tensor end nearest P/2 = 65
    with pytest.raises(ValueError, match="7 parameter blocks cannot be made from 6"):
        split_blocks(layout, 7)


def test_per_sample_rows_are_kept_with_one_block_equal_batches_and_within_the_budget():
    from covgrad.distributed.shardplan import keeps_rows

    N, P = 8, 100
    assert keeps_rows(N, P, N * P * 4, 1, True)
    assert not keeps_rows(N, P, N * P * 4 - 1, 1, True)
    assert not keeps_rows(N, P, N * P * 4, 2, True)
    assert not keeps_rows(N, P, N * P * 4, 1, False)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [65536, 512])  # one chunk (every boundary is an edge), and many
def test_parameter_blocks_do_not_change_a_byte(upstream, tmp_path, monkeypatch, chunk):
    """1 × 1, 1 × 2 and one block per tensor: identical state bytes (each column depends on its tensor only)."""
    import storage.schema

    monkeypatch.setattr(storage.schema, "PARAM_CHUNK", chunk)
    _, one = scores_group(upstream, tmp_path, "one", shards=[1, 1])
    n_tensors = len(one.attrs["tensors"])
    for blocks in (2, n_tensors):
        _, many = scores_group(upstream, tmp_path, f"b{blocks}", shards=[1, blocks])
        assert many.attrs["shards"] == [1, blocks] and len(many.attrs["block_starts"]) == blocks + 1
        assert np.count_nonzero(many["c_as"][...]) > 0
        for name in (*STATE, "advantage", "group", "batch_done"):
            assert one[name][...].tobytes() == many[name][...].tobytes(), (blocks, name)
        assert many["shard_batches"][...].tolist() == [[8] * blocks]
        for name, arr in many.arrays():  # the edge chunks were assembled: every chunk is on disk
            assert arr.nchunks_initialized == arr.nchunks, name
        assert list(many["ckpt/shard0/block1"].group_keys()) == []


def test_the_key_holds_the_sample_shards_not_the_blocks(upstream):
    """Blocks (and "auto" blocks) change no byte, so they share the key; sample shards do not; bad values
    are one-line config errors."""
    cfg, root = upstream
    keys = {
        str(shards): plan(configured(cfg, root, shards=shards))[SCORES].ref.key
        for shards in ([1, 1], [1, 3], [1, "auto"], "auto", [2, 1], [2, "auto"])
    }
    assert keys["[1, 1]"] == keys["[1, 3]"] == keys["[1, 'auto']"] == keys["auto"]
    assert keys["[2, 1]"] == keys["[2, 'auto']"] != keys["[1, 1]"]
    assert configured(cfg, root, shards="auto").scores.shards == (1, "auto")
    for bad in ([0, 1], [1, 0], [1, "many"], [2.5, 1]):
        with pytest.raises(ValueError, match="scores.shards"):
            configured(cfg, root, shards=bad)


@pytest.mark.slow
def test_sample_shards_are_in_the_key_and_blocks_keep_their_bytes(upstream, tmp_path):
    """2 × 2 in one process equals 2 × 1 byte for byte; 1 and 2 sample shards are different artifacts
    whose statistics agree to float64 rounding. Two prompt groups per batch, so that each shard's rows
    hold both parity halves and the stats stage's merge differs from the single shard's."""
    cfg1, _ = scores_group(upstream, tmp_path, "s1", shards=[1, 1], groups_per_batch=2)
    cfg2, two = scores_group(upstream, tmp_path, "s2", shards=[2, 1], groups_per_batch=2)
    _, twobytwo = scores_group(upstream, tmp_path, "s2b2", shards=[2, 2], groups_per_batch=2)
    assert plan(cfg1)[SCORES].ref.key != plan(cfg2)[SCORES].ref.key
    for name in (*STATE, "batch_done"):
        assert two[name][...].tobytes() == twobytwo[name][...].tobytes(), name
    assert two["count"][...].tolist() == [8, 8, 8, 8] and two["shard_batches"][...].tolist() == [[2], [2]]
    worst = {}
    for cfg in (cfg1, cfg2):
        run_stage(cfg, "stats.policy.policy")
    s1, s2 = (ArtifactStore(c.root).open_group(plan(c)["stats.policy.policy"].ref, "stats.zarr") for c in (cfg1, cfg2))
    for name in ("m", "F", "Fvar", "G", "Cov"):
        a, b = s1[name][...], s2[name][...]
        worst[name] = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
        assert worst[name] < 1e-13, (name, worst[name])
    assert not all(s1[n][...].tobytes() == s2[n][...].tobytes() for n in ("m", "F", "G"))  # another merge tree
    print("max |1 shard - 2 shards| / max |1 shard|:", {k: f"{v:.1e}" for k, v in worst.items()})


QWEN7B = {  # Qwen2.5-7B's config values (bf16, untied LM head)
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "architectures": ["Qwen2ForCausalLM"],
}


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config file for a Qwen2.5-7B-shaped model directory that holds only ``config.json`` (no weights)."""
    import yaml
    from transformers import Qwen2Config

    tmp = tmp_path_factory.mktemp("qwen7b")
    Qwen2Config(**QWEN7B).save_pretrained(tmp / "model")
    config = {
        "name": "qwen7b",
        "root": str(tmp / "runs"),
        "model": {"path": str(tmp / "model"), "dtype": "bfloat16"},
        "task": {"kind": "addition", "n_prompts": 256},
        "rollouts": {"samplers": {"policy": {"group_size": 4, "max_new_tokens": 128}}},
        "scores": {"groups_per_batch": 1, "state_dtype": "float32", "shards": "auto"},
    }
    (tmp / "qwen7b.yaml").write_text(yaml.safe_dump(config))
    return tmp / "qwen7b.yaml"


@pytest.mark.slow
def test_plan_qwen7b_on_eight_80gb_gpus(qwen7b: Path):
    """The plan's arithmetic by hand: P from the config values, the fixed part of every job, the state per
    block; auto picks the fewest blocks that fit 90% of 80 GB."""
    from covgrad.distributed.shardplan import HEADROOM
    from flows.cli import load_config
    from flows.shards import plan_for_config

    cfg = load_config(str(qwen7b), [])
    V, H, I, layers, kv = 152064, 3584, 18944, 28, 512
    per_layer = (H * H + H) + 2 * (kv * H + kv) + H * H + 3 * H * I + 2 * H
    P = 2 * V * H + layers * per_layer + H
    assert P == 7_615_616_512
    B, L = 4, 128 + 128
    fixed = 2 * P + layers * B * L * ((8 * H + 4 * I) * 2 + 28 * L * 6) + B * L * V * (2 + 8)
    lines, chosen = plan_for_config(cfg, 8, 80 * 10**9, "cuda", 128)
    print("\n".join(lines))
    assert (chosen.samples, chosen.blocks) == (1, 7) and chosen.fits
    assert sum(n.P for n in chosen.needs) == P and all(n.fixed == fixed for n in chosen.needs)
    assert all(n.state == 32 * n.P for n in chosen.needs)
    # every block holds the embedding's or Linear weights (MLP 67.9M, LM head 545M elements), and the untied
    # embedding too is made and folded in 256 MiB row chunks (not its whole B·4·V·H = 8.7 GB block)
    assert all(n.in_flight == 256 << 20 for n in chosen.needs)
    assert chosen.need <= HEADROOM * 80e9 and chosen.store_bytes == 32 * P
    # the first batch's self-check: block 0's reference gradient and the embedding's (numel,) float64 sums
    assert chosen.needs[0].check > V * H * (2 + 8)
    six = plan_for_config(load_config(str(qwen7b), ["scores.shards=[1, 6]"]), 8, 80 * 10**9, "cuda", 128)[1]
    assert not six.fits  # auto's 7 blocks are the fewest that fit
    two = plan_for_config(load_config(str(qwen7b), ["scores.shards=[2, 7]"]), 8, 80 * 10**9, "cuda", 128)[1]
    assert two.fits and two.store_bytes == 2 * 32 * P
    # the embedding's own block: 24.0 (weights, activations, logits) + 0.3 + 0.7 + 17.4 (state) + 5.6 (self-check) GB
    with pytest.raises(ValueError, match="one tensor per block needs 48.0 GB per worker, more than 90% of 24.0 GB"):
        plan_for_config(cfg, 8, 24 * 10**9, "cuda", 128)


def test_plan_command(qwen7b: Path, capsys: pytest.CaptureFixture[str]):
    from flows.cli import main

    assert main(["plan", "--config", str(qwen7b), "--workers", "8", "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "1 sample shards x 7 parameter blocks = 7 jobs on 8 workers" in out and "(fits," in out
    assert main(["plan", "--config", str(qwen7b), "--set", "scores.shards=[1, 400]", "--device-memory", "80"]) == 2
    assert "400 parameter blocks cannot be made from 339 selected tensors" in capsys.readouterr().err
