"""scores stage: exact per-sample scores of the policy, folded on the device into O(P) moment state.

Store ``scores.zarr`` (dims: sample, param, row, batch, shard, block):
- the work is split into ``scores.shards`` = S sample shards × K parameter blocks (whole tensors,
  :func:`covgrad.layout.split_blocks`); job (i, k) folds the batches b with b % S == i into the columns of
  block k, with hooks on that block's tensors only. Each column's numbers depend only on its tensor and on
  the sample shard (the fold tiles every tensor from its own first column), never on the block split;
- moment state, always: ``count, mean_a, m2_a (row,)`` float64 and ``mean_s, m2_s, c_as (row, param)`` in
  ``scores.state_dtype`` (float32 adds ``mean_s_lo``, the low half of the mean), two rows per sample shard:
  row 2i + h holds shard i's samples of the prompt groups with parity h (the cross-fit). The rows are the
  accumulators of :class:`covgrad.accum.MomentAccumulator` (Chan-merged over the shard's batches on the
  device), so the store's size does not grow with the number of samples; a row with no samples has count 0;
- ``shard_batches (shard, block)``: batches folded into job (i, k)'s final state, written after it (-1
  until then). A job owns the state chunks that lie inside its block; the columns of a chunk that a block
  boundary cuts go to ``edges/shard{i}/block{k}/`` (the block's first and last partial chunks, concatenated)
  and ``finalize`` copies them into place once every job is done, so no two jobs write one chunk;
- while a job runs, checkpoints ``ckpt/shard{i}/block{k}/n{c}/`` (the state of its block's columns, then
  ``batches`` = c written last), every ``scores.checkpoint_batches`` batches or ``checkpoint_seconds``, so a
  resumed job restores the newest complete checkpoint, recomputes the batches after it in the same order and
  ends with the same bytes as an uninterrupted run. With one block a batch is marked in ``batch_done`` once
  a checkpoint that contains it is complete; with several, ``finalize`` marks them (a batch is done only
  when every block has folded it);
- per-sample rows ``scores (sample, param)`` float32 when N·P·4 bytes fit ``scores.byte_budget`` and there
  is one parameter block;
- ``advantage``, ``group (sample,)``, ``batch_done (batch,)``; attrs: the tensor table, centering, shards.
Batches hold whole prompt groups, so group-relative advantages and the parity split stay exact.
"""

from __future__ import annotations

import queue
import threading
import time
from functools import partial
from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.accum import MomentAccumulator
from covgrad.centering import align_full_mu, align_topk_mu, kl_sampler_policy, mask_unscored
from covgrad.layout import ParamLayout, select_parameters, split_blocks
from covgrad.persample import PerSampleGrads, score_logit_grad
from covgrad.rollout_import import require_mu_source
from covgrad.sampling import SamplerSpec, recompute_sampler_logp
from covgrad.shardplan import ModelShape, Workload, make_plan
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from storage.rollouts import read_batch
from storage.schema import ROLLOUTS, annotate, create, param_chunk, write
from storage.schema import SCORES as STORE
from tasks.common import (
    StageResult,
    device_memory,
    group_batches,
    load_models,
    pick_device,
    progress_bar,
    run_stage,
)
from tasks.specs import ScoresSpec

SCALARS = ("count", "mean_a", "m2_a")
STATE = ("mean_s", "m2_s", "c_as")


