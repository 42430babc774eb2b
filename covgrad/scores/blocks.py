"""The per-sample blocks of one pass of :class:`covgrad.scores.engine.PerSampleGrads`: where each selected
tensor's (B, numel) float32 rows are written during the backward, and when they are folded.

Without an accumulator the block of a tensor is a view of the (B, P) output rows. In the fused reduction
(an accumulator, no rows) each tensor's block is its own buffer, alive from its first contribution until its
last (modules' forward calls are counted, so tied and repeated modules are summed first), then folded into the
accumulator and its buffer pooled for the next block. A Linear or Conv1D weight with one contribution is not
even formed whole: its rule writes it in row chunks of :func:`default_chunk_bytes` into one reused buffer,
each folded while it is still in cache. Calls whose tensors all have a contribution still to come (a tied
embedding's LM-head product) are held back until one of them gets its last, so a tied embedding's (B, V, H)
block lives only from the embedding's gradient to its fold. A selection whose whole (B, P) block fits one chunk
(a small model, a selection of norms) is one chunk: every tensor's block is a view of one reused (B, P) buffer
(of the output rows when there are rows), folded at the end of the backward: in one call where the fold computes
column by column (the native kernel), tensor by tensor where it does not (a first batch's GEMMs), so that the
state's bytes do not depend on the staging.

Shape notation: B samples in the batch, P selected parameter elements, numel one tensor's elements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from covgrad.devices import l2_cache_bytes, release_free_memory
from covgrad.layout import TensorEntry
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.rules import RowAdder, Slot
from covgrad.scores.selfcheck import SelfCheck

# Bytes of one row chunk of a Linear/Conv1D weight's per-sample block in the fused reduction. CPU: four times
# the core's L2 cache (2 MiB on a 512 KiB-L2 AMD EPYC, 8 MiB on a 2 MiB-L2 Xeon), within [1, 64] MiB, so the
# fold reads each chunk while it is still cached and the GEMMs stay large (benchmarks/scores.py,
# docs/measurements.md). Accelerators: large GEMMs; the chunk only bounds the block in flight.
_CPU_CHUNK_PER_L2 = 4
_CPU_CHUNK_RANGE = (1 << 20, 64 << 20)
_CPU_CHUNK_UNKNOWN_L2 = 2 << 20
_CHUNK_BYTES_DEFAULT = 256 << 20

# Largest per-sample block buffer kept for reuse (every decoder-layer block of a ~1B model fits).
_POOL_MAX_BYTES = 256 << 20


def default_chunk_bytes(device_type: str) -> int:
    """Bytes of one row chunk of a weight's per-sample block on a device of this type ("cpu", "cuda")."""
    if device_type != "cpu":
        return _CHUNK_BYTES_DEFAULT
    l2 = l2_cache_bytes()
    if l2 is None:
        return _CPU_CHUNK_UNKNOWN_L2
    lo, hi = _CPU_CHUNK_RANGE
    return min(hi, max(lo, _CPU_CHUNK_PER_L2 * l2))


