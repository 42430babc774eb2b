"""Builders of weight-delta traces, written from the formats' documented layouts (docs/formats.md, "Weight-delta
traces"): TRL's async-GRPO anchors and deltas, slime's version folders in each encoding; a tiny two-layer net and the
one-line refusal check the delta tests share (tests/stages/test_delta_formats.py, test_external_runs.py)."""

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from numcodecs import Zstd
from torch import nn

from covgrad.layout import ParamLayout, select_parameters

Weights = list[dict[str, torch.Tensor]]  # per trainer step s = 0, 1, …: name -> the weights after step s


def one_line_error(fn, *args) -> str:
    """The one-line ValueError message ``fn(*args)`` raises."""
    with pytest.raises(ValueError) as err:
        fn(*args)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def tiny_net() -> tuple[nn.Module, ParamLayout]:
    """Two linear layers (0.weight (4, 3), 0.bias (4,), 1.weight (2, 4), 1.bias (2,)) and their layout."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return net, select_parameters(net)


def changed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(numel,) bool: the elements whose bytes differ."""
    a, b = (x.contiguous().reshape(-1).view(torch.uint8).reshape(x.numel(), -1) for x in (before, after))
    return (a != b).any(1)


def gaps(idx: np.ndarray) -> np.ndarray:
    """Ascending flat positions as gaps g_k = i_k − i_{k−1} − 1 (i_{−1} = −1), uint16 when they fit, else uint32."""
    g = np.diff(idx.astype(np.int64), prepend=-1) - 1
    return g.astype("<u2" if g.size == 0 or g.max() <= 0xFFFF else "<u4")


def trl_trace(folder: Path, weights: Weights, kinds: list[str]) -> None:
    """TRL's bucket layout (AsyncGRPOTrainer, weight_sync_backend="bucket"): version 1 (before training) an anchor;
    version s + 1 (after step s) per ``kinds[s − 1]``: ``anchor`` (every weight), or a delta of ``{name}.idx`` flat
    positions (``raw`` int32 or ``gap_delta``) and ``{name}.val`` new values; the header metadata PatchMetadata's. A
    step that moved nothing gets an empty delta (TRL writes none; covgrad's refusal of the gap asks for this)."""
    for kind in ("anchors", "deltas"):
        (folder / kind).mkdir(parents=True, exist_ok=True)
    for s, kind in enumerate(["anchor", *kinds]):
        v, meta = s + 1, {"format": "sparse_weight_patch", "version": "1", "model_version": str(s + 1)}
        if kind == "anchor":
            meta.update(sparse="False", encoding="gap_delta", num_changed_params=str(len(weights[s])))
            safetensors.torch.save_file(weights[s], folder / "anchors" / f"step_{v:06d}.safetensors", meta)
            continue
        tensors = {}
        for name, after in weights[s].items():
            idx = changed(weights[s - 1][name], after).nonzero().reshape(-1)
            if idx.numel():
                tensors[f"{name}.val"] = after.reshape(-1)[idx]
                tensors[f"{name}.idx"] = idx.int() if kind == "raw" else torch.from_numpy(gaps(idx.numpy()))
        meta.update(sparse="True", encoding=kind, num_changed_params=str(len(tensors) // 2))
        safetensors.torch.save_file(tensors, folder / "deltas" / f"step_{v:06d}.safetensors", meta)


def slime_trace(folder: Path, weights: Weights, kinds: list[str]) -> None:
    """slime's delta folder: ``weight_v000000/`` the start checkpoint, version n (after sync n) per ``kinds[n − 1]``:
    ``xor`` or ``overwrite`` (zstd byte deltas under an index, slime at 624b824), ``indices``, ``deltas`` or
    ``deltas_zstd`` (two flush files of positions and values, slime at 90c212b), ``full`` (a whole checkpoint)."""
    (folder / "weight_v000000").mkdir(parents=True)
    safetensors.torch.save_file(weights[0], folder / "weight_v000000" / "model.safetensors")
    for n, kind in enumerate(kinds, start=1):
        d = folder / f"weight_v{n:06d}"
        d.mkdir()
        if kind == "full":
            safetensors.torch.save_file(weights[n], d / "model.safetensors")
        elif kind in ("xor", "overwrite"):
            byte_version(d, n, weights[n - 1], weights[n], kind)
        else:
            flush_version(d, n, weights[n - 1], weights[n], kind)


def byte_version(d: Path, n: int, before: dict, after: dict, kind: str) -> None:
    """A version of zstd byte deltas: xor, new ^ old over the tensor's bytes; overwrite, a uint32 count c, c uint32
    byte positions, the c new bytes; one shard and the index whose metadata names the encoding."""
    blobs, sums = {}, {}
    for name in after:
        old, new = (x[name].contiguous().reshape(-1).view(torch.uint8).numpy() for x in (before, after))
        mask = old != new
        if not mask.any():
            continue
        pos = np.flatnonzero(mask).astype("<u4")
        diff = (
            old ^ new
            if kind == "xor"
            else np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), new[mask]])
        )
        blobs[name] = np.frombuffer(Zstd(level=1).encode(diff.tobytes()), np.uint8)
        sums[name] = f"{zlib.adler32(new.tobytes()):08x}"
    shard = "model-00000-of-00001.safetensors"
    if blobs:
        safetensors.numpy.save_file(blobs, d / shard, sums)
    meta = {"version": f"{n:06d}", "base_version": f"{n - 1:06d}", "delta_encoding": kind}
    meta.update(compression_format="zstd", checksum_format="adler32")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": meta, "weight_map": dict.fromkeys(blobs, shard)})
    )


def flush_version(d: Path, n: int, before: dict, after: dict, kind: str) -> None:
    """A version of the earlier flush files: the changed tensors split over two files, each a ``__positions__`` blob
    (int32 positions, or uint16/uint32 gaps), ``__values__`` and the params manifest; zstd-framed for deltas_zstd."""
    items = [(name, changed(before[name], x).nonzero().reshape(-1).numpy()) for name, x in after.items()]
    items = [(name, idx) for name, idx in items if idx.size]
    for f, part in enumerate((items[: len(items) // 2], items[len(items) // 2 :])):
        pos, values, params = b"", [], []
        for name, idx in part:
            chunk = idx.astype("<i4") if kind == "indices" else gaps(idx)
            start, nv = len(pos), sum(v.numel() for v in values)
            pos += chunk.tobytes()
            values.append(after[name].reshape(-1)[torch.from_numpy(idx)])
            shape = list(after[name].shape)
            params.append(
                {"name": name, "dtype": "bfloat16", "shape": shape, "pos_start": start, "pos_end": len(pos)}
                | {"pos_width": chunk.itemsize, "val_start": nv, "val_end": nv + idx.size}
            )
        if not part:
            continue
        tensors = {
            "__positions__": torch.frombuffer(bytearray(pos), dtype=torch.uint8),
            "__values__": torch.cat(values),
        }
        meta = {"encoding": kind, "params": json.dumps(params), "current_version": str(n), "checksum": "0"}
        blob = safetensors.torch.save(tensors, meta)
        (d / f"rank0000_flush{f:06d}.safetensors").write_bytes(
            Zstd(level=1).encode(blob) if kind == "deltas_zstd" else blob
        )
