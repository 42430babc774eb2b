"""The trajectory artifact's files: per-step records, the bit-packed changed sets, resume state, checkpoints.

Layout of ``{root}/trajectory/{key}/``:

- ``trajectory.zarr`` (arrays declared in ``storage/schema.py``): ``changed`` (step, param_byte) uint8,
  step t's changed set bit-packed (``np.packbits`` over the flat parameter axis), one row per step and
  written once; ``batch_done`` (batch = step), the progress array; once every step is done, the per-step
  scalars, threshold counts, per-tensor counts, decile tables and persistence histograms as arrays over
  ``step`` (:func:`finish_store`) and the tensor table.
- ``records/step_{t:06d}.json``: step t's scalar and small-array record, written before its progress mark.
- ``state/step_{t:06d}.pt``: the newest resume state (``torch.save`` of a plain dict of tensors and ints),
  written atomically; older ones are deleted once a newer one exists, the last one when the stage ends.
- ``checkpoints/step_{t:06d}/``: Hugging Face checkpoints (model and tokenizer) at the configured steps.
- ``scratch/``: the tracker's column files while the run steps (removed before the marker).
- ``deltas/start.npy`` and ``deltas/step_{t:06d}.npy``: the run's change trace, the raw bits of the stored dtype
  (bf16: uint16, float32: uint32; numpy has no bfloat16): the start weights (P,) and, per step, the new values
  of the step's changed set in index order (its indices are the ``changed`` row). The k-step arrays
  (``dk``, ``independent``, ``jaccard_*``, ``hist_*``; :func:`write_persistence`) are computed from it.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
import torch

from covgrad.config import RegimeSection
from covgrad.layout import ParamLayout
from covgrad.rollouts import group_batches
from covgrad.updates import (
    BATCH_KEYS,
    KS,
    Cells,
    StepDelta,
    count_trace,
    persistence_tables,
)
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import TRAJECTORY as STORE
from storage.schema import annotate, create, write
from storage.stores.regimes import IMPORTED
from storage.stores.rollouts import read_batch

STATE_DIR = "state"
RECORDS_DIR = "records"
CHECKPOINTS_DIR = "checkpoints"
DELTAS_DIR = "deltas"
SCRATCH_DIR = "scratch"


def fixed_batches(ro: Any, groups_per_batch: int, r: RegimeSection | None) -> list[dict[str, torch.Tensor]]:
    """The rollouts ``ro`` as minibatches of whole prompt groups: (n, L_b) rows trimmed of trailing padding,
    with the imported per-token ``token_advantages`` (n, L) at the store's width when regime ``r`` reads them."""
    imported = r is not None and r.kind == "rl_token" and r.advantages == "imported"
    if imported and IMPORTED["advantages"] not in ro:
        raise ValueError("regime rl_token with advantages=imported: these rollouts hold no imported advantages field")
    batches = []
    for lo, hi in group_batches(ro["group"][:], groups_per_batch):
        b = read_batch(ro, lo, hi, trim=not imported)
        batch = {k: getattr(b, k) for k in BATCH_KEYS}
        if imported:
            batch["token_advantages"] = torch.from_numpy(ro[IMPORTED["advantages"]][lo:hi].astype(np.float64))
        batches.append(batch)
    return batches


def record_name(step: int) -> str:
    return f"{RECORDS_DIR}/step_{step:06d}.json"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS_DIR}/step_{step:06d}"


def rank_label(rank: int, ranks: int) -> str:
    """The name of rank ``rank`` of ``ranks``' resume states (a group of another size does not read them)."""
    return f"rank{rank}-of-{ranks}"


def column_scratch(store: ArtifactStore, ref: ArtifactRef) -> str | None:
    """Where the tracker's column files go (``covgrad.updates.columns.ColumnFiles``): ``scratch/`` of a local
    artifact, emptied first (a killed run's files are never read again; ``covgrad gc`` removes a partial artifact
    with them); None for a remote store (the system's temporary directory)."""
    if not store.local:
        return None
    d = store.path(ref, SCRATCH_DIR)
    if store.fs.exists(d):
        store.fs.rm(d, recursive=True)
    store.fs.makedirs(d, exist_ok=True)
    return d


def drop_scratch(store: ArtifactStore, ref: ArtifactRef) -> None:
    """Delete the artifact's ``scratch/`` (before its marker)."""
    d = store.path(ref, SCRATCH_DIR)
    if store.local and store.fs.exists(d):
        store.fs.rm(d, recursive=True)


def _state_name(step: int, rank: str | None = None) -> str:
    """The resume state of step ``step``: of the whole run, or of one rank's shard (``rank``: its
    :func:`rank_label`)."""
    return f"{STATE_DIR}/step_{step:06d}.pt" if rank is None else f"{STATE_DIR}/step_{step:06d}.{rank}.pt"