def chunk_rows(chunk_bytes: int, B: int, row: int) -> int:
    """Rows of a weight per row chunk of its (B, rows, row) float32 per-sample block: at least one."""
    return max(1, chunk_bytes // (B * row * 4))


def fits_one_chunk(B: int, P: int, chunk_bytes: int) -> bool:
    """Whether a selection's whole (B, P) float32 per-sample block fits one row chunk, which it then is."""
    return 0 < B * P * 4 <= chunk_bytes


def _smallest_fit(pool: list[Tensor], need: int, device: torch.device) -> int | None:
    """Index in ``pool`` of the smallest buffer on ``device`` with ``need`` to ``2 * need`` elements (the first of
    equal ones), or None."""
    best, at = None, None
    for i, buf in enumerate(pool):
        size = buf.numel()
        if need <= size <= 2 * need and (best is None or size < best) and buf.device == device:
            best, at = size, i
            if size == need:  # nothing smaller fits
                break
    return at


class Blocks:
    """The per-sample blocks of a :class:`~covgrad.scores.engine.PerSampleGrads`: the per-call state of its
    backward passes (what each tensor has been written and folded, the contributions still to come, the held
    calls) and the buffers reused across calls (the block pool, the row-chunk buffer).

    Per call: :meth:`begin`, then per backward :meth:`begin_target`, the rules through :meth:`run_rule` and
    :meth:`finish_target`; :meth:`end` drops the call's state.

    Attributes:
        B: the call's batch size.
        out: the (B, P) float32 rows the backward writes, or None (fused reduction without rows).
        acc: the accumulator the blocks are folded into, or None (rows only).
        check: the self-check of this backward, or None.
        written, folded: names of the tensors with a contribution written, and of those folded.
        pending: module calls per tensor whose backward contribution is still to come.
        calls: module calls per tensor in the forward (1: the block may be chunked).
        in_flight: the per-sample blocks alive in the fused reduction without rows, by tensor name.
        skipped_columns: columns of row chunks the call did not form (its accumulator keeps none of them),
            summed over its backward passes.
    """

    def __init__(self) -> None:
        self.B = 0
        self.chunk_bytes: int | None = None
        self.out: Tensor | None = None
        self.acc: MomentAccumulator | None = None
        self.check: SelfCheck | None = None
        self.written: set[str] = set()
        self.folded: set[str] = set()
        self.pending: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.chunk: Tensor | None = None  # the row-chunk buffer of the fused reduction, reused
        # Fused reduction without rows: rule calls held back until their tensors' last contribution, with the
        # tensors they write (a tied embedding's LM-head product waits for the embedding's rows).
        self.deferred: list[tuple[Callable[[], None], tuple[str, ...]]] = []
        # Row adders of a tied tensor's last contribution while the held call writes its chunks (run_rule).
        self.adders: dict[str, RowAdder] = {}
        self.in_flight: dict[str, Tensor] = {}
        # Whole-tensor (B, *shape) buffers of the row-cut tensors whose rule writes whole tensors only (not
        # marked by covgrad.scores.rules.row_parts): the block takes its rows from it once its contributions are in.
        self.whole: dict[str, Tensor] = {}
        # Flat float32 buffers of finished blocks, reused by the next ones: fresh large host allocations
        # page-fault on first touch (about as slow as the products themselves on a CPU). Buffers above
        # _POOL_MAX_BYTES (a tied embedding's block) are freed instead: kept, they would sit idle through
        # every forward and backward, when the activations peak.
        self.pool: list[Tensor] = []
        self.skipped_columns = 0
        # The (B, P) buffer of a selection that fits one chunk, reused across calls; staged: this backward uses it.
        self.stage: Tensor | None = None
        self.staged = False

    def begin(self, B: int, chunk_bytes: int | None) -> None:
        """Start a call of B samples whose row chunks are ``chunk_bytes`` long (None: the device's default)."""
        self.B, self.chunk_bytes = B, chunk_bytes
        self.skipped_columns = 0

    def count(self, name: str) -> None:
        """Count one module call of the forward that will bring a backward contribution to tensor ``name``."""
        self.pending[name] = self.pending.get(name, 0) + 1
        self.calls[name] = self.calls.get(name, 0) + 1

    def begin_target(
        self, out: Tensor | None, acc: MomentAccumulator | None, check: SelfCheck | None, calls: dict[str, int]
    ) -> None:
        """Start one backward writing ``out`` and folding into ``acc``, with the forward's module ``calls``."""
        self.out, self.acc, self.check = out, acc, check
        self.written, self.folded, self.in_flight, self.deferred = set(), set(), {}, []
        self.whole = {}
        self.pending = dict(calls)
        self.staged = (
            acc is not None
            and not getattr(acc, "aligned", False)
            and fits_one_chunk(self.B, acc.P, self._chunk_limit(acc.device))
            and (out is None or tuple(out.shape) == (self.B, acc.P))
        )
        if self.staged and out is None:
            need = self.B * acc.P
            if self.stage is None or self.stage.numel() < need or self.stage.device != acc.device:
                self.stage = torch.empty(need, dtype=torch.float32, device=acc.device)
            self.out = self.stage[:need].view(self.B, acc.P)

    def _chunk_limit(self, device: torch.device) -> int:
        """Bytes of one row chunk in this call: its ``chunk_bytes``, else the device's default. The one-chunk test
        uses the layout's P, also for a rank's :class:`covgrad.distributed.fsdp.ShardAccumulator`, which then
        forms the one chunk as the single-process run does and folds its columns of it (an ``aligned`` one forms
        only its own rows and is never staged)."""
        return default_chunk_bytes(device.type) if self.chunk_bytes is None else self.chunk_bytes

    def finish_target(self, entries: tuple[TensorEntry, ...] | list[TensorEntry]) -> None:
        """End one backward: run the held calls, then give every tensor its rows (zero where the parameter does
        not reach the logits) and fold every one not folded yet."""
        self.flush_deferred(None)
        out, acc = self.out, self.acc
        for e in entries:
            if out is not None and e.name in self.whole:
                self.take_rows(e)
            if e.name not in self.written and out is not None:  # the parameter does not reach the logits
                out[:, e.offset : e.offset + e.numel].zero_()
            if acc is not None and e.name not in self.folded and not self.staged:  # not reached, or no backward
                self.fold(e)
        if self.staged:  # the selection's one chunk: one fold where its bytes are those of a fold per tensor
            whole = acc.by_column()
            if whole:
                acc.fold(0, out)
            for e in entries:
                block = out[:, e.offset : e.offset + e.numel]
                if not whole:
                    acc.fold(e.offset, block)
                if self.check is not None:
                    self.check.compare(e, block)

    def end(self) -> None:
        """Drop the call's state (the pool and the row-chunk buffer stay)."""
        self.out, self.acc, self.check = None, None, None
        self.written, self.folded, self.pending, self.in_flight = set(), set(), {}, {}
        self.calls, self.whole = {}, {}
        self.deferred = []
        self.staged = False

    def block(self, entry: TensorEntry) -> Tensor:
        """The (B, numel) float32 per-sample block of ``entry``: a view of the output rows, or its own
        buffer while it is in flight (fused reduction without rows)."""
        if self.out is not None:
            return self.out[:, entry.offset : entry.offset + entry.numel]
        block = self.in_flight.get(entry.name)
        if block is None:
            need = self.B * entry.numel
            # the smallest pooled buffer that holds the block without wasting more than its size: tensors of
            # one shape (every decoder layer's) reuse each other's buffers, and a small block never pins a
            # buffer sized for the embedding (B × V × H floats, GBs for a real vocabulary)
            fit = _smallest_fit(self.pool, need, self.acc.device)
            if fit is not None:
                buf = self.pool.pop(fit)
            else:
                if need * 4 > _POOL_MAX_BYTES:  # a tied embedding's block: the heap's free pages go back first
                    release_free_memory()
                buf = torch.empty(need, dtype=torch.float32, device=self.acc.device)
            block = buf[:need].view(self.B, entry.numel)
            self.in_flight[entry.name] = block
        return block

    def tap_view(self, entry: TensorEntry) -> tuple[Tensor, bool]:
        """``entry``'s (B, *shape) block for an op-level contribution and whether it is the first (write)."""
        first = entry.name not in self.written
        self.written.add(entry.name)
        return self.block(entry).view(self.B, *entry.shape), first

    def fold(self, entry: TensorEntry) -> None:
        """Fold ``entry``'s finished block into the accumulator and release it."""
        block = self.block(entry)
        if entry.name in self.whole:
            self.take_rows(entry)
        elif entry.name not in self.written:
            block.zero_()
        self.acc.fold(entry.offset, block)
        if self.check is not None:
            self.check.compare(entry, block)
        if entry.name in self.in_flight:
            buf = self.in_flight.pop(entry.name)._base
            if buf.numel() * buf.element_size() <= _POOL_MAX_BYTES:
                self.pool.append(buf)
        self.folded.add(entry.name)

    def whole_view(self, entry: TensorEntry) -> Tensor:
        """The (B, *full shape) float32 buffer of a row-cut tensor whose rule writes whole tensors."""
        buf = self.whole.get(entry.name)
        if buf is None:
            buf = torch.empty(self.B, *entry.full_shape, dtype=torch.float32, device=self._device())
            self.whole[entry.name] = buf
        return buf

    def take_rows(self, entry: TensorEntry) -> None:
        """Copy the entry's rows of its whole-tensor buffer into its block and drop the buffer."""
        r0, r1 = entry.rows
        self.block(entry).view(self.B, *entry.shape).copy_(self.whole.pop(entry.name)[:, r0:r1])

    def _device(self) -> torch.device:
        return self.acc.device if self.acc is not None else self.out.device

    def row_chunks(self, entry: TensorEntry, n_rows: int) -> Iterator[tuple[int, int, Tensor]] | None:
        """Chunks of ``entry``'s block for its rule to write, each folded when the next is asked for (see
        :meth:`covgrad.scores.rules.Slot.rows`); None unless this is the fused reduction without rows and the
        tensor's only contribution (a tied or repeated tensor sums its contributions whole first)."""
        if self.acc is None or self.out is not None:
            return None
        if self.calls.get(entry.name) != 1 and entry.name not in self.adders:
            return None
        device = self.acc.device
        limit = self._chunk_limit(device)
        if limit <= 0:
            return None
        self.written.add(entry.name)
        B, row = self.B, entry.row_size
        per = chunk_rows(limit, B, row)
        need = B * min(per, entry.full_shape[0]) * row
        if self.chunk is None or self.chunk.numel() < need or self.chunk.device != device:
            self.chunk = torch.empty(need, dtype=torch.float32, device=device)
        return self._fold_chunks(entry, per, row)

    def _fold_chunks(self, entry: TensorEntry, per: int, row: int) -> Iterator[tuple[int, int, Tensor]]:
        """Yield views of ``per`` rows (``row`` elements each) of the chunk buffer, on the whole tensor's grid
        of chunks; fold the entry's rows of each (all of them, or a row-cut tensor's rows only: its first and
        last chunks are computed whole, so every product is the one without the cut) into the accumulator
        once the rule has written it (and sum them for the self-check). A chunk none of whose columns the
        accumulator keeps (``wants``: a rank's :class:`covgrad.distributed.fsdp.ShardAccumulator`) is not
        yielded, so its rows are never formed: under FSDP2 each rank forms about 1/R of a chunked weight's
        block. An accumulator with ``row_spans`` (an aligned rank's) gets chunks on a grid starting at each of
        its spans instead, so it forms exactly its own rows."""
        B, check, add = self.B, self.check, self.adders.get(entry.name)
        first, end = entry.rows
        spans = self.acc.row_spans(entry.offset, first, end, row)
        if spans is None:  # the unsharded grid of the whole tensor
            grid = [(r0, min(entry.full_shape[0], r0 + per)) for r0 in range(first - first % per, end, per)]
        else:  # a rank's own rows, each span on a grid of its own (ShardAccumulator.aligned)
            grid = [(r0, min(hi, r0 + per)) for lo, hi in spans for r0 in range(lo, hi, per)]
            self.skipped_columns += (end - first - sum(r1 - r0 for r0, r1 in spans)) * row
        for r0, r1 in grid:
            a, b = max(r0, first), min(end, r1)
            at = (a - first) * row
            if not self.acc.wants(entry.offset + at, (b - a) * row):  # none of a rank's columns: not formed
                self.skipped_columns += (b - a) * row
                continue
            chunk = self.chunk[: B * (r1 - r0) * row]
            yield r0, r1, chunk.view(B, r1 - r0, *entry.shape[1:])
            if add is not None:  # a tied tensor's other contribution (run_rule)
                add(r0, r1, chunk.view(B, r1 - r0, *entry.shape[1:]))
            cols = chunk.view(B, (r1 - r0) * row)[:, (a - r0) * row : (b - r0) * row]
            self.acc.fold(entry.offset + at, cols)
            if check is not None:
                check.add(entry, at, cols)
        if check is not None:
            check.close(entry)
        self.folded.add(entry.name)

    def run_rule(
        self, apply: Callable[[], None], local: dict[str, TensorEntry], adds: Callable[[], RowAdder] | None = None
    ) -> None:
        """Run a rule (``apply``); in the fused reduction, fold every tensor whose last contribution this was.

        In the fused reduction without rows, a call none of whose tensors is complete with it (each has a
        contribution still to come: a tied or repeated module) is held back, with its saved input and output
        gradient, until one of them gets its last contribution; then the held calls run first, in their
        order, so the sums are the same as without holding. A tied embedding's (B, V, H) block thus exists
        only from the embedding's gradient (the end of the backward) to its fold, not through the whole
        backward alongside the activations and logits.

        ``adds`` (a rule marked by :func:`covgrad.scores.rules.adds_rows`) makes this call's contribution an
        adder of rows. When it is the last of a tensor's two contributions and the held one writes row chunks
        (a tied embedding: the LM head's Linear rule), each chunk the held call writes gets this call's rows
        added before it is folded, so the tensor's (B, V, H) block is never whole; each element is summed in
        the whole block's order (the LM head's product, then the positions in order), the product's chunk GEMM
        rounding its last bits as any chunked weight's does.
        """
        if self.acc is None:
            apply()
            return
        names = tuple(entry.name for entry in local.values())
        for name in names:
            self.pending[name] -= 1
        if self.out is None and all(self.pending[name] > 0 for name in names):
            self.deferred.append((apply, names))
            return
        if adds is not None and self._adds_to_chunks(local):
            (entry,) = local.values()
            self.adders[entry.name] = adds()
            try:
                self.flush_deferred(set(names))
            finally:
                del self.adders[entry.name]
            if entry.name in self.folded:  # the held call wrote it in chunks, with this call's rows added
                return
            apply()  # the held call wrote the whole block: add to it
            self.fold(entry)
            return
        self.flush_deferred(set(names))
        apply()
        if self.staged:  # the selection's one chunk is folded once, at the end
            return
        for entry in local.values():
            if self.pending[entry.name] == 0 and entry.name not in self.folded:  # chunked ones are folded
                self.fold(entry)

    def _adds_to_chunks(self, local: dict[str, TensorEntry]) -> bool:
        """Whether this call's one tensor, with this its last contribution of two, may be folded in the held
        call's row chunks with this call's rows added (fused reduction without rows)."""
        if self.acc is None or self.out is not None or len(local) != 1:
            return False
        (entry,) = local.values()
        return self.pending[entry.name] == 0 and self.calls.get(entry.name) == 2 and entry.name not in self.written

    def flush_deferred(self, names: set[str] | None) -> None:
        """Run the held-back calls that write any tensor of ``names`` (all of them when None), in order."""
        keep = []
        for apply, written in self.deferred:
            if names is None or names.intersection(written):
                apply()
            else:
                keep.append((apply, written))
        self.deferred = keep


class FoldingSlot(Slot):
    """The slot of one hooked module in a :class:`~covgrad.scores.engine.PerSampleGrads` call: whole views, and
    row chunks folded as they are written when the fused reduction allows (:meth:`Blocks.row_chunks`)."""

    def __init__(
        self, blocks: Blocks, views: Callable[[str], tuple[Tensor, bool] | None], local: dict[str, TensorEntry]
    ) -> None:
        super().__init__(views)
        self._blocks, self._local = blocks, local

    def rows(self, name: str, n_rows: int) -> Iterator[tuple[int, int, Tensor]] | None:
        entry = self._local.get(name)
        return None if entry is None else self._blocks.row_chunks(entry, n_rows)

    def first_row(self, name: str) -> int:
        entry = self._local.get(name)
        return 0 if entry is None else entry.row0
