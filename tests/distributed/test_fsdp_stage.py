"""The scores stage with the model sharded over ranks (scores.ranks, tasks/jobs/scores_ranks.py): the placement
fields leave in-process specs and keys as they were; the ranks' columns placed through the store's chunks and
edge arrays are the merged state; a 2-rank artifact holds the in-process arrays (with aligned rank chunks: to the
products' rounding, under a key of its own); a SIGKILLed rank is named in one line and the rerun resumes every rank
from their common checkpoint to the same arrays."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError

from covgrad.config import PipelineConfig
from covgrad.distributed.fsdp import RankColumns, merge_states
from covgrad.distributed.launch import Placement, RankFailedError
from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from storage.artifacts import ArtifactStore
from storage.identity import IDENTITY_ATTR
from storage.schema import SCORES as SCORES_STORE
from storage.stores.scores import ScoresStore
from tasks.jobs.scores_ranks import RankStore, assemble_edges, final_pieces, prepare_ranks, run_scores_ranks
from tasks.specs import plan
from tests.helpers.fsdp_ranks import SCORES, recording_job
from tests.helpers.fsdp_ranks import assert_same_arrays as _assert_same_arrays
from tests.helpers.fsdp_ranks import scores_arrays as _arrays
from tests.helpers.pipeline import NO_OPTIONAL, REPO, run_planned, tiny_config


def _demo(**scores: object) -> PipelineConfig:
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["root"] = "unused-root"
    data.setdefault("scores", {}).update(scores)
    return PipelineConfig.model_validate(data)


def test_in_process_specs_and_keys_are_what_they_were():
    """The demo's scores key before the fields existed; ranks change no key and appear only in sharded dumps."""
    before = plan(_demo())
    assert before[SCORES].ref.key == "fc079af3fbb554c37347ba97"  # the demo at scores VERSION 6, before scores.ranks
    assert "ranks" not in before[SCORES].spec.model_dump() and "launcher" not in before[SCORES].spec.model_dump()
    after = plan(_demo(ranks=2))
    assert [n for n in before if before[n].ref.key != after[n].ref.key] == ["report"]
    assert after[SCORES].spec.model_dump()["launcher"] == "local" and after[SCORES].spec.placement.ranks == 2


def test_aligned_rank_chunks_are_keyed_with_the_rank_count():
    """scores.rank_chunks=aligned changes the state's last bits with R: it and R are in the scores key; with one
    rank it has no effect and leaves spec and key as they were."""
    keys = {
        (ranks, chunks): plan(_demo(ranks=ranks, rank_chunks=chunks))[SCORES]
        for ranks in (1, 2, 3)
        for chunks in ("unsharded", "aligned")
    }
    assert keys[1, "aligned"].spec == keys[1, "unsharded"].spec and keys[1, "aligned"].spec.rank_chunks == "unsharded"
    assert len({keys[r, "unsharded"].ref.key for r in (1, 2, 3)}) == 1
    assert len({keys[r, "aligned"].ref.key for r in (2, 3)} | {keys[1, "unsharded"].ref.key}) == 3
    assert keys[2, "aligned"].spec.model_dump()["rank_chunks"] == "aligned"
    assert "rank_chunks" not in keys[2, "unsharded"].spec.model_dump()


@pytest.mark.parametrize(
    ("scores", "message"),
    [
        ({"ranks": 2, "launcher": "in-process"}, "scores.ranks=2 with scores.launcher=in-process"),
        ({"ranks": 2, "shards": [1, 2]}, r"scores.ranks=2 with scores.shards=\[1, 2\]"),
        ({"ranks": 0}, "ranks"),
    ],
)
def test_bad_rank_settings_are_refused(scores, message):
    with pytest.raises(ValidationError, match=message):
        _demo(**scores)


def _layout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(301, 1201), torch.nn.Linear(1201, 3), torch.nn.Embedding(97, 5))
    return select_parameters(model, None)


