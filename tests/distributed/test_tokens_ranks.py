"""The tokens stage with the model sharded over ranks (scores.ranks, tasks/jobs/tokens_ranks.py): 2 gloo ranks (local
processes or a torchrun group) give the in-process artifact's key and arrays, bit for bit, for tied and untied
embeddings; ranks are placement (no key changes, in-process dumps as before); the ranks' columns written through
their own and shared chunks make up the whole batch sums; a model that needs the repeated-batch path is recognised
and refused on ranks."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr

from covgrad.distributed.fsdp import RankColumns
from covgrad.distributed.launch import Placement, launch_ranks
from covgrad.layout import select_parameters
from covgrad.scores.tracing import bind_rules
from covgrad.tokens.backward import TokenBackward, repeated_batch
from storage.artifacts import ArtifactStore
from storage.schema import TOKENS as STORE
from storage.schema import create, param_chunk
from tasks.jobs.tokens_ranks import RankRows
from tasks.specs import plan
from tasks.tokens import tokens_task
from tests.helpers.families import FAMILIES
from tests.helpers.fsdp_ranks import run_two_machines
from tests.helpers.persample import make_batch
from tests.helpers.pipeline import tiny_config
from tests.helpers.ports import free_port
from tests.helpers.stages import POLICY_ONLY, run_upto

SETTINGS = {**POLICY_ONLY, "update_check.enabled": False}


def _arrays(store: ArtifactStore, ref) -> dict[str, np.ndarray]:
    g = store.open_group(ref, STORE, mode="r")
    return {name: a[:] for name, a in g.members(max_depth=None) if isinstance(a, zarr.Array)}


_BUILT: dict[bool, tuple] = {}


def _in_process(tied: bool, factory) -> tuple:
    """(root, tied, the in-process tokens ref) of a tiny pipeline run up to the tokens stage, built once per process."""
    if tied not in _BUILT:
        torch.set_num_threads(1)
        root = factory.mktemp("tokens-in-process") / "root"
        cfg = tiny_config(str(root), **SETTINGS, **{"model.demo.tie_embeddings": tied})
        _BUILT[tied] = (root, tied, run_upto(cfg, "tokens")["tokens"])
    return _BUILT[tied]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def in_process(request, tmp_path_factory):
    return _in_process(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def in_process_tied(tmp_path_factory):
    """The tied run only: two machines are checked on the harder case (the tied embedding's two contributions)."""
    return _in_process(True, tmp_path_factory)


def test_ranks_are_placement_and_in_process_dumps_are_unchanged(tmp_path: Path):
    """scores.ranks changes no tokens key; the fields appear in the tokens spec's dump only on ranks."""
    before, after = plan(tiny_config(str(tmp_path))), plan(tiny_config(str(tmp_path), **{"scores.ranks": 2}))
    assert before["tokens"].ref.key == after["tokens"].ref.key
    assert "ranks" not in before["tokens"].spec.model_dump() and "launcher" not in before["tokens"].spec.model_dump()
    assert after["tokens"].spec.placement.launcher == "local" and after["tokens"].spec.placement.ranks == 2
    torchrun = plan(tiny_config(str(tmp_path), **{"scores.ranks": 2, "scores.launcher": "torchrun"}))
    assert torchrun["tokens"].spec.placement.launcher == "torchrun"
    assert torchrun["tokens"].ref.key == before["tokens"].ref.key
    machines = {"scores.nnodes": 2, "scores.rdzv_endpoint": "127.0.0.1:29400"}
    nodes = [
        plan(tiny_config(str(tmp_path), **{"scores.ranks": 2, "scores.launcher": "torchrun", **machines, **node}))
        for node in ({}, {"scores.node_rank": 1})
    ]
    assert [n["tokens"].spec.placement.node_rank for n in nodes] == [0, 1]
    assert all(n["tokens"].spec.placement.nnodes == 2 for n in nodes)
    assert all(n["tokens"].ref.key == before["tokens"].ref.key for n in nodes)
    assert "nnodes" not in torchrun["tokens"].spec.model_dump()  # one machine: the dump as before


@pytest.mark.slow
def test_two_ranks_give_the_in_process_tokens_artifact(in_process, tmp_path: Path, monkeypatch):
    """The tokens artifact computed by the task with scores.ranks=2 (gloo, CPU) holds the in-process artifact's
    arrays (every array: the per-position traces and diagnostics, the score-sum check, the LM-head check, the Fisher
    estimates), bit for bit, under the same key, and the same scalars. Each tying once with each launcher: the tied
    model on local processes, the untied one on a real torchrun group (the tied one on torchrun is the two-machine
    test's); the launchers carry the same rank code."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root, tied, ref = in_process
    launcher = "local" if tied else "torchrun"
    shutil.copytree(root, tmp_path / "root", ignore=lambda d, names: ["tokens"] if Path(d) == root else [])
    ranks = {"model.demo.tie_embeddings": tied, "scores.ranks": 2, "scores.launcher": launcher}
    cfg = tiny_config(str(tmp_path / "root"), **SETTINGS, **ranks)
    assert plan(cfg)["tokens"].spec.placement.ranks == 2 and plan(cfg)["tokens"].spec.placement.launcher == launcher
    got = run_upto(cfg, "tokens")["tokens"]
    assert got.key == ref.key
    before, after = ArtifactStore(str(root)), ArtifactStore(cfg.root)
    a, b = _arrays(before, ref), _arrays(after, got)
    assert sorted(a) == sorted(b) and "fisher_exact" in a
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name], equal_nan=True), name
    g0, g1 = before.open_group(ref, STORE, mode="r"), after.open_group(got, STORE, mode="r")
    assert g0.attrs["lm_head"] == (None if tied else "lm_head.weight") == g1.attrs["lm_head"]
    assert g0.attrs["scalars"] == g1.attrs["scalars"]


@pytest.mark.slow
def test_two_machines_give_the_in_process_tokens_artifact(in_process_tied, tmp_path: Path, monkeypatch):
    """Two "machines" on this host (scores.nnodes=2, one torchrun rank each, a c10d rendezvous on 127.0.0.1), the
    tokens task of node 1 started first: it creates nothing and waits at the rendezvous; node 0 creates the store,
    runs every batch with it and completes the artifact; node 1 returns once it is complete. The artifact is the
    in-process one, array for array, under the same key."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root, tied, ref = in_process_tied
    shutil.copytree(root, tmp_path / "root", ignore=lambda d, names: ["tokens"] if Path(d) == root else [])
    group = {"scores.ranks": 2, "scores.launcher": "torchrun", "scores.nnodes": 2}
    group |= {"scores.rdzv_endpoint": f"127.0.0.1:{free_port()}", "model.demo.tie_embeddings": tied}
    node0, node1 = (
        plan(tiny_config(str(tmp_path / "root"), **SETTINGS, **group, **{"scores.node_rank": i}))["tokens"]
        for i in (0, 1)
    )
    assert node0.ref.key == node1.ref.key == ref.key and node1.spec.placement.node_rank == 1
    store = ArtifactStore(str(tmp_path / "root"))
    run_two_machines(tokens_task.fn, node0, node1, store)
    a, b = _arrays(ArtifactStore(str(root)), ref), _arrays(store, node0.ref)
    assert sorted(a) == sorted(b) and "fisher_exact" in a
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name], equal_nan=True), name