class MuSource:
    """How the sampler's μ is obtained for one rollouts store (full, top-k record, or the sampler model:
    ``mu_model`` for imported rollouts)."""

    def __init__(self, store: ArtifactStore, base: ArtifactRef, spec: ScoresSpec, ro: Any) -> None:
        s = spec.settings
        self.ro = ro
        self.kind = "full" if "mu_logp" in ro else "topk" if "mu_topk_ids" in ro else "model"
        self.spec = SamplerSpec.of(s)
        self.model = None
        self.kl: tuple[float, int] = (0.0, 0)
        if self.kind == "model":
            if s.import_path is not None:  # the store holds no top-k record: the preflight's check, again
                require_mu_source(f"rollouts.samplers.{spec.sampler}", {}, s.on_policy, s.mu_model)
            self.model = load_models(store, base, s.mu_model or s.model, spec.policy)[0]

    def dlogits_fn(self, lo: int, hi: int, tokens: torch.Tensor, pl: torch.Tensor, rl: torch.Tensor, target):
        """The logit-gradient function of batch [lo, hi) under sampler centering. Each call also
        records the batch's Σ KL(μ‖p) over scored tokens and their count in ``self.kl``."""
        L = tokens.shape[1]
        if self.kind == "full":
            fixed = align_full_mu(torch.from_numpy(self.ro["mu_logp"][lo:hi]), pl, rl, L)
        elif self.kind == "model":
            fixed = mask_unscored(recompute_sampler_logp(self.model, tokens, pl, rl, self.spec), target.bool())
        else:
            ids = torch.from_numpy(self.ro["mu_topk_ids"][lo:hi])
            logp = torch.from_numpy(self.ro["mu_topk_logp"][lo:hi])
            tail = torch.from_numpy(self.ro["mu_tail"][lo:hi])

        def fn(logits: torch.Tensor) -> torch.Tensor:
            # everything on the logits' device: no (B, L, V) tensor crosses to the host per batch
            dev, z = logits.device, logits.detach()
            if self.kind == "topk":
                mu = align_topk_mu(z.float(), *(t.to(dev) for t in (ids, logp, tail, pl, rl)))
            else:
                mu = fixed.to(dev)
            tgt = target.to(dev)
            self.kl = kl_sampler_policy(mu, z, tgt)
            return score_logit_grad(logits, tokens.to(dev), tgt, mu=mu)

        return fn