@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_columns_written_through_chunks_and_edges_are_the_merged_state(tmp_path: Path, ranks: int):
    """Random states of every rank written as the ranks write them (chunks inside a rank's runs in place, the
    shared ones through its edge arrays, assembled after) equal the ranks' states side by side."""
    layout = _layout()
    P = layout.P
    store = ArtifactStore(str(tmp_path))
    ref = store.ref("scores", "k")
    scores = ScoresStore(store, ref, 8, 2, 4, 1, [P], "float64", keep_rows=False)
    assert 2 * scores.chunk_p < P  # inner chunks and edges both occur
    scores.prepare(np.zeros(8), np.arange(8) // 4, kl=False)
    prepare_ranks(scores, ranks)
    g = scores.open()
    parts, columns = [], []
    gen, kinds = np.random.default_rng(ranks), set()
    for r in range(ranks):
        cols = RankColumns.of(layout, ranks, r)
        pieces = final_pieces(cols, scores.chunk_p, P)
        assert sum(p[0].stop - p[0].start for p in pieces) == cols.P
        c = scores.chunk_p
        inner = [p[2] for p in pieces if not p[3]]
        assert all(x.start % c == 0 and (x.stop % c == 0 or x.stop == P) for x in inner)
        kinds |= {p[3] for p in pieces}
        acc = MomentAccumulator(cols.P, torch.device("cpu"), "float64")
        state = {n: gen.standard_normal(2) for n in ("count", "mean_a", "m2_a")}
        state |= {n: gen.standard_normal((2, cols.P)) for n in ("mean_s", "m2_s", "c_as")}
        state["count"] = np.array([3.0, 5.0])
        if r:
            state |= {n: parts[0][n] for n in ("count", "mean_a", "m2_a")}
        acc.load(state)
        RankStore(scores, cols).write_final(g, 0, acc)
        parts.append(acc.rows())
        columns.append(cols)
    assert kinds == {False, True}  # chunks written in place and through edges
    assemble_edges(scores, layout, ranks)
    merged = merge_states(parts, columns, P)
    g = scores.open()
    for name, value in merged.items():
        assert np.array_equal(g[name][:], value), name
    assert "edges" not in g and not [k for k in g["ckpt/shard0"].group_keys() if k.startswith("rank")]


@pytest.mark.slow
def test_two_ranks_through_the_task_give_the_in_process_arrays(tiny_run, tmp_path: Path):
    """Every scores artifact of the tiny pipeline (policy and sampler centering, kept rows, KL) computed by the
    scores task with scores.ranks=2 (gloo, CPU, local processes) holds the in-process artifact's arrays, bit for
    bit, under the in-process key, and the in-process weights' identity (recorded by rank 0 before it shards its
    model: the task's process builds the model on the meta device). The ranks run the same job under either
    launcher: a torchrun group through the task is tests/distributed/test_torchrun.py's two-machine test, and the
    killed-rank test below resumes a torchrun group to the in-process arrays."""
    shutil.copytree(tiny_run[0], tmp_path / "root", ignore=shutil.ignore_patterns("scores", "stats", "masks"))
    cfg = tiny_config(str(tmp_path / "root"), **NO_OPTIONAL, **{"scores.ranks": 2, "scores.launcher": "local"})
    names = {n for n, s in plan(cfg).items() if s.ref.stage == "scores"}
    assert {plan(cfg)[n].spec.placement.launcher for n in names} == {"local"}
    results = run_planned(cfg, names | {n for n, s in plan(cfg).items() if s.ref.stage in ("base_model", "rollouts")})
    assert all(results[n].computed for n in names)
    before, after = ArtifactStore(str(tiny_run[0])), ArtifactStore(cfg.root)
    for n in names:
        assert results[n].ref.key == tiny_run[1][n].ref.key
        _assert_same_arrays(_arrays(before, tiny_run[1][n].ref), _arrays(after, results[n].ref))
        identity = [
            s.open_group(r, SCORES_STORE, mode="r").attrs[IDENTITY_ATTR]
            for s, r in ((before, tiny_run[1][n].ref), (after, results[n].ref))
        ]
        assert identity[0] == identity[1] and identity[0]["tensors"], n


@pytest.mark.slow
def test_two_ranks_with_aligned_chunks_agree_with_the_in_process_arrays(tiny_run, tmp_path: Path):
    """The tiny pipeline's scores artifacts without kept rows (moments only, so the ranks form row chunks), by
    scores.ranks=2 with aligned row chunks: under keys of their own, the in-process artifacts' arrays, the
    float ones to 1e-6 of each array's largest entry (the products of another chunk grid) and the others
    exactly."""
    shutil.copytree(tiny_run[0], tmp_path / "root", ignore=shutil.ignore_patterns("scores", "stats", "masks"))
    moments = {"scores.byte_budget": 0}
    single = tiny_config(str(tmp_path / "root"), **NO_OPTIONAL, **moments)
    ranked = tiny_config(
        str(tmp_path / "root"), **NO_OPTIONAL, **moments, **{"scores.ranks": 2, "scores.rank_chunks": "aligned"}
    )
    names = {n for n, s in plan(single).items() if s.ref.stage == "scores"}
    upstream = {n for n, s in plan(single).items() if s.ref.stage in ("base_model", "rollouts")}
    results = {c: run_planned(cfg, names | upstream) for c, cfg in (("single", single), ("ranked", ranked))}
    store = ArtifactStore(single.root)
    for n in names:
        a, b = (results[c][n] for c in ("single", "ranked"))
        assert b.computed and a.ref.key != b.ref.key, n
        want, got = _arrays(store, a.ref), _arrays(store, b.ref)
        assert sorted(want) == sorted(got) and "scores" not in want
        for name, value in want.items():
            if value.dtype.kind == "f" and value.size:
                assert np.abs(got[name] - value).max() <= 1e-6 * np.abs(value).max(), (n, name)
            else:
                assert np.array_equal(got[name], value), (n, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "where"),
    [(Placement("local", 2), "of 2"), (Placement("torchrun", 2), "of 2 (torchrun)")],
    ids=["local", "torchrun"],
)
def test_a_killed_rank_is_named_and_the_rerun_resumes_to_the_same_arrays(
    tiny_run, tmp_path: Path, placement: Placement, where: str
):
    """Rank 1 of 2 (local processes or a torchrun group) SIGKILLs itself once both ranks hold their checkpoints
    of 2 batches: the run fails in one line naming it and the edges are not assembled; the rerun resumes both
    ranks at batch 2 and ends with the in-process arrays."""
    shutil.copytree(tiny_run[0], tmp_path / "root", ignore=shutil.ignore_patterns("scores", "stats", "masks"))
    cfg = tiny_config(str(tmp_path / "root"), **NO_OPTIONAL, **{"scores.ranks": 2, "scores.checkpoint_batches": 1})
    node = plan(cfg)[SCORES]
    store = ArtifactStore(cfg.root)
    log = tmp_path / "restores.log"
    args = (cfg.root, node.ref, node.spec, node.upstream, str(log))
    store.begin(node.ref, node.spec.model_dump(mode="json"), resume=True)
    with pytest.raises(RankFailedError) as info:
        run_scores_ranks(recording_job, (*args, (1, 2)), placement)
    assert str(info.value) == f"rank 1 {where} was killed by SIGKILL; rerun to resume from the checkpoints"
    assert sorted(log.read_text().splitlines()) == ["0 0", "1 0"]
    assert "edges" in store.open_group(node.ref, "scores.zarr", mode="r")  # the edges were not assembled
    log.write_text("")
    assert run_scores_ranks(recording_job, (*args, None), placement) is not None
    assert sorted(log.read_text().splitlines()) == ["0 2", "1 2"]
    _assert_same_arrays(_arrays(ArtifactStore(str(tiny_run[0])), tiny_run[1][SCORES].ref), _arrays(store, node.ref))
