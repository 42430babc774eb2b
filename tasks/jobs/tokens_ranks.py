"""A tokens artifact computed by R ranks with the model sharded over them (:mod:`covgrad.distributed.fsdp`), through
the one tokens store of :mod:`storage.stores.tokens`.

Every rank runs every batch of the study (:meth:`covgrad.tokens.study.TokenStudy.build_sharded`): the forward and
the backward passes are collective (FSDP2 all-gathers each layer), the per-sample blocks are formed whole from the
all-gathered layers, and each (param,) batch sum is kept only at the rank's columns
(:class:`covgrad.distributed.fsdp.RankColumns`: dim-0 rows of every selected tensor). What the ranks write into the
store (dims as in :mod:`storage.stores.tokens`):

- ``rows_{name}`` (batch, param): each rank its columns. The chunks inside a rank's runs are written by that rank
  alone; a chunk that two ranks share is written by one rank after another (a barrier between), so no two
  processes write one chunk at once (:class:`RankRows`);
- rank 0, after a barrier that follows every rank's rows of the batch, writes what every rank computes alike
  (the per-position arrays, ``score_sum_relerr``, ``batch_count``, ``lm_head_relerr``) and marks the batch done;
  a rerun recomputes the batches not marked.

The summary, the Fisher estimates and the rest of the artifact are written by the task's process after every rank
has finished, from the stored rows, as without ranks.
"""

from __future__ import annotations

import tempfile
from functools import partial
from typing import Any

import numpy as np
import torch.distributed as dist

from covgrad.devices import release_free_memory
from covgrad.distributed import RankColumns, launch_ranks, rank_device
from covgrad.tokens import TokenStudy, batch_bounds
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_rank_policy
from storage.schema import ROLLOUTS, param_chunk
from storage.schema import TOKENS as STORE
from storage.stores.rollouts import read_batch
from storage.stores.scores import column_split
from storage.stores.tokens import TokensStore
from tasks.jobs.scores_ranks import RANK_ENTRY, rank_placement, runs
from tasks.specs import TokensSpec


class RankRows:
    """The writes of one rank's (P_r,) batch sums into the ``rows_{name}`` (batch, P) arrays of group ``g``.

    Args:
        g: the tokens store's group, open for writing.
        columns: the rank's columns.
        P: the layout's P (the arrays' param extent, chunked by :func:`storage.schema.param_chunk`).
    """

    def __init__(self, g: Any, columns: RankColumns, P: int) -> None:
        self.g, self.columns = g, columns
        self.inner: list[tuple[slice, slice]] = []  # (local columns, global columns): whole chunks of a run
        self.edges: list[tuple[slice, slice]] = []  # the same, of chunks shared with columns outside the run
        for a, b, at in runs(columns):
            inner, edges = column_split(a, b, param_chunk(P), P)
            for cols, edge in [(inner, False), *((e, True) for e in edges)]:
                if cols.stop > cols.start:
                    local = slice(at + cols.start - a, at + cols.stop - a)
                    (self.edges if edge else self.inner).append((local, cols))

    def write(self, b: int, name: str, row: np.ndarray) -> None:
        """Batch ``b``'s sum ``name`` at the rank's columns, ``row`` (P_r,) float64 (collective: every rank writes
        its shared chunks in turn)."""
        array = self.g[f"rows_{name}"]
        for local, cols in self.inner:
            array[b, cols] = row[local]
        for r in range(self.columns.ranks):
            if r == self.columns.rank:
                for local, cols in self.edges:
                    array[b, cols] = row[local]
            dist.barrier()


def study_rank(root: str, ref: ArtifactRef, spec: TokensSpec, up: dict[str, ArtifactRef]) -> None:
    """One launched rank of a tokens artifact (``spec``: a ``tasks.specs.TokensSpec``) whose store the task's
    process has created: load the model (its weights on rank 0 only, the others on the meta device), shard it
    (:meth:`TokenStudy.build_sharded`, traced on the first batch) and run every pending batch with the other ranks,
    writing this rank's columns of the batch sums and, on rank 0, the batch's per-sample outputs and progress
    mark."""
    store, device = ArtifactStore(root), rank_device()
    ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
    model = load_rank_policy(store, up["base_model"], spec.policy, device)
    T = ro["sampler_logp"].shape[1]
    batches = batch_bounds(min(spec.settings.max_samples, ro["tokens"].shape[0]))
    first = read_batch(ro, *batches[0]).to(device)
    example = {"input_ids": first.input_ids, "attention_mask": first.attention_mask, "position_ids": first.position_ids}
    study = TokenStudy.build_sharded(model, spec.settings, T, example, spec.params, check=spec.self_check)
    g = store.open_group(ref, STORE, mode="r+")
    out = TokensStore(g, study.modes)
    rows = RankRows(g, RankColumns.of(study.layout, dist.get_world_size(), dist.get_rank()), study.layout.P)
    for b in out.pending():
        lo, hi = batches[b]
        result = study.batch(read_batch(ro, lo, hi).to(device), b, partial(rows.write, b))
        dist.barrier()  # every rank's rows of the batch are written
        if dist.get_rank() == 0:
            out.write_batch(b, lo, hi, result)
        release_free_memory()


def run_tokens_ranks(root: str, ref: ArtifactRef, spec: TokensSpec, up: dict[str, ArtifactRef]) -> None:
    """Run the pending batches of a tokens artifact on the ``ranks`` processes of ``spec.placement``
    (:func:`study_rank` in each; node 0 has created the store), placed by
    :func:`tasks.jobs.scores_ranks.rank_placement`: local gloo processes of this machine (``launcher`` local), or
    this machine's ranks of a torchrun group of ``nnodes`` machines (nccl ranks, one CUDA device each, when
    ``spec.device`` is CUDA, else gloo). The other machines' ranks pass the rendezvous once node 0's have joined,
    which node 0 starts after creating the store.

    Raises:
        covgrad.distributed.launch.RankFailedError: one line naming the first rank that failed (a rerun recomputes
            the batches not marked done).
    """
    args = (root, ref, spec, up)
    with tempfile.TemporaryDirectory(prefix="covgrad-tokens-ranks-") as tmp:
        launch_ranks(rank_placement(ref.key, spec, "tokens"), study_rank, args, tmp, RANK_ENTRY)