def column_split(a: int, b: int, chunk: int, P: int) -> tuple[slice, list[slice]]:
    """Columns [a, b) of a (row, P) array chunked by ``chunk`` along P: the part made of whole chunks
    inside [a, b) (possibly empty) and the edge parts, which share a chunk with columns outside."""
    lo = -(-a // chunk) * chunk
    hi = b if b == P else b // chunk * chunk
    if lo >= hi:
        return slice(a, a), [slice(a, b)]
    return slice(lo, hi), [e for e in (slice(a, lo), slice(hi, b)) if e.stop > e.start]


class ScoresJob:
    """One scores artifact as three explicit steps, so that jobs can share a store: ``prepare`` creates
    every array (once, before any job runs), ``run((i, k))`` folds the batches b with b % S == i into
    the columns of parameter block k, and ``finalize`` assembles the block edges and writes the attributes
    and consolidated metadata once every job is done. ``shards`` = (S, K) defaults to the spec's sample
    shards and blocks (``"auto"`` blocks: the fewest that fit one device like this process's,
    :func:`resolve_shards`)."""

    def __init__(
        self,
        store: ArtifactStore,
        ref: ArtifactRef,
        spec: ScoresSpec,
        up: dict[str, ArtifactRef],
        shards: tuple[int, int] | None = None,
        workers: int = 1,
    ) -> None:
        self.sampler, self.centering = spec.sampler, spec.centering
        self.store, self.ref, self.spec = store, ref, spec
        self.ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
        self.model, _ = load_models(store, up["base_model"], "policy", spec.policy)
        self.device = pick_device(spec.device)
        self.model.to(self.device).eval()
        self.layout = select_parameters(self.model, spec.params)
        self.group = self.ro["group"][:]
        self.adv = self.ro["advantage"][:]
        self.N, self.P = len(self.group), self.layout.P
        self.batches = group_batches(self.group, spec.groups_per_batch)
        self.B = max(hi - lo for lo, hi in self.batches)
        if shards is None and spec.blocks == "auto":
            shards = resolve_shards(self, workers)
        self.S, self.K = shards or (spec.sample_shards, spec.blocks)
        self.blocks: list[ParamLayout] = split_blocks(self.layout, self.K)
        self.starts = np.cumsum([0] + [blk.P for blk in self.blocks]).tolist()  # (K + 1,) block column bounds
        self.keep_rows = (
            self.K == 1
            and spec.byte_budget >= self.N * self.P * 4
            and all(hi - lo == self.B for lo, hi in self.batches[:-1])
        )
        self.state_dtype = spec.state_dtype
        self.state_names = STATE + (("mean_s_lo",) if self.state_dtype == "float32" else ())
        self.chunk_p = param_chunk(self.P)
        sampler_centered = self.centering == "sampler"
        self.mu_source = MuSource(store, up["base_model"], spec, self.ro) if sampler_centered else None

    def _state_arrays(self, g: Any, rows: int, P: int, scalars: bool = True) -> None:
        """Create the moment-state arrays (rows, P) in group ``g``, and the (rows,) scalars unless
        ``scalars`` is False (existing arrays are kept)."""
        for name in SCALARS if scalars else ():
            create(g, STORE, name, (rows,))
        for name in self.state_names:
            create(g, STORE, name, (rows, P), dtype=self.state_dtype)

    def prepare(self) -> None:
        """Create the store's arrays (idempotent: existing arrays, checkpoints and finished batches are kept)."""
        g = self.store.open_group(self.ref, STORE, mode="a")
        N, P, nb = self.N, self.P, len(self.batches)
        if "shard_batches" in g and g["shard_batches"].shape != (self.S, self.K):
            raise ValueError(
                f"{self.store.path(self.ref, STORE)} holds {list(g['shard_batches'].shape)} shards, not "
                f"{[self.S, self.K]}; resume with scores.shards={list(g['shard_batches'].shape)} or delete it"
            )

        self._state_arrays(g, 2 * self.S, P)
        create(g, STORE, "shard_batches", (self.S, self.K))
        for i in range(self.S):  # every job's groups exist before any job runs: no racing parent groups
            for k in range(self.K):
                g.require_group(f"ckpt/shard{i}/block{k}")
                if self.K > 1:
                    g.require_group(f"edges/shard{i}/block{k}")
        if self.keep_rows:
            create(g, STORE, "scores", (N, P), rows=self.B)
        if self.mu_source is not None:
            create(g, STORE, "kl_sum", (nb,))
            create(g, STORE, "kl_tokens", (nb,))
        create(g, STORE, "advantage", (N,))[:] = self.adv
        create(g, STORE, "group", (N,))[:] = self.group
        create_progress(g, STORE, nb)

    def jobs(self) -> list[tuple[int, int]]:
        """Every (sample shard, parameter block) of the artifact, sample-major."""
        return [(i, k) for i in range(self.S) for k in range(self.K)]

    def run(self, job: tuple[int, int] = (0, 0)) -> None:
        """Fold sample shard i's batches into block k's columns (``job`` = (i, k)), resuming from the
        job's newest complete checkpoint."""
        i, k = job
        if not (0 <= i < self.S and 0 <= k < self.K):
            raise ValueError(f"job {job} is not one of the {self.S} x {self.K} (sample shard, block) jobs")
        g = self.store.open_group(self.ref, STORE, mode="a")
        block = self.blocks[k]
        mine = list(range(i, len(self.batches), self.S))
        self._check_device_memory(k)
        acc = MomentAccumulator(block.P, self.device, self.state_dtype, switch_P=self.P)
        done = self._restore(g, job, acc)
        if self.K == 1:
            for b in mine[:done]:  # folded into a complete checkpoint, perhaps killed before marking
                if g["batch_done"][b] == 0:
                    mark_batch_done(g, b)
        todo = mine[done:]
        if not mine and g["shard_batches"][i, k] < 0:
            self._checkpoint(g, job, acc, 0, final=True)
        device = self.device
        psg = PerSampleGrads(self.model, block, check=self.spec.self_check)
        buffer = torch.empty((self.B, self.P), dtype=torch.float32, device=device) if self.keep_rows else None
        writer = RowWriter(g["scores"], self.B, self.P, device) if self.keep_rows and todo else None
        try:
            self._fold_batches(g, job, acc, psg, todo, done, buffer, writer)
        finally:
            if writer is not None:
                writer.close()

    def _check_device_memory(self, k: int) -> None:
        """One line instead of an out-of-memory error when block k's state cannot fit the free device memory."""
        if self.device.type != "cuda":
            return
        need = (4 if self.state_dtype == "float32" else 3) * 2 * np.dtype(self.state_dtype).itemsize * self.blocks[k].P
        free = torch.cuda.mem_get_info(self.device)[0]
        if need > free:
            raise ValueError(
                f"parameter block {k} of scores.shards={[self.S, self.K]} ({self.blocks[k].P} parameters) needs "
                f"{need / 1e9:.1f} GB of state but {self.device} has {free / 1e9:.1f} GB free; use more blocks "
                "(see `covgrad plan`) or scores.state_dtype=float32"
            )

    def _fold_batches(
        self,
        g: Any,
        job: tuple[int, int],
        acc: MomentAccumulator,
        psg: PerSampleGrads,
        todo: list[int],
        done: int,
        buffer: torch.Tensor | None,
        writer: RowWriter | None,
    ) -> None:
        """Fold batches ``todo`` of ``job`` (``done`` of its batches already in ``acc``), checkpointing."""
        ro, device, mu_source = self.ro, self.device, self.mu_source
        every, seconds = self.spec.checkpoint_batches, self.spec.checkpoint_seconds
        since: list[int] = []
        last_save = time.monotonic()
        with progress_bar(f"scores {self.sampler}/{self.centering}", len(self.batches)) as bar:
            bar.update(len(self.batches) - len(todo))
            for k, b in enumerate(todo):
                lo, hi = self.batches[b]
                batch = read_batch(ro, lo, hi, trim=False)
                tokens, target = batch.input_ids, batch.response_mask
                if mu_source is None:
                    fn = partial(score_logit_grad, input_ids=tokens.to(device), target_mask=target.to(device))
                else:
                    fn = mu_source.dlogits_fn(lo, hi, tokens, batch.prompt_len, batch.response_len, target)
                out = None if buffer is None else buffer[: hi - lo]
                psg.accumulate(
                    tokens.to(device),
                    batch.attention_mask.to(device),
                    fn,
                    acc,
                    self.adv[lo:hi],
                    self.group[lo:hi] % 2,
                    position_ids=batch.position_ids.to(device),
                    out=out,
                )
                if writer is not None:
                    writer.submit(lo, hi, out)
                if mu_source is not None and job[1] == 0:  # the same numbers in every block: written once
                    g["kl_sum"][b], g["kl_tokens"][b] = mu_source.kl
                since.append(b)
                final = k == len(todo) - 1
                if final or len(since) >= every or time.monotonic() - last_save >= seconds:
                    if writer is not None:
                        writer.flush()  # a batch is marked done only once its rows are stored too
                    self._checkpoint(g, job, acc, done + k + 1, final)
                    if self.K == 1:
                        for bb in since:
                            mark_batch_done(g, bb)
                    self._drop_checkpoints(g, job, keep=None if final else done + k + 1)
                    bar.update(len(since))
                    since, last_save = [], time.monotonic()

    def _ckpt_group(self, g: Any, job: tuple[int, int]) -> Any:
        return g.require_group(f"ckpt/shard{job[0]}/block{job[1]}")

    def _restore(self, g: Any, job: tuple[int, int], acc: MomentAccumulator) -> int:
        """Load the job's newest complete state into ``acc``; return how many of its batches it holds."""
        folded = int(g["shard_batches"][job])
        if folded >= 0:  # the final state is complete: nothing left to fold
            self._drop_checkpoints(g, job, keep=None)
            return folded
        ck = self._ckpt_group(g, job)
        complete = [int(ck[k]["batches"][0]) for k in ck.group_keys() if "batches" in ck[k]]
        complete = [c for c in complete if c >= 0]
        if not complete:
            self._drop_checkpoints(g, job, keep=None)
            return 0
        best = max(complete)
        src = ck[f"n{best}"]
        acc.load({name: src[name][:] for name in SCALARS})
        step = self._write_step()
        for j in range(0, acc.P, step):
            cols = slice(j, min(acc.P, j + step))
            acc.load({name: src[name][:, cols] for name in self.state_names}, cols)
        self._drop_checkpoints(g, job, keep=best)
        return best

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

    def _checkpoint(self, g: Any, job: tuple[int, int], acc: MomentAccumulator, folded: int, final: bool) -> None:
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
        for i, k in self.jobs():
            for src, dst, edge in self._pieces(k):
                if edge:
                    cols = slice(self.starts[k] + src.start, self.starts[k] + src.stop)
                    for name in self.state_names:
                        g[name][2 * i : 2 * i + 2, cols] = g[f"edges/shard{i}/block{k}/{name}"][:, dst]

    def _drop_checkpoints(self, g: Any, job: tuple[int, int], keep: int | None) -> None:
        """Delete the job's checkpoints other than ``n{keep}`` (all when keep is None)."""
        ck = self._ckpt_group(g, job)
        for name in list(ck.group_keys()):
            if name != f"n{keep}":
                del ck[name]

    def finalize(self) -> dict[str, Any] | None:
        """Write attrs and consolidated metadata when every batch is done; return the provenance
        (None while batches are pending)."""
        g = self.store.open_group(self.ref, STORE, mode="a")
        if bool((g["shard_batches"][:] < 0).any()):
            return None
        if self.K > 1:
            self._assemble_edges(g)
            for b in pending_batches(g):
                mark_batch_done(g, b)
        if pending_batches(g):
            return None
        g.attrs.update(
            {
                "tensors": self.layout.to_records(),
                "centering": self.centering,
                "sampler": self.sampler,
                "n_samples": self.N,
                "n_params": self.P,
                "shards": [self.S, self.K],
                "block_starts": self.starts,
                "state_dtype": self.state_dtype,
                "per_sample_rows": self.keep_rows,
                "device": str(self.device),
                "dtype": self.spec.policy.dtype,
            }
        )
        if self.mu_source is not None:
            kl = float(g["kl_sum"][:].sum() / max(g["kl_tokens"][:].sum(), 1.0))
            g.attrs["kl_sampler_policy_per_token"] = kl
        annotate(g, STORE, self.layout)
        self.store.consolidate(self.ref, STORE)
        return {"n_samples": self.N, "n_params": self.P, "per_sample_rows": self.keep_rows, "shards": [self.S, self.K]}


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
        if self.error is not None:
            raise RuntimeError(f"writing per-sample rows failed: {self.error}") from self.error

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


def write_state(array: Any, rows: slice, cols: slice, values: np.ndarray) -> None:
    """One block of a state array: ``array[rows, cols] = values`` (a seam for the kill-during-write test)."""
    array[rows, cols] = values


def resolve_shards(job: ScoresJob, workers: int) -> tuple[int, int]:
    """The spec's shards with their blocks resolved (``"auto"``: the fewest whose job fits one device like
    this process's) for a job's model and rollouts on ``workers`` such devices."""
    spec = job.spec
    work = Workload(
        B=job.B,
        L=int(job.ro["tokens"].shape[1]),
        N=job.N,
        n_batches=len(job.batches),
        state_dtype=spec.state_dtype,
        device=job.device.type,
        keep_rows=spec.byte_budget >= job.N * job.P * 4,
    )
    shards = (spec.sample_shards, spec.blocks)
    chosen = make_plan(job.layout, ModelShape.of(job.model), work, shards, workers, device_memory(job.device))
    return chosen.samples, chosen.blocks


def _compute(
    store: ArtifactStore, ref: ArtifactRef, spec: ScoresSpec, up: dict[str, ArtifactRef]
) -> dict[str, Any] | None:
    job = ScoresJob(store, ref, spec, up)
    job.prepare()
    for j in job.jobs():  # the partition of the spec's shards, one job after another in this process
        job.run(j)
    return job.finalize()


@task(name="scores")
def scores_task(ref: ArtifactRef, spec: ScoresSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Per-sample scores of the rollouts of ``spec.sampler`` under ``spec.centering``."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
