"""The scores store ``scores.zarr``: its arrays, checkpoints, block edges, per-sample rows, and its reader.

Layout (dims: sample, param, row, batch, shard, block):
- the work is split into S sample shards × K parameter blocks (whole tensors,
  :func:`covgrad.layout.split_blocks`); job (i, k) folds the batches b with b % S == i into the columns of
  block k. Each column's numbers depend only on its tensor and on the sample shard, never on the block split;
- moment state, always: ``count, mean_a, m2_a (row,)`` float64 and ``mean_s, m2_s, c_as (row, param)`` in
  the state dtype (float32 adds ``mean_s_lo``, the low half of the mean), two rows per sample shard: row
  2i + h holds shard i's samples of the prompt groups with parity h (the cross-fit). The rows are the
  accumulators of :class:`covgrad.moments.accum.MomentAccumulator`, so the store's size does not grow with the
  number of samples; a row with no samples has count 0;
- ``shard_batches (shard, block)``: batches folded into job (i, k)'s final state, written after it (-1
  until then). A job owns the state chunks that lie inside its block; the columns of a chunk that a block
  boundary cuts go to ``edges/shard{i}/block{k}/`` (the block's first and last partial chunks, concatenated)
  and :meth:`ScoresStore.finalize` copies them into place once every job is done, so no two jobs write one
  chunk;
- while a job runs, checkpoints ``ckpt/shard{i}/block{k}/n{c}/`` (the state of its block's columns, then
  ``batches`` = c written last), so a resumed job restores the newest complete checkpoint and ends with the
  same bytes as an uninterrupted run. With one block a batch is marked in ``batch_done`` once a checkpoint
  that contains it is complete; with several, ``finalize`` marks them (a batch is done only when every
  block has folded it);
- per-sample rows ``scores (sample, param)`` float32 when kept (:func:`covgrad.distributed.shardplan.keeps_rows`);
- ``kl_sum, kl_tokens (batch,)`` under sampler centering; ``advantage``, ``group (sample,)``,
  ``batch_done (batch,)``; attrs: the tensor table, centering, shards.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import dask.array as da
import numpy as np
import torch

from covgrad.layout import ParamLayout
from covgrad.moments import MomentAccumulator, Moments, sample_moments
from covgrad.scores import MuRecord
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from storage.identity import IDENTITY_ATTR
from storage.schema import SCORES as STORE
from storage.schema import annotate, create, param_chunk, write

SCALARS = ("count", "mean_a", "m2_a")
STATE = ("mean_s", "m2_s", "c_as")
MU_RECORD = {"logp": "mu_logp", "topk_ids": "mu_topk_ids", "topk_logp": "mu_topk_logp", "tail": "mu_tail"}


def column_split(a: int, b: int, chunk: int, P: int) -> tuple[slice, list[slice]]:
    """Columns [a, b) of a (row, P) array chunked by ``chunk`` along P: the part made of whole chunks
    inside [a, b) (possibly empty) and the edge parts, which share a chunk with columns outside."""
    lo = -(-a // chunk) * chunk
    hi = b if b == P else b // chunk * chunk
    if lo >= hi:
        return slice(a, a), [slice(a, b)]
    return slice(lo, hi), [e for e in (slice(a, lo), slice(hi, b)) if e.stop > e.start]


def write_state(array: Any, rows: slice, cols: slice, values: np.ndarray) -> None:
    """One block of a state array: ``array[rows, cols] = values`` (a seam for the kill-during-write test).
    An OSError that names no file (a full disk) is raised again naming the array's store path."""
    try:
        array[rows, cols] = values
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(array.store_path)) from exc


