"""A scores artifact folded by R ranks with the model sharded over them (:mod:`covgrad.distributed.fsdp`), through
the one scores store of :mod:`storage.stores.scores`.

Each rank folds every batch of a sample shard into the columns of its FSDP shard
(:class:`covgrad.distributed.fsdp.RankColumns`: dim-0 rows of every selected tensor, one run of columns each) and
writes them into the same arrays as an in-process run, so the artifact is the in-process artifact whatever R is.
The ranks are local processes or a torchrun group on one or several machines (:func:`run_scores_ranks`, placed by
:func:`rank_placement`). What the store adds while ranks run (dims as in :mod:`storage.stores.scores`):

- ``ckpt/shard{i}/rank{r}/n{c}/``: rank r's checkpoint of sample shard i after c batches: ``count, mean_a, m2_a
  (row,)`` and the state ``(row, param)`` of its P_r columns, ``batches`` = c written last. The ranks fold every
  batch together (the all-gathers are collective), so they checkpoint at the same counts; a rank deletes an
  older checkpoint only after a barrier shows that every rank holds the newer one, so the newest count every
  rank holds (an all-reduce MIN) is always complete on every rank, and a rerun resumes all ranks there;
- ``edges/shard{i}/rank{r}/``: rank r's final columns that lie in state chunks it shares with another rank
  (the partial chunks of its runs, concatenated in column order). The chunks inside a rank's runs are written in
  place by that rank alone; :func:`assemble_edges` (one process, after every rank) copies the edges into place
  and deletes them, so no two processes write one chunk and the finished artifact holds exactly the in-process
  arrays;
- rank 0 writes what every rank knows alike: the scalars of the sample shard's rows, ``shard_batches``,
  ``batch_done``, the per-sample rows and the KL.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from covgrad.devices import check_state_fits, pick_device
from covgrad.distributed import (
    Placement,
    RankColumns,
    RankFailedError,
    ShardAccumulator,
    launch_ranks,
    rank_scores,
)
from covgrad.identity import model_identity
from covgrad.layout import ParamLayout
from covgrad.moments import MomentAccumulator
from covgrad.rollouts import RolloutBatch
from covgrad.scores import LogitGrad, PerSampleGrads, fold_batches
from storage.artifacts import ArtifactRef, ArtifactStore, mark_batch_done
from storage.schema import SCORES as STORE
from storage.schema import write
from storage.stores.scores import SCALARS, RowWriter, ScoresStore, column_split, write_state
from tasks.specs import ScoresSpec, TokensSpec


class Job(Protocol):
    """What the ranks need of a scores job (``tasks.scores.ScoresJob``): its model, layout, batches and store."""

    spec: ScoresSpec
    model: torch.nn.Module
    layout: ParamLayout
    device: torch.device
    batches: list[tuple[int, int]]
    S: int
    K: int
    P: int
    B: int
    out: ScoresStore
    mu: Any

    def prepare(self) -> None: ...
    def finalize(self) -> dict[str, Any] | None: ...
    def _read(self, b: int) -> RolloutBatch: ...
    def _logit_grad(self, b: int, batch: RolloutBatch) -> LogitGrad: ...


def runs(columns: RankColumns) -> list[tuple[int, int, int]]:
    """The rank's columns as maximal runs (global start, global stop, local start): adjacent runs merged."""
    out: list[list[int]] = []
    for a, b, at in zip(columns.starts, columns.stops, columns.local, strict=True):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b, at])
    return [(a, b, at) for a, b, at in out]


def final_pieces(columns: RankColumns, chunk: int, P: int) -> list[tuple[slice, slice, slice, bool]]:
    """Where the rank's final columns go: (local columns, destination columns, global columns, is an edge) per
    piece, in column order; an edge's destination indexes the rank's ``edges`` arrays (its partial chunks,
    concatenated), an inner piece's the state arrays (its global columns)."""
    out, at_edge = [], 0
    for a, b, at in runs(columns):
        inner, edges = column_split(a, b, chunk, P)
        parts = [(inner, False)] if inner.stop > inner.start else []
        for cols, edge in sorted(parts + [(e, True) for e in edges], key=lambda p: p[0].start):
            local = slice(at + cols.start - a, at + cols.stop - a)
            dst = slice(at_edge, at_edge + cols.stop - cols.start) if edge else cols
            at_edge += (cols.stop - cols.start) if edge else 0
            out.append((local, dst, cols, edge))
    return out