def test_a_model_on_the_repeated_batch_path_is_refused_on_ranks():
    """Modules without a per-module rule (here a fused-experts MoE) go through a repeated-batch PerSampleGrads,
    which does not run on a sharded model: ``repeated_batch`` says so (the task then runs the stage in its own
    process) and the engine refuses ranks' columns in one line naming what to set."""
    model = FAMILIES["qwen3-moe"]().eval()
    layout = select_parameters(model, None)
    assert repeated_batch(model, bind_rules(model, layout))
    dense = FAMILIES["llama-untied"]().eval()
    assert not repeated_batch(dense, bind_rules(dense, select_parameters(dense, None)))
    batch = make_batch(0, [3, 5], [2, 4])
    with pytest.raises(ValueError, match=r"repeated-batch path .*; set scores.ranks=1 or tokens.enabled=false$"):
        TokenBackward(model, layout, batch["input_ids"], batch["attention_mask"], columns=RankColumns.of(layout, 2, 0))


def _layout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(301, 1201), torch.nn.Linear(1201, 3), torch.nn.Embedding(97, 5))
    return select_parameters(model, None)


def _write_rows(path: str) -> None:
    """One rank: write its columns of two batch sums (values: the global column + 1000 × the batch)."""
    layout = _layout()
    columns = RankColumns.of(layout, dist.get_world_size(), dist.get_rank())
    rows = RankRows(zarr.open_group(path, mode="r+"), columns, layout.P)
    for b in range(2):
        rows.write(b, "exact", (columns.index() + 1000.0 * b).astype(np.float64))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_rows_written_through_own_and_shared_chunks_are_the_whole_rows(tmp_path: Path, ranks: int):
    """Each rank's columns of a (batch, param) batch sum, written in place (chunks inside its runs) and in turn
    (chunks shared with another rank), make up the whole rows."""
    layout = _layout()
    assert 2 * param_chunk(layout.P) < layout.P  # chunks of one rank and shared chunks both occur
    g = zarr.open_group(str(tmp_path / "tokens.zarr"), mode="w")
    create(g, STORE, "rows_exact", (2, layout.P))
    launch_ranks(Placement("local", ranks), _write_rows, (str(tmp_path / "tokens.zarr"),), tmp_path)
    expected = np.arange(layout.P)[None] + 1000.0 * np.arange(2)[:, None]
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "tokens.zarr"), mode="r")["rows_exact"][:], expected)