class ScoresStore:
    """The scores store of artifact ``ref``: N = ``n_samples`` samples in ``n_batches`` batches of at most
    ``batch_rows``, ``samples`` sample shards × the parameter blocks of ``block_sizes`` columns (P = their
    sum), moment state in ``state_dtype`` (without ``c_as`` unless ``comoment``: a regime fold of prompt
    groups of one size), and the per-sample rows when ``keep_rows``."""

    def __init__(
        self,
        store: ArtifactStore,
        ref: ArtifactRef,
        n_samples: int,
        n_batches: int,
        batch_rows: int,
        samples: int,
        block_sizes: Sequence[int],
        state_dtype: str,
        keep_rows: bool,
        comoment: bool = True,
    ) -> None:
        self.store, self.ref = store, ref
        self.N, self.n_batches, self.B = n_samples, n_batches, batch_rows
        self.S, self.K = samples, len(block_sizes)
        self.starts: list[int] = np.cumsum([0, *block_sizes]).tolist()  # (K + 1,) block column bounds
        self.P = self.starts[-1]
        self.state_dtype, self.keep_rows = state_dtype, keep_rows
        names = STATE if comoment else tuple(n for n in STATE if n != "c_as")
        self.state_names = names + (("mean_s_lo",) if state_dtype == "float32" else ())
        self.chunk_p = param_chunk(self.P)

    def open(self) -> Any:
        """The store's zarr group, for writing."""
        return self.store.open_group(self.ref, STORE, mode="a")

    def record_identity(self, identity: dict[str, Any]) -> None:
        """The weights' identity (``covgrad.identity.model_identity``), written by rank 0 of a sharded run before
        it shards its model, for the task's process (which never holds the weights) to finalize with."""
        self.open().attrs[IDENTITY_ATTR] = identity

    def identity(self) -> dict[str, Any]:
        """The identity :meth:`record_identity` wrote."""
        return self.open().attrs[IDENTITY_ATTR]

    def _state_arrays(self, g: Any, rows: int, P: int, scalars: bool = True) -> None:
        """Create the moment-state arrays (rows, P) in group ``g``, and the (rows,) scalars unless
        ``scalars`` is False (existing arrays are kept)."""
        for name in SCALARS if scalars else ():
            create(g, STORE, name, (rows,))
        for name in self.state_names:
            create(g, STORE, name, (rows, P), dtype=self.state_dtype)

    def prepare(self, advantage: np.ndarray, group: np.ndarray, kl: bool) -> None:
        """Create every array before any job runs, with ``advantage`` and ``group`` (N,), and the per-batch
        KL arrays when ``kl`` (idempotent: existing arrays, checkpoints and finished batches are kept)."""
        g = self.open()
        if "shard_batches" in g and g["shard_batches"].shape != (self.S, self.K):
            raise ValueError(
                f"{self.store.path(self.ref, STORE)} holds {list(g['shard_batches'].shape)} shards, not "
                f"{[self.S, self.K]}; resume with scores.shards={list(g['shard_batches'].shape)} or delete it"
            )
        self._state_arrays(g, 2 * self.S, self.P)
        create(g, STORE, "shard_batches", (self.S, self.K))
        for i in range(self.S):  # every job's groups exist before any job runs: no racing parent groups
            for k in range(self.K):
                g.require_group(f"ckpt/shard{i}/block{k}")
                if self.K > 1:
                    g.require_group(f"edges/shard{i}/block{k}")
        if self.keep_rows:
            create(g, STORE, "scores", (self.N, self.P), rows=self.B)
        if kl:
            create(g, STORE, "kl_sum", (self.n_batches,))
            create(g, STORE, "kl_tokens", (self.n_batches,))
        create(g, STORE, "advantage", (self.N,))[:] = advantage
        create(g, STORE, "group", (self.N,))[:] = group
        create_progress(g, STORE, self.n_batches)

    def job(
        self, job: tuple[int, int], acc: MomentAccumulator, batches: list[int], ranges: Sequence[tuple[int, int]]
    ) -> JobWriter:
        """The writer of ``job`` = (i, k), folding ``batches`` (indices into the [lo, hi) sample ``ranges``)
        into ``acc``, resumed from its newest complete checkpoint."""
        return JobWriter(self, job, acc, batches, ranges)

    def _ckpt_group(self, g: Any, job: tuple[int, int]) -> Any:
        return g.require_group(f"ckpt/shard{job[0]}/block{job[1]}")

    def restore(self, g: Any, job: tuple[int, int], acc: MomentAccumulator) -> int:
        """Load the job's newest complete state into ``acc``; return how many of its batches it holds."""
        folded = int(g["shard_batches"][job])
        if folded >= 0:  # the final state is complete: nothing left to fold
            self.drop_checkpoints(g, job, keep=None)
            return folded
        ck = self._ckpt_group(g, job)
        complete = [int(ck[k]["batches"][0]) for k in ck.group_keys() if "batches" in ck[k]]
        complete = [c for c in complete if c >= 0]
        if not complete:
            self.drop_checkpoints(g, job, keep=None)
            return 0
        best = max(complete)
        src = ck[f"n{best}"]
        acc.load({name: src[name][:] for name in SCALARS})
        step = self._write_step()
        for j in range(0, acc.P, step):
            cols = slice(j, min(acc.P, j + step))
            acc.load({name: src[name][:, cols] for name in self.state_names}, cols)
        self.drop_checkpoints(g, job, keep=best)
        return best

    def drop_checkpoints(self, g: Any, job: tuple[int, int], keep: int | None) -> None:
        """Delete the job's checkpoints other than ``n{keep}`` (all when keep is None)."""
        ck = self._ckpt_group(g, job)
        for name in list(ck.group_keys()):
            if name != f"n{keep}":
                del ck[name]

    def commit(
        self, g: Any, job: tuple[int, int], acc: MomentAccumulator, folded: int, final: bool, batches: list[int]
    ) -> None:
        """Checkpoint the job's state of ``folded`` batches (its final place when ``final``), mark
        ``batches`` done (with one block) and drop the older checkpoints."""
        self._save(g, job, acc, folded, final)
        if self.K == 1:
            for b in batches:
                mark_batch_done(g, b)
        self.drop_checkpoints(g, job, keep=None if final else folded)

    def _write_step(self) -> int:
        """Columns per state read/write: whole chunks, about 64 MiB of host memory per array."""
        return self.chunk_p * max(1, (1 << 23) // (2 * self.chunk_p))

    def _pieces(self, k: int) -> list[tuple[slice, slice, bool]]:
        """Where block k's final columns go: (block columns, store columns, is an edge) per piece; edge
        pieces' store columns index the block's ``edges`` arrays (its partial chunks, concatenated)."""
        a, b = self.starts[k], self.starts[k + 1]
        inner, edges = column_split(a, b, self.chunk_p, self.P)
        out = [(slice(inner.start - a, inner.stop - a), inner, False)] if inner.stop > inner.start else []
        at = 0
        for e in edges:
            width = e.stop - e.start
            out.append((slice(e.start - a, e.stop - a), slice(at, at + width), True))
            at += width
        return sorted(out, key=lambda p: p[0].start)

    def _save(self, g: Any, job: tuple[int, int], acc: MomentAccumulator, folded: int, final: bool) -> None:
        """Write the job's state (``folded`` batches) to its final place or a new checkpoint, commit record last."""
        i, k = job
        if final:
            edge_width = sum(p[1].stop - p[1].start for p in self._pieces(k) if p[2])
            edges = g[f"edges/shard{i}/block{k}"] if edge_width else None
            if edges is not None:
                self._state_arrays(edges, 2, edge_width, scalars=False)
            pieces = [
                (src, dst, edges if edge else g, slice(0, 2) if edge else slice(2 * i, 2 * i + 2))
                for src, dst, edge in self._pieces(k)
            ]
            scalars = (g, slice(2 * i, 2 * i + 2)) if k == 0 else None  # the same numbers in every block
        else:
            ck = self._ckpt_group(g, job)
            name = f"n{folded}"
            if name in ck:  # a torn attempt of an earlier run
                del ck[name]
            target = ck.create_group(name)
            self._state_arrays(target, 2, acc.P)
            pieces = [(slice(0, acc.P), slice(0, acc.P), target, slice(0, 2))]
            scalars = (target, slice(0, 2))
        if scalars is not None:
            state = acc.rows(slice(0, 0))
            for name in SCALARS:
                scalars[0][name][scalars[1]] = state[name]
        step = self._write_step()
        for src, dst, target, rows in pieces:
            for j in range(0, src.stop - src.start, step):
                width = min(step, src.stop - src.start - j)
                part = acc.rows(slice(src.start + j, src.start + j + width))
                for name in self.state_names:
                    write_state(target[name], rows, slice(dst.start + j, dst.start + j + width), part[name])
        if final:
            g["shard_batches"][i, k] = folded
        else:
            write(target, STORE, "batches", [folded])

    def _assemble_edges(self, g: Any) -> None:
        """Copy every job's edge columns into the state arrays (idempotent; one process, after all jobs)."""
        for i in range(self.S):
            for k in range(self.K):
                for src, dst, edge in self._pieces(k):
                    if edge:
                        cols = slice(self.starts[k] + src.start, self.starts[k] + src.stop)
                        for name in self.state_names:
                            g[name][2 * i : 2 * i + 2, cols] = g[f"edges/shard{i}/block{k}/{name}"][:, dst]

    def finalize(
        self,
        layout: ParamLayout,
        centering: str,
        sampler: str,
        device: str,
        dtype: str,
        extra: Callable[[], dict[str, Any]] | None = None,
    ) -> bool:
        """Once every job is done: assemble the block edges, mark the batches (several blocks), write the
        attrs (the run's ``centering``, ``sampler``, ``device`` and model ``dtype``, and what ``extra()``
        returns, e.g. the model identity) and consolidated metadata; False (and nothing written) while jobs or
        batches are pending."""
        g = self.open()
        if bool((g["shard_batches"][:] < 0).any()):
            return False
        if self.K > 1:
            self._assemble_edges(g)
            for b in pending_batches(g):
                mark_batch_done(g, b)
        if pending_batches(g):
            return False
        g.attrs.update(
            {
                "tensors": layout.to_records(),
                "centering": centering,
                "sampler": sampler,
                "n_samples": self.N,
                "n_params": self.P,
                "shards": [self.S, self.K],
                "block_starts": self.starts,
                "state_dtype": self.state_dtype,
                "per_sample_rows": self.keep_rows,
                "device": device,
                "dtype": dtype,
            }
        )
        if extra is not None:
            g.attrs.update(extra())
        if "kl_sum" in g:
            kl = float(g["kl_sum"][:].sum() / max(g["kl_tokens"][:].sum(), 1.0))
            g.attrs["kl_sampler_policy_per_token"] = kl
        annotate(g, STORE, layout)
        self.store.consolidate(self.ref, STORE)
        return True


class JobWriter:
    """The writes of job (i, k) of a :class:`ScoresStore`, a context manager.

    On creation it restores the job's newest complete state into ``acc`` (``done`` of its ``batches``;
    ``todo``: the rest), marks the restored batches (one block), and writes the empty final state of a
    job without batches. Then per folded batch :meth:`on_batch` (rows and KL) and :meth:`checkpoint`; the
    rows go through a :class:`RowWriter` that exits with the context.
    """

    def __init__(
        self,
        scores: ScoresStore,
        job: tuple[int, int],
        acc: MomentAccumulator,
        batches: list[int],
        ranges: Sequence[tuple[int, int]],
    ) -> None:
        self.scores, self.job, self.acc, self.ranges = scores, job, acc, ranges
        self.g = g = scores.open()
        self.done = scores.restore(g, job, acc)
        if scores.K == 1:
            for b in batches[: self.done]:  # folded into a complete checkpoint, perhaps killed before marking
                if g["batch_done"][b] == 0:
                    mark_batch_done(g, b)
        self.todo = batches[self.done :]
        if not batches and g["shard_batches"][job] < 0:
            scores.commit(g, job, acc, 0, final=True, batches=[])
        keep = scores.keep_rows and self.todo
        self.writer = RowWriter(g["scores"], scores.B, scores.P, acc.device) if keep else None

    def on_batch(self, b: int, rows: torch.Tensor | None, kl: tuple[float, int] | None) -> None:
        """Batch ``b`` is folded: queue its per-sample rows (when kept) and store its KL (block 0 only:
        the same numbers in every block)."""
        if self.writer is not None:
            lo, hi = self.ranges[b]
            self.writer.submit(lo, hi, rows)
        if kl is not None and self.job[1] == 0:
            self.g["kl_sum"][b], self.g["kl_tokens"][b] = kl

    def checkpoint(self, folded: int, final: bool, batches: list[int]) -> None:
        """Store the state of ``folded`` batches (see :meth:`ScoresStore.commit`) once the rows of the
        batches since the last checkpoint are written: a batch is marked done only once its rows are stored too."""
        if self.writer is not None:
            self.writer.flush()
        self.scores.commit(self.g, self.job, self.acc, folded, final, batches)

    def __enter__(self) -> JobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()


class RowWriter:
    """Writes per-sample rows (B, P) float32 to a zarr array from host buffers in a background thread.

    ``submit`` copies a batch's rows into a free host buffer (pinned, on a side CUDA stream, when the rows
    are on cuda; a plain copy on CPU) and returns at once: the zarr write runs in the thread, so the
    device never waits on storage. ``depth`` buffers bound the host memory (depth × B × P × 4 bytes);
    ``flush`` waits for every submitted write and re-raises the first failure.
    """

    def __init__(self, array: Any, B: int, P: int, device: torch.device, depth: int = 2) -> None:
        self.array = array
        cuda = device.type == "cuda"
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(depth):
            self.free.put(torch.empty((B, P), dtype=torch.float32, pin_memory=cuda))
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.jobs: queue.Queue[tuple | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="covgrad-row-writer", daemon=True)
        self.thread.start()

    def submit(self, lo: int, hi: int, rows: torch.Tensor) -> None:
        """Queue ``array[lo:hi] = rows`` for rows (hi − lo, P) float32 on any device."""
        self._raise()
        buf = self.free.get()
        host = buf[: hi - lo]
        event = None
        if self.stream is None:
            host.copy_(rows)
        else:
            main = torch.cuda.current_stream(rows.device)
            self.stream.wait_stream(main)  # the rows are complete
            with torch.cuda.stream(self.stream):
                host.copy_(rows, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            main.wait_stream(self.stream)  # the next batch overwrites the rows only after the copy
        self.jobs.put((lo, hi, buf, event))

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            lo, hi, buf, event = job
            try:
                if event is not None:
                    event.synchronize()
                if self.error is None:
                    self.array[lo:hi] = buf[: hi - lo].numpy()
            except BaseException as e:  # re-raised in the caller's thread by flush/submit
                self.error = e
            finally:
                self.free.put(buf)
                self.jobs.task_done()
        self.jobs.task_done()

    def _raise(self) -> None:
        """Re-raise the thread's failure: an OSError (a full disk) as an OSError naming the array's store
        path when the system named no file, anything else as a RuntimeError."""
        err = self.error
        if isinstance(err, OSError) and err.errno is not None:
            raise OSError(err.errno, err.strerror, err.filename or str(self.array.store_path)) from err
        if err is not None:
            raise RuntimeError(f"writing per-sample rows failed: {err}") from err

    def flush(self) -> None:
        """Wait until every submitted batch is written; raise if a write failed."""
        self.jobs.join()
        self._raise()

    def close(self) -> None:
        """Flush and stop the thread (also after a failure elsewhere: the thread never outlives the run)."""
        try:
            self.flush()
        finally:
            self.jobs.put(None)
            self.thread.join()


def mu_recorded(ro: Any) -> bool:
    """Whether the open rollouts group ``ro`` holds a record of μ (full or top-k)."""
    return MU_RECORD["logp"] in ro or MU_RECORD["topk_ids"] in ro


def read_mu(ro: Any, lo: int, hi: int) -> MuRecord:
    """The μ record of rollouts [lo, hi) of the open rollouts group ``ro`` (full log μ, a top-k record, or
    none), as CPU tensors."""
    return MuRecord(**{f: torch.from_numpy(ro[name][lo:hi]) for f, name in MU_RECORD.items() if name in ro})


def sample_counts(sc: Any) -> tuple[int, int, int]:
    """N and the samples of the even and the odd prompt-group halves of a scores group."""
    if "scores" in sc:
        parity = sc["group"][:] % 2
        return int(parity.size), int((parity == 0).sum()), int((parity == 1).sum())
    count = sc["count"][:]  # rows 2·shard + half
    return int(count.sum()), int(count[0::2].sum()), int(count[1::2].sum())


def load_moments(sc: Any, cols: slice = slice(None), halves: bool = True) -> tuple[Moments, ...]:
    """All moments of the parameters ``cols`` and, with ``halves``, those of the two prompt-group-parity
    halves (even, odd), lazily, from a scores group."""
    if "scores" in sc:
        S = da.from_zarr(sc["scores"])[:, cols]
        A = sc["advantage"][:]
        parity = sc["group"][:] % 2
        rows = S.chunks[0][0]
        parts = [sample_moments(S[parity == h], A[parity == h], block_rows=rows) for h in (0, 1)] if halves else []
        return sample_moments(S, A, block_rows=rows), *parts
    count = sc["count"][:]
    arrays = {n: da.from_zarr(sc[n])[:, cols] for n in ("mean_s", "m2_s", "c_as")}
    if "mean_s_lo" in sc:  # float32 state: the mean is an unevaluated pair hi + lo
        lo = da.from_zarr(sc["mean_s_lo"])[:, cols]
        arrays["mean_s"] = arrays["mean_s"].astype(np.float64) + lo.astype(np.float64)
    scal = {n: sc[n][:] for n in ("mean_a", "m2_a")}

    def pick(sel: np.ndarray) -> Moments:
        idx = np.flatnonzero(sel & (count > 0))
        return Moments(
            count[idx], scal["mean_a"][idx], scal["m2_a"][idx], *(arrays[n][idx] for n in ("mean_s", "m2_s", "c_as"))
        )

    r = np.arange(len(count))
    return pick(np.ones_like(r, dtype=bool)), *((pick(r % 2 == 0), pick(r % 2 == 1)) if halves else ())