class RankStore:
    """The writes of one rank (``columns``) into a :class:`ScoresStore` ``scores``: its checkpoints, its final
    columns and, for rank 0, the sample shard's scalars. No collective here (see :func:`fold_rank`)."""

    def __init__(self, scores: ScoresStore, columns: RankColumns) -> None:
        self.scores, self.columns = scores, columns
        self.pieces = final_pieces(columns, scores.chunk_p, scores.P)
        self.edge_width = sum(dst.stop - dst.start for _, dst, _, edge in self.pieces if edge)

    def _ckpt(self, g: Any, i: int) -> Any:
        return g[f"ckpt/shard{i}/rank{self.columns.rank}"]

    def counts(self, g: Any, i: int) -> list[int]:
        """The batch counts of this rank's complete checkpoints of sample shard i, ascending."""
        ck = self._ckpt(g, i)
        found = [int(ck[n]["batches"][0]) for n in ck.group_keys() if "batches" in ck[n]]
        return sorted(c for c in found if c >= 0)

    def load(self, g: Any, i: int, c: int, acc: MomentAccumulator) -> None:
        """Load checkpoint ``n{c}`` of sample shard i into ``acc`` (P_r columns)."""
        src = self._ckpt(g, i)[f"n{c}"]
        acc.load({name: src[name][:] for name in SCALARS})
        step = self.scores._write_step()
        for j in range(0, acc.P, step):
            cols = slice(j, min(acc.P, j + step))
            acc.load({name: src[name][:, cols] for name in self.scores.state_names}, cols)

    def save(self, g: Any, i: int, c: int, acc: MomentAccumulator) -> None:
        """Checkpoint ``acc`` as ``n{c}`` of sample shard i (its ``batches`` record last)."""
        ck = self._ckpt(g, i)
        if f"n{c}" in ck:  # a torn attempt of an earlier run
            del ck[f"n{c}"]
        target = ck.create_group(f"n{c}")
        self.scores._state_arrays(target, 2, acc.P)
        state = acc.rows(slice(0, 0))
        for name in SCALARS:
            target[name][:] = state[name]
        self._write(acc, [(slice(0, acc.P), slice(0, acc.P), target)], slice(0, 2))
        write(target, STORE, "batches", [c])

    def drop(self, g: Any, i: int, keep: int | None) -> None:
        """Delete this rank's checkpoints of sample shard i other than ``n{keep}`` (all when keep is None)."""
        ck = self._ckpt(g, i)
        for name in list(ck.group_keys()):
            if name != f"n{keep}":
                del ck[name]

    def write_final(self, g: Any, i: int, acc: MomentAccumulator) -> None:
        """Write the rank's final state of sample shard i: the chunks inside its runs in place, the shared
        ones into its edge arrays, and (rank 0) the shard's scalars."""
        edges = g[f"edges/shard{i}/rank{self.columns.rank}"]
        if self.edge_width:
            self.scores._state_arrays(edges, 2, self.edge_width, scalars=False)
        if self.columns.rank == 0:
            state = acc.rows(slice(0, 0))
            for name in SCALARS:
                g[name][2 * i : 2 * i + 2] = state[name]
        self._write(acc, [(src, dst, g) for src, dst, _, edge in self.pieces if not edge], slice(2 * i, 2 * i + 2))
        self._write(acc, [(src, dst, edges) for src, dst, _, edge in self.pieces if edge], slice(0, 2))

    def _write(self, acc: MomentAccumulator, pieces: list[tuple[slice, slice, Any]], rows: slice) -> None:
        step = self.scores._write_step()
        for src, dst, target in pieces:
            for j in range(0, src.stop - src.start, step):
                width = min(step, src.stop - src.start - j)
                part = acc.rows(slice(src.start + j, src.start + j + width))
                for name in self.scores.state_names:
                    write_state(target[name], rows, slice(dst.start + j, dst.start + j + width), part[name])


