"""Weight-delta traces (``trajectory.deltas``): a run as the weights it started from and, per step, the positions that
changed and their new values. Three formats, detected from the folder's contents (docs/formats.md, "Weight-delta
traces") and named in the trajectory stage's log line:

- ``grail``: ``delta_NNNNNN.pt`` files beside ``base_weights.pt`` (or a Hugging Face weights file), written by
  grail's ``DeltaCheckpointCallback`` (one-covenant/grail ``research/trl/delta_checkpoint_callback.py`` at 54d6342);
- ``trl``: ``anchors/step_NNNNNN.safetensors`` (every weight, bf16) and ``deltas/step_NNNNNN.safetensors`` (per tensor
  ``{name}.idx``, flat positions as int32 or gap-encoded uint16/uint32, and ``{name}.val``, the new bf16 values): the
  bucket weight sync of TRL's ``AsyncGRPOTrainer`` (huggingface/trl branch ``delta-weight-sync-v3`` at aa9adc3,
  ``trl/experimental/async_grpo/delta_engine.py``), version v holding the weights after trainer step v − 1;
- ``slime``: ``weight_vNNNNNN/`` version folders after ``weight_v000000/``, the Hugging Face checkpoint slime started
  from: zstd-compressed ``xor`` or ``overwrite`` byte deltas under a ``model.safetensors.index.json`` (THUDM/slime at
  624b824, ``update_weight_from_disk_delta.py``), or the ``rankRRRR_flushFFFFFF.safetensors`` files of positions and
  values (``indices``, ``deltas``, ``deltas_zstd``) slime wrote before (at 90c212b); a version that is a whole
  checkpoint replaces every weight.

:func:`delta_files` reads the file names alone, without torch (the preflight runs it); :func:`delta_trace` adds the
trace's dtype and layout name; :func:`replay_deltas` yields the weights after each step in that dtype. zstd frames are
read with numcodecs (zarr's own codec package), so no format needs an extra install.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the file checks run in the preflight, before torch loads
    import torch

    from covgrad.layout import ParamLayout, TensorEntry

# the Hugging Face weight files in transformers' order: storage.checkpoints.WEIGHT_FILES, spelt out here because that
# module imports torch (tests/faults/test_inputs_preflight.py checks that the two agree)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
GRAIL_FILE = re.compile(r"delta_(\d+)\.pt")
START_WEIGHTS = ("base_weights.pt", *WEIGHT_FILES)  # a grail trace's start weights, first found
TRL_FILE = re.compile(r"step_(\d+)\.safetensors")  # under anchors/ or deltas/
TRL_ENCODINGS = ("raw", "gap_delta")  # TRL's nvcomp_cascaded is a GPU codec
SLIME_VERSION = re.compile(r"weight_v(\d+)")
SLIME_FLUSH = re.compile(r"rank\d+_flush\d+\.safetensors")
SLIME_INDEX = "model.safetensors.index.json"
SLIME_ENCODINGS = ("xor", "overwrite")  # a version folder's index metadata delta_encoding
FLUSH_ENCODINGS = ("indices", "deltas", "deltas_zstd")  # a flush file's metadata encoding
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
TRACE_DTYPES = ("bfloat16", "float32")  # the torch dtype names a trace may replay in
STORED_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}  # safetensors codes
FOLDER_KINDS = (
    "grail delta files (delta_NNNNNN.pt), TRL async-GRPO patches (anchors/, deltas/step_NNNNNN.safetensors) or "
    "slime versions (weight_vNNNNNN/)"
)


@dataclass(frozen=True)
class DeltaFiles:
    """A delta trace's files as their names give them.

    Attributes:
        format: ``grail``, ``trl`` or ``slime``.
        start: the start weights: a file (grail's ``base_weights.pt``, TRL's first anchor) or slime's
            ``weight_v000000/`` folder.
        start_step: the trainer step the start weights are the weights after (0: before training).
        files: (s, path) for s = start_step, start_step + 1, …: path takes the weights from after step s to after
            step s + 1 (a grail file, a TRL anchor or delta, a slime version folder).
    """

    format: str
    start: Path
    start_step: int
    files: list[tuple[int, Path]]


@dataclass(frozen=True)
class DeltaTrace:
    """A delta trace ready to replay.

    Attributes:
        path: the folder.
        start: the start weights (:attr:`DeltaFiles.start`).
        files: (s, file) as :attr:`DeltaFiles.files`; record step s + 1 is file s.
        dtype: the dtype the trace replays in: its values' (grail, TRL) or its start checkpoint's (slime).
        format: ``grail``, ``trl`` or ``slime``.
        layout: the name of the stage's log line and summary: ``grail deltas``, ``trl deltas (<index encoding>)``,
            ``slime deltas (<delta encoding>)``.
        start_step: the trainer step of the start weights.
        stored: slime: tensor name -> (its dtype name, its byte count) in the start checkpoint (byte deltas apply
            only to tensors stored in ``dtype``); else empty.
    """

    path: str
    start: str
    files: tuple[tuple[int, str], ...]
    dtype: torch.dtype
    format: str
    layout: str
    start_step: int
    stored: Mapping[str, tuple[str, int]]


def delta_files(path: str) -> DeltaFiles:
    """The files of the delta trace at ``path``, its format detected from the folder's contents, read from the names
    alone (no torch: the preflight's check); ValueError in one line naming the file when the folder does not exist,
    holds no trace or two formats, two files of one step, a gap in the steps, or no start weights."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"trajectory.deltas {path!r} is not a folder of {FOLDER_KINDS}")
    entries = sorted(p.iterdir())
    present = {
        "grail": next((f.name for f in entries if GRAIL_FILE.fullmatch(f.name)), None),
        "trl": next((f"{d.name}/" for d in entries if d.name in ("anchors", "deltas") and d.is_dir()), None),
        "slime": next((f"{d.name}/" for d in entries if SLIME_VERSION.fullmatch(d.name) and d.is_dir()), None),
    }
    found = {k: v for k, v in present.items() if v is not None}
    if len(found) > 1:
        examples = ", ".join(f"{name} ({fmt})" for fmt, name in found.items())
        raise ValueError(f"trajectory.deltas {path!r} mixes delta formats: {examples}; give one run")
    if not found:
        raise ValueError(f"trajectory.deltas {path!r} holds none of {FOLDER_KINDS}")
    fmt = next(iter(found))
    return {"grail": _grail_files, "trl": _trl_files, "slime": _slime_files}[fmt](p)


def _distinct(found: list[tuple[int, Path]], what: str) -> None:
    """ValueError naming both files when two of ``found`` (sorted (number, path)) have one number."""
    for (t, a), (u, b) in zip(found, found[1:], strict=False):
        if t == u:
            raise ValueError(f"trajectory.deltas: {a} and {b} are both {what} {t}; keep one per {what}")


def _consecutive(found: list[tuple[int, Path]], first: int, name: str, note: str = "") -> None:
    """ValueError naming the first missing file when the numbers of ``found`` are not first, first + 1, …;
    ``name``: its path with ``{n}`` for the number."""
    for i, (t, _) in enumerate(found):
        if t != first + i:
            raise ValueError(
                f"trajectory.deltas: {name.format(n=first + i)} is missing (the trace holds {first}..."
                f"{found[-1][0]}); every step after the start is replayed{note}"
            )


def _grail_files(p: Path) -> DeltaFiles:
    """grail's ``delta_NNNNNN.pt`` files, steps 0, 1, …, and the start weights beside them."""
    files = sorted((int(m[1]), f) for f in p.iterdir() if (m := GRAIL_FILE.fullmatch(f.name)))
    _distinct(files, "step")
    _consecutive(files, 0, str(p / "delta_{n:06d}.pt"))
    start = next((p / n for n in START_WEIGHTS if (p / n).is_file()), None)
    if start is None:
        raise ValueError(
            f"trajectory.deltas {str(p)!r} has no start weights: save the weights training started from beside the "
            "deltas as base_weights.pt (a dict name -> tensor, as grail's README does) or model.safetensors"
        )
    return DeltaFiles("grail", start, 0, files)


def _trl_files(p: Path) -> DeltaFiles:
    """TRL's anchors and deltas by version: the first anchor is the start, every later version follows it."""
    found = sorted(
        (int(m[1]), f)
        for kind in ("anchors", "deltas")
        if (p / kind).is_dir()
        for f in (p / kind).iterdir()
        if (m := TRL_FILE.fullmatch(f.name))
    )
    if not found:
        raise ValueError(f"trajectory.deltas {str(p)!r} holds no anchors/ or deltas/step_NNNNNN.safetensors files")
    _distinct(found, "version")
    v0, first = found[0]
    if first.parent.name != "anchors":
        missing = p / "anchors" / f"step_{v0 - 1:06d}.safetensors"
        raise ValueError(
            f"trajectory.deltas {str(p)!r} has no start weights: {missing} is missing, the anchor (all weights) the "
            f"first delta {first} applies to; TRL's first sync writes anchors/step_000001.safetensors"
        )
    rest = found[1:]
    if not rest:
        raise ValueError(f"trajectory.deltas {str(p)!r} holds only the start anchor {first}; no step follows it")
    note = "; TRL writes no file for a step that changed no weight: if so, save an empty safetensors file there"
    _consecutive(rest, v0 + 1, str(p / "deltas" / "step_{n:06d}.safetensors"), note)
    return DeltaFiles("trl", first, v0 - 1, [(v - 2, f) for v, f in rest])


def _slime_files(p: Path) -> DeltaFiles:
    """slime's version folders: weight_v000000 (the start checkpoint), then versions 1, 2, … ."""
    found = sorted((int(m[1]), d) for d in p.iterdir() if d.is_dir() and (m := SLIME_VERSION.fullmatch(d.name)))
    _distinct(found, "version")
    if found[0][0] != 0 or not any((found[0][1] / n).is_file() for n in WEIGHT_FILES):
        raise ValueError(
            f"trajectory.deltas {str(p)!r} has no start weights: {p / 'weight_v000000'} is missing or holds no "
            "model.safetensors; copy there the Hugging Face checkpoint slime started from (its --hf-checkpoint)"
        )
    rest = found[1:]
    if not rest:
        raise ValueError(f"trajectory.deltas {str(p)!r} holds only the start {found[0][1]}; no version follows it")
    _consecutive(rest, 1, str(p / "weight_v{n:06d}"))
    return DeltaFiles("slime", found[0][1], 0, [(v - 1, d) for v, d in rest])


def delta_trace(path: str) -> DeltaTrace:
    """The delta trace at ``path`` (:func:`delta_files`) with its dtype and layout name; ValueError in one line naming
    the file as :func:`delta_files` does, or for a trace in another dtype than bf16 or float32."""
    files = delta_files(path)
    if files.format == "grail":
        dtype, layout, stored = _grail_dtype(files.files[0][1]), "grail deltas", {}
    elif files.format == "trl":
        dtype, stored = _checkpoint_dtype(files.start, _stored(files.start)), {}
        deltas = [f for _, f in files.files if f.parent.name == "deltas"]
        encoding = (_header(deltas[0]).get("__metadata__") or {}).get("encoding") if deltas else "anchors"
        layout = f"trl deltas ({encoding})"
    else:
        stored = _start_dtypes(files.start)
        dtype, layout = _checkpoint_dtype(files.start, stored), f"slime deltas ({_slime_encoding(files)})"
    files_ = tuple((t, str(f)) for t, f in files.files)
    return DeltaTrace(str(Path(path)), str(files.start), files_, dtype, files.format, layout, files.start_step, stored)


def _grail_dtype(first: Path) -> torch.dtype:
    """The dtype of grail file ``first``: its ``metadata.dtype``, else its values'."""
    import torch

    delta = _read_grail(first, 0)
    name = (delta.get("metadata") or {}).get("dtype")
    name = name.removeprefix("torch.") if isinstance(name, str) else None
    values = [layer.get("values") for layer in delta["layers"].values() if isinstance(layer, Mapping)]
    dtype = (
        getattr(torch, name, None) if name is not None else next((v.dtype for v in values if torch.is_tensor(v)), None)
    )
    if dtype not in [getattr(torch, n) for n in TRACE_DTYPES]:
        raise ValueError(f"{first}: values in {name or dtype}; covgrad replays bfloat16 or float32 traces")
    return dtype


def _header(file: Path | str, raw: bytes | None = None) -> dict[str, Any]:
    """The JSON header of the safetensors file ``file`` (its bytes ``raw`` when given), ``__metadata__`` included."""
    try:
        if raw is None:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                head = f.read(n)
        else:
            (n,) = struct.unpack_from("<Q", raw)
            head = raw[8 : 8 + n]
        header = json.loads(head)
    except (OSError, struct.error, ValueError) as err:
        raise ValueError(f"{file}: not a safetensors file ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors file (its header is not a JSON object)")
    return header


def _stored(file: Path) -> dict[str, tuple[str, int]]:
    """Tensor name -> (torch dtype name, else the safetensors code; byte count) of each tensor of safetensors
    ``file``."""
    out = {}
    for name, info in _header(file).items():
        if name != "__metadata__":
            try:
                begin, end = info["data_offsets"]
                out[name] = (STORED_DTYPES.get(info["dtype"], str(info["dtype"])), int(end) - int(begin))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{file}: tensor {name!r} has no dtype and data_offsets ({err})") from None
    return out


def _start_dtypes(start: Path) -> dict[str, tuple[str, int]]:
    """Tensor name -> (stored dtype name, byte count) of slime's start checkpoint folder (safetensors, sharded or
    not)."""
    if (start / SLIME_INDEX).is_file():
        try:
            shards = set(json.loads((start / SLIME_INDEX).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{start / SLIME_INDEX}: not a checkpoint index with a weight_map ({err})") from None
        return {name: kind for shard in sorted(shards) for name, kind in _stored(start / shard).items()}
    if not (start / "model.safetensors").is_file():
        raise ValueError(
            f"{start}: slime's start checkpoint must be safetensors (model.safetensors), as slime reads it"
        )
    return _stored(start / "model.safetensors")


def _checkpoint_dtype(where: Path, stored: Mapping[str, tuple[str, int]]) -> torch.dtype:
    """The dtype that holds most bytes of ``stored`` (name -> (dtype name, byte count)), bf16 or float32."""
    import torch

    if not stored:
        raise ValueError(f"{where}: holds no tensors")
    size: dict[str, int] = {}
    for dtype, nbytes in stored.values():
        size[dtype] = size.get(dtype, 0) + nbytes
    name = max(size, key=lambda d: size[d])
    if name not in TRACE_DTYPES:
        raise ValueError(f"{where}: weights in {name}; covgrad replays bfloat16 or float32 traces")
    return getattr(torch, name)


def _slime_encoding(files: DeltaFiles) -> str:
    """The delta encoding of the first slime version that has one (``full`` when every version is a checkpoint)."""
    for _, d in files.files:
        if (d / SLIME_INDEX).is_file():
            meta = _read_index(d / SLIME_INDEX).get("metadata") or {}
            if "delta_encoding" in meta:
                return str(meta["delta_encoding"])
        flushes = sorted(f for f in d.iterdir() if SLIME_FLUSH.fullmatch(f.name))
        if flushes:
            with open(flushes[0], "rb") as f:
                if f.read(4) == ZSTD_MAGIC:
                    return "deltas_zstd"
            return str((_header(flushes[0]).get("__metadata__") or {}).get("encoding"))
    return "full"


def replay_deltas(
    trace: DeltaTrace, shapes: Mapping[str, tuple[int, ...]], layout: ParamLayout, start: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """(trainer step s + 1, (P,) the selected weights after it, trace dtype) for each file s in order, from ``start``
    (P,), the start weights in the trace dtype. Each file's positions (raveled row-major in each tensor, at its
    layout offset) take its new values; an anchor or whole checkpoint replaces every weight; slime's byte deltas
    apply to the weights' bytes. Tensors outside the layout are checked and skipped. The yielded tensor is updated in
    place by the next step: use it first.

    ``shapes``: every parameter of the start model by name. ValueError in one line naming the file (and tensor) for
    a file of another kind or step than its name says, a tensor the start model lacks or holds in another shape,
    positions outside its shape, or values of another dtype or count."""
    entries = {e.name: e for e in layout.entries}
    patches = {"grail": _grail_patches, "trl": _trl_patches, "slime": _slime_patches}[trace.format]
    w = start.clone()
    for t, file in trace.files:
        for name, kind, idx, values in patches(trace, t, Path(file), shapes):
            if name in entries:
                _apply(w, entries[name], trace, f"{file}: tensor {name!r}", kind, idx, values)
        yield t + 1, w


# one change to one tensor: (name, kind, positions, values); kind "set": flat positions (nnz,) int64 and their new
# values (nnz,); "full": every value (numel,); "xor": (nbytes,) uint8 to xor into its bytes; "bytes": byte positions
# (nnz,) int64 and their new bytes (nnz,) uint8
Patch = tuple[str, str, "torch.Tensor | None", "torch.Tensor"]


def _apply(w: torch.Tensor, e: TensorEntry, trace: DeltaTrace, where: str, kind: str, idx: Any, values: Any) -> None:
    """Apply one patch to tensor ``e`` of ``w`` (P,) in place; ValueError naming ``where`` when its values are in
    another dtype than the trace replays."""
    import torch

    dtype = trace.stored[e.name][0] if kind in ("xor", "bytes") else str(values.dtype).removeprefix("torch.")
    if dtype != str(w.dtype).removeprefix("torch."):
        raise ValueError(
            f"{where} holds {dtype} values, the trace replays {w.dtype} (its start weights'); leave the tensor out of "
            "model.params"
        )
    seg = w[e.offset : e.offset + e.numel]
    if kind == "set":
        seg[idx] = values
    elif kind == "full":
        seg.copy_(values)
    elif kind == "xor":
        seg.view(torch.uint8).bitwise_xor_(values)
    else:
        seg.view(torch.uint8)[idx] = values


def _check_range(where: str, flat: torch.Tensor, shape: tuple[int, ...], nbytes: int = 0) -> None:
    """ValueError naming ``where`` and the first flat index of ``flat`` (byte position when ``nbytes`` is given)
    outside a tensor of ``shape`` (of ``nbytes`` bytes)."""
    size = nbytes or math.prod(shape)
    bad = (flat < 0) | (flat >= size)
    if bad.any():
        j = int(bad.nonzero()[0])
        unit = f"byte position {int(flat[j])}" if nbytes else f"flat index {int(flat[j])}"
        raise ValueError(
            f"{where}: {unit} is out of range for its shape {shape} ({size} {'bytes' if nbytes else 'elements'})"
        )


def _read_grail(file: Path | str, step: int) -> dict[str, Any]:
    """A grail delta file's dict, checked to be the ``values`` format of step ``step``."""
    import torch

    try:
        delta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many kinds on a foreign or truncated file
        raise ValueError(
            f"{file}: not a readable delta file ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    if not isinstance(delta, dict) or not isinstance(delta.get("layers"), dict):
        raise ValueError(f"{file}: not a grail delta file (a dict with a layers dict)")
    if delta.get("format") != "values":
        raise ValueError(
            f"{file}: format {delta.get('format')!r}; covgrad replays format 'values' (the new weights at the "
            "changed positions, grail's DeltaCheckpointCallback): differences rounded to bf16 replay inexactly"
        )
    if delta.get("step") != step:
        raise ValueError(f"{file}: its step field is {delta.get('step')!r}, its name says step {step}")
    return delta


def _grail_patches(trace: DeltaTrace, t: int, file: Path, shapes: Mapping[str, tuple[int, ...]]) -> Iterator[Patch]:
    """The patches of grail file ``t``: per layer, COO (ndim, nnz) indices raveled row-major and their values."""
    import torch

    for name, layer in _read_grail(file, t)["layers"].items():
        where = f"{file}: tensor {name!r}"
        if name not in shapes:
            raise ValueError(f"{where} is not a parameter of the start model (model.path)")
        try:
            idx, values, given = layer["indices"], layer["values"], tuple(int(n) for n in layer["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: not a delta entry with indices, values and shape ({err})") from None
        shape = tuple(shapes[name])
        if given != shape:
            raise ValueError(f"{where} has shape {given} in the delta, {shape} in the start model (model.path)")
        ok = torch.is_tensor(idx) and not idx.is_floating_point() and idx.dim() == 2 and idx.shape[0] == len(shape)
        if not ok:
            got = f"{idx.dtype} {tuple(idx.shape)}" if torch.is_tensor(idx) else type(idx).__name__
            raise ValueError(f"{where}: indices must be an integer COO tensor of shape ({len(shape)}, nnz), got {got}")
        if not torch.is_tensor(values) or values.shape != (idx.shape[1],) or values.dtype != trace.dtype:
            got = f"{values.dtype} {tuple(values.shape)}" if torch.is_tensor(values) else type(values).__name__
            raise ValueError(
                f"{where}: values must be {trace.dtype} of shape ({idx.shape[1]},) like the trace's, got {got}"
            )
        idx = idx.long()
        bad = ((idx < 0) | (idx >= torch.tensor(shape, dtype=torch.long).reshape(-1, 1))).any(0)
        if bad.any():
            j = int(bad.nonzero()[0])
            raise ValueError(f"{where}: index {idx[:, j].tolist()} is out of range for its shape {shape}")
        strides = torch.tensor([math.prod(shape[d + 1 :]) for d in range(len(shape))], dtype=torch.long)
        yield name, "set", (idx * strides.reshape(-1, 1)).sum(0), values


def _load_safetensors(file: Path | str, raw: bytes | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of safetensors ``file`` (or of its bytes ``raw``), on the CPU."""
    from safetensors.torch import load, load_file

    try:
        return load(raw) if raw is not None else load_file(str(file), device="cpu")
    except Exception as err:  # safetensors raises its own error types on a foreign or truncated file
        raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from None


def _full_patches(
    where: Path, tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], what: str
) -> Iterator[Patch]:
    """Every tensor of a whole checkpoint ``where`` (a TRL anchor, a slime checkpoint version) as a ``full`` patch,
    checked to hold each parameter of the start model in its shape."""
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise ValueError(f"{where}: the {what} lacks {len(missing)} tensors of the start model, first {missing[0]!r}")
    for name, x in tensors.items():
        if name not in shapes:
            raise ValueError(f"{where}: tensor {name!r} is not a parameter of the start model (model.path)")
        if tuple(x.shape) != tuple(shapes[name]):
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(x.shape)} in the {what}, {tuple(shapes[name])} in the "
                "start model (model.path)"
            )
        yield name, "full", None, x.reshape(-1)


def _trl_patches(trace: DeltaTrace, t: int, file: Path, shapes: Mapping[str, tuple[int, ...]]) -> Iterator[Patch]:
    """The patches of TRL version t + 2: an anchor's every tensor, or a delta's ``{name}.idx`` / ``{name}.val``
    pairs (flat positions, raw int32 or gap-encoded, and new values); an empty file is a step that changed nothing."""
    header = _header(file)
    meta = header.get("__metadata__") or {}
    if len(header) == (1 if "__metadata__" in header else 0):
        return
    anchor, version = file.parent.name == "anchors", t + 2
    if meta.get("format") != "sparse_weight_patch" or meta.get("sparse") != str(not anchor):
        raise ValueError(
            f"{file}: not a TRL {'anchor' if anchor else 'delta'} (its metadata says format {meta.get('format')!r}, "
            f"sparse {meta.get('sparse')!r}; TRL writes sparse_weight_patch, sparse {not anchor})"
        )
    if meta.get("model_version") != str(version):
        raise ValueError(f"{file}: its model_version is {meta.get('model_version')!r}, its name says {version}")
    tensors = _load_safetensors(file)
    if anchor:
        yield from _full_patches(file, tensors, shapes, "anchor")
        return
    encoding = meta.get("encoding")
    if encoding not in TRL_ENCODINGS:
        raise ValueError(
            f"{file}: index encoding {encoding!r}; covgrad decodes {' and '.join(TRL_ENCODINGS)} (nvcomp_cascaded "
            "needs nvCOMP on a GPU: sync with weight_sync_encoding='gap_delta')"
        )
    names = {k.removesuffix(".val") for k in tensors if k.endswith(".val")}
    extra = sorted(set(tensors) - {f"{n}{suffix}" for n in names for suffix in (".idx", ".val")})
    lacking = sorted(n for n in names if f"{n}.idx" not in tensors)
    if extra:
        raise ValueError(f"{file}: tensor {extra[0]!r} is not a {{name}}.idx beside a {{name}}.val")
    if lacking:
        raise ValueError(f"{file}: tensor {lacking[0]}.val has no {lacking[0]}.idx beside it")
    for name in sorted(names):
        yield _trl_delta(trace, file, name, tensors[f"{name}.idx"], tensors[f"{name}.val"], encoding, shapes)


def _trl_delta(
    trace: DeltaTrace,
    file: Path,
    name: str,
    raw: torch.Tensor,
    values: torch.Tensor,
    encoding: str,
    shapes: Mapping[str, tuple[int, ...]],
) -> Patch:
    """One tensor of a TRL delta: its positions decoded (raw int32, or gaps g_k = i_k − i_{k−1} − 1 in uint16/uint32)
    and checked against the start model's shape, its values checked to be the trace's."""
    import torch

    where = f"{file}: tensor {name!r}"
    if name not in shapes:
        raise ValueError(f"{where} is not a parameter of the start model (model.path)")
    want = (torch.int32,) if encoding == "raw" else (torch.uint16, torch.uint32)
    if raw.dim() != 1 or raw.dtype not in want:
        got = f"{raw.dtype} {tuple(raw.shape)}"
        raise ValueError(f"{where}: {encoding} indices must be 1-D {' or '.join(map(str, want))}, got {got}")
    flat = raw.long() if encoding == "raw" else torch.cumsum(raw.long() + 1, 0) - 1
    if values.shape != flat.shape or values.dtype != trace.dtype:
        raise ValueError(
            f"{where}: values must be {trace.dtype} of shape {tuple(flat.shape)}, got {values.dtype} "
            f"{tuple(values.shape)}"
        )
    _check_range(where, flat, tuple(shapes[name]))
    return name, "set", flat, values


def _unzstd(where: str, data: bytes) -> bytes:
    """The bytes of the zstd frame(s) ``data`` (numcodecs' zstd, which zarr installs)."""
    from numcodecs import Zstd

    try:
        return bytes(Zstd().decode(data))
    except Exception as err:  # numcodecs raises RuntimeError or ValueError on a foreign frame
        raise ValueError(f"{where}: not a zstd frame ({type(err).__name__}: {err})") from None


def _read_index(file: Path) -> dict[str, Any]:
    """A ``model.safetensors.index.json`` as a dict with a ``weight_map`` dict."""
    try:
        index = json.loads(file.read_text())
        ok = isinstance(index, dict) and isinstance(index.get("weight_map"), dict)
    except ValueError as err:
        raise ValueError(f"{file}: not a checkpoint index ({err})") from None
    if not ok:
        raise ValueError(f"{file}: not a checkpoint index (a JSON object with a weight_map)")
    return index


def _slime_patches(trace: DeltaTrace, t: int, folder: Path, shapes: Mapping[str, tuple[int, ...]]) -> Iterator[Patch]:
    """The patches of slime version t + 1: byte deltas under an index whose metadata names a delta encoding, flush
    files of positions and values, or a whole checkpoint; an empty folder is a version that changed nothing."""
    from storage.checkpoints import load_state_dict

    version = t + 1
    meta = {}
    if (folder / SLIME_INDEX).is_file():
        meta = _read_index(folder / SLIME_INDEX).get("metadata") or {}
    flushes = sorted(f for f in folder.iterdir() if SLIME_FLUSH.fullmatch(f.name))
    if "delta_encoding" in meta:
        yield from _slime_version(trace, folder, version, shapes)
    elif flushes:
        for file in flushes:
            yield from _slime_flush(file, version, shapes)
    elif any((folder / n).is_file() for n in WEIGHT_FILES):
        yield from _full_patches(folder, load_state_dict(folder), shapes, "checkpoint")
    elif any(folder.iterdir()):
        raise ValueError(
            f"trajectory.deltas: {folder} holds neither {SLIME_INDEX} with a delta_encoding, nor rankR_flushF."
            "safetensors files, nor a checkpoint"
        )


def _slime_version(
    trace: DeltaTrace, folder: Path, version: int, shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[Patch]:
    """A slime version of zstd byte deltas (``xor`` or ``overwrite``) under its index, checked to follow version − 1."""
    from safetensors.numpy import load_file

    index_file = folder / SLIME_INDEX
    index = _read_index(index_file)
    meta = index["metadata"]
    if (str(meta.get("version")), str(meta.get("base_version"))) != (f"{version:06d}", f"{version - 1:06d}"):
        raise ValueError(
            f"{index_file}: version {meta.get('version')!r} on base {meta.get('base_version')!r}; its folder is "
            f"version {version:06d}, on {version - 1:06d}"
        )
    encoding, compression = meta["delta_encoding"], meta.get("compression_format")
    if encoding not in SLIME_ENCODINGS or compression != "zstd":
        raise ValueError(
            f"{index_file}: delta_encoding {encoding!r}, compression_format {compression!r}; covgrad reads "
            f"{' or '.join(SLIME_ENCODINGS)} in zstd"
        )
    weight_map = index["weight_map"]
    for shard in dict.fromkeys(weight_map.values()):
        file = folder / str(shard)
        try:
            arrays = load_file(str(file))
        except Exception as err:  # safetensors raises its own error types on a foreign or truncated file
            raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from None
        for name in (n for n, s in weight_map.items() if s == shard):
            if name not in arrays:
                raise ValueError(f"{file}: holds no tensor {name!r}, which {index_file} maps to it")
            yield _slime_bytes(trace, f"{file}: tensor {name!r}", name, arrays[name].tobytes(), encoding, shapes)


def _slime_bytes(
    trace: DeltaTrace, where: str, name: str, blob: bytes, encoding: str, shapes: Mapping[str, tuple[int, ...]]
) -> Patch:
    """One tensor of a slime byte delta, decompressed: ``xor``, the tensor's bytes xor-ed with the new ones;
    ``overwrite``, a little-endian uint32 count c, c uint32 byte positions, then the c new bytes."""
    import numpy as np
    import torch

    if name not in shapes:
        raise ValueError(f"{where} is not a parameter of the start model (model.path)")
    if name not in trace.stored:
        raise ValueError(f"{where} is not in the start checkpoint {trace.start}")
    shape, (stored, nbytes) = tuple(shapes[name]), trace.stored[name]
    raw = _unzstd(where, blob)
    if encoding == "xor":
        if len(raw) != nbytes:
            raise ValueError(
                f"{where}: its xor delta has {len(raw)} bytes, the tensor {nbytes} ({stored}) in the start checkpoint"
            )
        return name, "xor", None, torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    count = struct.unpack_from("<I", raw)[0] if len(raw) >= 4 else -1
    if len(raw) != 4 + 5 * count:
        raise ValueError(
            f"{where}: an overwrite delta of {count} changed bytes has 4 + 5·{count} bytes, this {len(raw)}"
        )
    pos = torch.from_numpy(np.frombuffer(raw, "<u4", count, 4).astype(np.int64))
    _check_range(where, pos, shape, nbytes)
    return name, "bytes", pos, torch.frombuffer(bytearray(raw[4 + 4 * count :]), dtype=torch.uint8)


def _slime_flush(file: Path, version: int, shapes: Mapping[str, tuple[int, ...]]) -> Iterator[Patch]:
    """The tensors of an earlier slime flush file (whole file zstd-framed for ``deltas_zstd``): ``__positions__``, a
    byte blob, ``__values__``, and per tensor in the metadata's ``params`` its slices of both."""
    raw = file.read_bytes()
    if raw[:4] == ZSTD_MAGIC:
        raw = _unzstd(str(file), raw)
    meta = _header(file, raw).get("__metadata__") or {}
    if meta.get("encoding") not in FLUSH_ENCODINGS:
        raise ValueError(f"{file}: encoding {meta.get('encoding')!r}; slime's flush files are {FLUSH_ENCODINGS}")
    if meta.get("current_version") != str(version):
        raise ValueError(f"{file}: its current_version is {meta.get('current_version')!r}, its folder says {version}")
    tensors = _load_safetensors(file, raw)
    try:
        params = json.loads(meta["params"])
        blob, values = tensors["__positions__"].numpy().tobytes(), tensors["__values__"]
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"{file}: not a slime flush (__positions__, __values__ and params) ({err})") from None
    for p in params:
        yield _flush_param(file, p, blob, values, meta["encoding"] == "indices", shapes)


def _flush_param(
    file: Path, p: Any, blob: bytes, values: torch.Tensor, indices: bool, shapes: Mapping[str, tuple[int, ...]]
) -> Patch:
    """One tensor of a slime flush: its positions (int32, or gaps g_k = i_k − i_{k−1} − 1 in uint16/uint32 of its
    pos_width) from ``blob`` and values from ``values``, checked against the start model's shape."""
    import numpy as np
    import torch

    try:
        name, given, dtype = str(p["name"]), tuple(int(n) for n in p["shape"]), str(p["dtype"])
        pos, val, width = (
            (int(p["pos_start"]), int(p["pos_end"])),
            (int(p["val_start"]), int(p["val_end"])),
            int(p["pos_width"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{file}: a params entry is not slime's DeltaParam ({err})") from None
    where = f"{file}: tensor {name!r}"
    if name not in shapes:
        raise ValueError(f"{where} is not a parameter of the start model (model.path)")
    shape = tuple(shapes[name])
    if given != shape:
        raise ValueError(f"{where} has shape {given} in the delta, {shape} in the start model (model.path)")
    nnz = val[1] - val[0]
    fits = 0 <= val[0] <= val[1] <= values.numel() and 0 <= pos[0] <= pos[1] <= len(blob)
    if not fits or pos[1] - pos[0] != nnz * width or width not in ((4,) if indices else (2, 4)):
        raise ValueError(
            f"{where}: positions {pos[0]}:{pos[1]} (width {width}) and values {val[0]}:{val[1]} do not fit the "
            f"file's {len(blob)} position bytes and {values.numel()} values"
        )
    if dtype != str(values.dtype).removeprefix("torch."):
        raise ValueError(f"{where}: its dtype is {dtype}, the file's values {values.dtype}")
    raw = np.frombuffer(blob, {2: "<u2", 4: "<i4" if indices else "<u4"}[width], nnz, pos[0]).astype(np.int64)
    flat = torch.from_numpy(raw if indices else np.cumsum(raw + 1) - 1)
    _check_range(where, flat, shape)
    return name, "set", flat, values[val[0] : val[1]]