def create_changed(g: Any, steps: int, P: int) -> None:
    """The ``changed`` (step, param_byte) array of a ``steps``-step run over P parameters (idempotent)."""
    create(g, STORE, "changed", (steps, -(-P // 8)))


def write_step(
    store: ArtifactStore, ref: ArtifactRef, g: Any, step: int, packed: np.ndarray, values: np.ndarray, record: dict
) -> None:
    """Step ``step``'s data (from 1): its packed changed set as row step - 1, the new values of that set
    (``values``, stored-dtype bits) and its record file."""
    g["changed"][step - 1] = packed
    _write_npy(store, ref, f"{DELTAS_DIR}/step_{step:06d}.npy", values)
    store.write_json(ref, record_name(step), _plain(record))


def write_start(store: ArtifactStore, ref: ArtifactRef, bits: np.ndarray) -> None:
    """The trace's start weights (P,) as stored-dtype bits (idempotent)."""
    _write_npy(store, ref, f"{DELTAS_DIR}/start.npy", bits)


def _write_npy(store: ArtifactStore, ref: ArtifactRef, name: str, values: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(values), allow_pickle=False)
    target = store.path(ref, name)
    store.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(target, buf.getvalue())


def _read_npy(store: ArtifactStore, ref: ArtifactRef, name: str) -> np.ndarray:
    return np.load(io.BytesIO(store.fs.cat_file(store.path(ref, name))), allow_pickle=False)


def set_bits(packed: np.ndarray, P: int) -> np.ndarray:
    """(n,) int64 ascending positions of the set bits of ``packed`` ((⌈P/8⌉,) uint8, ``np.packbits`` order:
    big-endian, the trailing pad bits ignored): ``np.flatnonzero(np.unpackbits(packed, count=P))``, unpacking only
    the non-zero bytes."""
    nonzero = np.flatnonzero(packed)
    bits = np.unpackbits(packed[nonzero][:, None], axis=1).view(np.bool_)
    idx = (nonzero[:, None] * 8 + np.arange(8))[bits]
    return idx[idx < P]


def trace_reader(store: ArtifactStore, ref: ArtifactRef, g: Any, P: int) -> tuple[np.ndarray, StepDelta]:
    """The run's change trace: the start bits (P,) and ``delta(t)`` -> (changed indices (n_t,) int64, their new
    value bits (n_t,)) of step t, from the ``changed`` rows and ``deltas/`` files."""
    changed = g["changed"]

    def delta(t: int) -> tuple[np.ndarray, np.ndarray]:
        idx = set_bits(changed[t - 1], P)
        values = _read_npy(store, ref, f"{DELTAS_DIR}/step_{t:06d}.npy")
        if values.shape != idx.shape:
            raise ValueError(
                f"trajectory trace: step {t} has {idx.shape[0]} changed parameters, {values.shape[0]} values"
            )
        return idx, values

    return _read_npy(store, ref, f"{DELTAS_DIR}/start.npy"), delta


def write_persistence(store: ArtifactStore, ref: ArtifactRef, g: Any, layout: ParamLayout, steps: int) -> dict:
    """The k-step persistence arrays of a finished run from its trace (:mod:`covgrad.updates.kstep`, each step's
    delta decoded once into the artifact's ``scratch/``, removed after), written into the store; returns the
    whole-layout summary: mean d_k and mean independent_k over the windows."""
    start, delta = trace_reader(store, ref, g, layout.P)
    floats = start.view(np.float32) if start.dtype == np.uint32 else (start.astype(np.uint32) << 16).view(np.float32)
    cells = Cells.of([e.name for e in layout.entries], [e.numel for e in layout.entries], floats)
    del floats
    tables = persistence_tables(count_trace(start, delta, steps, cells, scratch=column_scratch(store, ref)), cells)
    drop_scratch(store, ref)
    write(g, STORE, "k", np.asarray(KS, dtype=np.int64), overwrite=True)
    write(g, STORE, "window", np.arange(steps, dtype=np.int64), overwrite=True)
    write(g, STORE, "kind_name", np.asarray(tables["labels_kind"], dtype=str), overwrite=True)
    for grouping, suffix in (("all", ""), ("kind", "_kind"), ("tensor", "_tensor"), ("decile", "_decile")):
        for measure in ("dk", "independent"):
            values = tables[f"{measure}_{grouping}"]
            write(g, STORE, f"{measure}{suffix}", values[..., 0] if grouping == "all" else values, overwrite=True)
        if grouping != "all":
            write(g, STORE, f"jaccard{suffix}", tables[f"jaccard_{grouping}"], overwrite=True)
            write(g, STORE, f"hist{suffix}", tables[f"hist_{grouping}"], overwrite=True)
    dk, ind = tables["dk_all"][..., 0], tables["independent_all"][..., 0]
    return {
        f"k{k}": {"dk_mean": float(np.nanmean(dk[i])), "independent_mean": float(np.nanmean(ind[i]))}
        for i, k in enumerate(KS)
        if k <= steps
    }


def read_records(store: ArtifactStore, ref: ArtifactRef, steps: int) -> list[dict]:
    """The records of steps 1..``steps``, in order."""
    return [store.read_json(ref, record_name(t)) for t in range(1, steps + 1)]


def write_state(store: ArtifactStore, ref: ArtifactRef, state: dict, rank: str | None = None) -> None:
    """Store the resume state of step ``state["step"]`` atomically (of the rank labelled ``rank``'s shard:
    ``state/step_{t}.rank{r}-of-{R}.pt``), then, for the whole run, delete the older states (a rank's go in
    :func:`drop_older_states`, once every rank has written its own)."""
    step = int(state["step"])
    target = store.path(ref, _state_name(step, rank))
    store.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    if store.local:  # torch writes the file itself: no second copy of the weights and optimizer state in memory
        torch.save(state, target + ".partial")
        store.fs.mv(target + ".partial", target)
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        store.fs.pipe_file(target, buf.getvalue())
    if rank is None:
        drop_older_states(store, ref, step)


def drop_older_states(store: ArtifactStore, ref: ArtifactRef, step: int, rank: str | None = None) -> None:
    """Delete the resume states (of rank ``rank``) other than step ``step``'s."""
    for old in _state_files(store, ref, rank):
        if not old.endswith(_state_name(step, rank)):
            store.fs.rm(old)


def state_steps(store: ArtifactStore, ref: ArtifactRef, rank: str | None = None) -> list[int]:
    """The steps of the stored resume states (of rank ``rank``), ascending."""
    return [int(re.search(r"step_(\d+)", f.rsplit("/", 1)[-1])[1]) for f in _state_files(store, ref, rank)]


def read_state(store: ArtifactStore, ref: ArtifactRef, rank: str | None = None, step: int | None = None) -> dict | None:
    """The stored resume state of step ``step`` (None: the newest; of rank ``rank``'s shard), or None."""
    steps = state_steps(store, ref, rank)
    if not steps:
        return None
    name = _state_name(steps[-1] if step is None else step, rank)
    return torch.load(io.BytesIO(store.fs.cat_file(store.path(ref, name))), weights_only=True)


def drop_state(store: ArtifactStore, ref: ArtifactRef) -> None:
    """Delete every stored resume state, the ranks' included (the stage's last write before its marker)."""
    d = store.path(ref, STATE_DIR)
    if store.fs.exists(d):
        store.fs.rm(d, recursive=True)


def _state_files(store: ArtifactStore, ref: ArtifactRef, rank: str | None = None) -> list[str]:
    """The stored states of the whole run (``rank`` None) or of one rank, by step."""
    d = store.path(ref, STATE_DIR)
    if not store.fs.exists(d):
        return []
    suffix = ".pt" if rank is None else f".{rank}.pt"
    names = [p for p in store.fs.ls(d, detail=False) if p.endswith(suffix)]
    return sorted(p for p in names if rank is not None or ".rank" not in p.rsplit("/", 1)[-1])


def finish_store(g: Any, records: list[dict], layout: ParamLayout) -> None:
    """The per-step arrays over ``step`` from the records (scalars (step,), the vectors by their second
    dim, ``persist_hist`` padded with zeros to (step, count = steps + 1)) and the tensor table."""
    K = len(records)
    for name in records[0]:
        values = [r[name] for r in records]
        if name == "persist_hist":
            table = np.zeros((K, K + 1), dtype=np.int64)
            for i, v in enumerate(values):
                table[i, : len(v)] = v
            write(g, STORE, name, table, overwrite=True)
        else:
            write(g, STORE, name, np.asarray(values, dtype=_dtype(values)), overwrite=True)
    annotate(g, STORE, layout)


def _dtype(values: list) -> type:
    """int64 for integer columns, float64 otherwise (NaN-able)."""
    flat = np.asarray(values).reshape(-1)
    return np.int64 if flat.dtype.kind in "iu" else np.float64


def _plain(record: dict) -> dict:
    """A record as JSON values: arrays to lists, numpy scalars to Python numbers."""
    return {k: v.tolist() if isinstance(v, np.ndarray | np.generic) else v for k, v in record.items()}


def write_summary(store: ArtifactStore, ref: ArtifactRef, g: Any, layout: ParamLayout, summary: dict) -> None:
    """A finished trajectory's ``summary.json``, its store's attrs (tensors and summary), consolidated."""
    store.write_json(ref, "summary.json", summary)
    g.attrs.update({"tensors": layout.to_records(), "summary": summary})
    store.consolidate(ref, STORE)