def prepare_ranks(scores: ScoresStore, ranks: int) -> None:
    """Create every rank's checkpoint and edge groups before the ranks start (no racing parent groups)."""
    g = scores.open()
    for i in range(scores.S):
        for r in range(ranks):
            g.require_group(f"ckpt/shard{i}/rank{r}")
            g.require_group(f"edges/shard{i}/rank{r}")


def assemble_edges(scores: ScoresStore, layout: ParamLayout, ranks: int) -> None:
    """Copy every rank's edge columns into the state arrays, then delete the ranks' edge and checkpoint groups
    (one process, after every rank; idempotent: a rank's edge group is deleted only after its copy, and a
    rerun copies what is left)."""
    g = scores.open()
    for r in range(ranks):
        pieces = [
            (dst, cols) for _, dst, cols, edge in RankStore(scores, RankColumns.of(layout, ranks, r)).pieces if edge
        ]
        for i in range(scores.S):
            name = f"edges/shard{i}/rank{r}"
            if name not in g:
                continue
            if pieces:
                for state in scores.state_names:
                    values = g[name][state][:]
                    for dst, cols in pieces:
                        g[state][2 * i : 2 * i + 2, cols] = values[:, dst]
            del g[name]
            if f"ckpt/shard{i}/rank{r}" in g:
                del g[f"ckpt/shard{i}/rank{r}"]
    for i in range(scores.S):
        if f"edges/shard{i}" in g and not list(g[f"edges/shard{i}"].group_keys()):
            del g[f"edges/shard{i}"]
    if "edges" in g and not list(g["edges"].group_keys()):
        del g["edges"]


def restore_rank(store: RankStore, g: Any, i: int, acc: MomentAccumulator) -> int:
    """Load the newest checkpoint of sample shard i that every rank holds into ``acc`` and drop this rank's
    others (collective); return its batch count (0: none)."""
    mine = store.counts(g, i)
    newest = torch.tensor([mine[-1] if mine else 0], device=acc.device)  # nccl reduces on the device
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    common = int(newest)
    if common > 0:
        store.load(g, i, common, acc)
    store.drop(g, i, keep=common if common > 0 else None)
    return common


def fold_rank(job: Job) -> None:
    """This rank's share of a scores job (in an initialised process group): shard the job's model
    (:func:`covgrad.distributed.fsdp.rank_scores`) and fold every sample shard's batches into this rank's columns,
    checkpointing every ``spec.checkpoint_batches`` batches (by count only: a time-based checkpoint would
    differ between ranks) and resuming from the newest checkpoint every rank holds."""
    rank, spec, out = dist.get_rank(), job.spec, job.out
    g, nb = out.open(), len(job.batches)
    first = job._read(0)
    example = {"input_ids": first.input_ids, "attention_mask": first.attention_mask, "position_ids": first.position_ids}
    example = {k: v.to(job.device) for k, v in example.items()}
    # Rank 0 keeps the rows of a run that keeps them, so it forms every block whole and folds it in one call, as
    # the in-process run does; the other ranks then fold whole blocks too (no row chunks: the same fold tiles).
    # Otherwise every rank forms only the row chunks that hold some of its columns.
    chunks = 0 if out.keep_rows else None
    if rank == 0:  # the weights' identity, while rank 0 holds them whole (the task's process never does)
        out.record_identity(model_identity(job.model.named_parameters()))
    aligned = spec.rank_chunks == "aligned"
    rs = rank_scores(
        job.model,
        job.layout,
        example,
        spec.state_dtype,
        check=spec.self_check,
        switch_P=job.P,
        chunk_bytes=chunks,
        aligned=aligned,
    )
    what = f"rank {rank}'s columns of scores.ranks={spec.placement.ranks}"
    check_state_fits(job.device, rs.columns.P, spec.state_dtype, what)
    store = RankStore(out, rs.columns)
    for i in range(job.S):
        if int(g["shard_batches"][i, 0]) >= 0:  # complete (written by rank 0 before a barrier of the last run)
            continue
        acc = rs.acc if i == 0 else MomentAccumulator(rs.columns.P, job.device, spec.state_dtype, switch_P=job.P)
        shard = ShardAccumulator(acc, rs.columns, job.P, aligned)
        batches = list(range(i, nb, job.S))
        done = restore_rank(store, g, i, acc)
        if rank == 0:
            for b in batches[:done]:  # folded into a complete checkpoint, perhaps killed before marking
                if g["batch_done"][b] == 0:
                    mark_batch_done(g, b)
        keep = out.keep_rows and rank == 0 and done < len(batches)
        writer = RowWriter(g["scores"], out.B, out.P, job.device) if keep else None
        rows = torch.empty((job.B, job.P), dtype=torch.float32, device=job.device) if keep else None
        try:
            _fold_shard(job, rs.psg, store, g, i, shard, batches, done, writer, rows)
        finally:
            if writer is not None:
                writer.close()


def _fold_shard(
    job: Job,
    psg: PerSampleGrads,
    store: RankStore,
    g: Any,
    i: int,
    shard: ShardAccumulator,
    batches: list[int],
    done: int,
    writer: RowWriter | None,
    rows: torch.Tensor | None,
) -> None:
    """Fold sample shard i's batches after the first ``done`` into this rank's columns (``shard``); each
    checkpoint is written by every rank, then (a barrier later) marked by rank 0, then the older ones dropped."""
    rank, acc = dist.get_rank(), shard.acc

    def on_batch(b: int, out: torch.Tensor | None) -> None:
        if writer is not None:
            writer.submit(*job.batches[b], out)
        if rank == 0 and job.mu is not None:
            g["kl_sum"][b], g["kl_tokens"][b] = job.mu.kl

    def checkpoint(folded: int, final: bool, since: list[int]) -> None:
        if writer is not None:
            writer.flush()
        if final:
            store.write_final(g, i, acc)
        else:
            store.save(g, i, folded, acc)
        dist.barrier()  # every rank holds this state
        if rank == 0:
            if final:
                g["shard_batches"][i, 0] = folded
            for b in since:
                mark_batch_done(g, b)
        dist.barrier()  # marked: the older checkpoints (all, after the final state) are not needed
        store.drop(g, i, keep=None if final else folded)

    todo = batches[done:]
    if not todo:  # a shard without batches: its empty final state
        checkpoint(done, True, [])
        return
    every = job.spec.checkpoint_batches
    fold_batches(
        psg, shard, todo, job._read, job._logit_grad, checkpoint, done=done, rows=rows, on_batch=on_batch, every=every
    )


def _rank_main(make_job: Callable[..., Job], args: tuple) -> None:
    """One launched rank: build the job (its model, rollouts and store) and fold its share."""
    fold_rank(make_job(*args))


# The module every torchrun rank runs (it calls covgrad.distributed.launch.torchrun_rank on the launch's payload).
RANK_ENTRY = "tasks.jobs.rank_main"


def run_scores_ranks(make_job: Callable[..., Job], args: tuple, placement: Placement) -> dict[str, Any] | None:
    """Compute a scores artifact with the model sharded over ``placement.ranks`` processes: ``make_job(*args)``
    builds the job, here once to create the store's arrays and once in every rank (``make_job`` and ``args`` must
    pickle: a module-level function and plain values). The ranks are local gloo processes, or this machine's ranks
    of a group that torchrun starts (``placement.ranks`` = its world, every machine's ranks), whose ranks take the
    columns of the world's split (:func:`covgrad.distributed.launch.launch_ranks`). Returns the job's provenance
    (None while batches are pending).

    With several machines every machine calls this with the same job against the same store root; node 0
    creates the arrays before its torchrun starts (the other nodes' ranks pass the rendezvous only once node
    0's have joined), and after every rank has finished assembles the edges and finalizes. A node other than
    0 only starts its ranks (this process builds no job) and returns None.

    Raises:
        covgrad.distributed.launch.RankFailedError: one line naming a rank that failed (its checkpoints stay; a
            rerun resumes every rank from the newest one they all hold).
        ValueError: when the job has more than one parameter block, its device is not the CPU (the local
            launcher) or ``placement.ranks`` is not torchrun's world.
    """
    ranks, torchrun = placement.ranks, placement.torchrun
    if torchrun is not None and torchrun.world != ranks:
        raise ValueError(
            f"scores.ranks={ranks} but torchrun starts {torchrun.world} ranks; pass ranks={torchrun.world}"
        )
    if torchrun is not None and torchrun.node_rank > 0:
        with tempfile.TemporaryDirectory(prefix="covgrad-ranks-") as tmp:
            launch_ranks(placement, _rank_main, (make_job, args), tmp, RANK_ENTRY)
        return None
    job = make_job(*args)
    if job.K != 1:
        raise ValueError(f"scores.ranks={ranks} needs one parameter block, not {job.K}; set scores.shards=[{job.S}, 1]")
    if torchrun is None and job.device.type != "cpu":
        raise ValueError(
            f"scores.ranks={ranks} starts gloo ranks on the CPU, not on {job.device}; set model.device=cpu "
            "(or scores.launcher=torchrun: nccl ranks, one device each)"
        )
    job.prepare()
    prepare_ranks(job.out, ranks)
    job.model = None  # built on the meta device (the ranks load the weights); this process keeps the layout
    with tempfile.TemporaryDirectory(prefix="covgrad-ranks-") as tmp:
        launch_ranks(placement, _rank_main, (make_job, args), tmp, RANK_ENTRY)
    assemble_edges(job.out, job.layout, ranks)
    return job.finalize()


def rank_placement(key: str, spec: ScoresSpec | TokensSpec, stage: str = "scores") -> Placement:
    """Where this machine's ranks of artifact ``key`` of ``stage`` run, from a spec that places the stage on ranks
    (``tasks.specs.ScoresSpec`` or ``TokensSpec``): with ``launcher`` torchrun, this machine's part of a torchrun
    group of ``ranks`` / ``nnodes`` ranks on each of ``nnodes`` machines (this one ``node_rank``, node 0's
    rendezvous at ``rdzv_endpoint``), meeting under an id of the stage and the artifact's key (every machine plans
    the same key), nccl when the spec's device is CUDA, else gloo; with any other launcher, ``ranks`` local gloo
    processes.

    Raises:
        ValueError: torchrun settings that cannot start a group (:class:`covgrad.distributed.Torchrun`).
    """
    if spec.placement.launcher != "torchrun":
        return spec.placement.launched()
    backend = "nccl" if pick_device(spec.device).type == "cuda" else "gloo"
    return spec.placement.launched(f"covgrad-{stage}-{key}", backend)


# How long, in seconds, a machine other than node 0 waits, after its ranks finish, for node 0 to complete the
# artifact, where the store's lock does not reach across machines (an object store).
NODE0_WAIT_S = 3600.0


def wait_for_node0(store: ArtifactStore, ref: ArtifactRef, nnodes: int) -> None:
    """Wait until node 0 of a group of ``nnodes`` machines has completed artifact ``ref`` (node 0 holds the
    artifact's lock from before its ranks start until the artifact is complete or its run failed).

    Raises:
        RankFailedError: node 0 let the artifact go incomplete (its failure is named in node 0's log), or did
            not complete it within :data:`NODE0_WAIT_S`.
    """
    deadline = time.monotonic() + NODE0_WAIT_S
    while not store.is_complete(ref):
        if (store.local and not store.busy(ref) and not store.is_complete(ref)) or time.monotonic() > deadline:
            raise RankFailedError(
                f"node 0 of scores.nnodes={nnodes} did not complete {ref.stage} {ref.key} after this node's ranks "
                "finished; see node 0's log, and rerun every node: they resume where the ranks stopped"
            )
        time.sleep(0.5)
