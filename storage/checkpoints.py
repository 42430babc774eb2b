"""Reading checkpoint weights as plain state dicts, in their stored dtype (storage owns the paths).

Accepted: a Hugging Face model directory (``model.safetensors``, a sharded ``model.safetensors.index.json``,
``pytorch_model.bin`` or a sharded ``pytorch_model.bin.index.json``, tried in that order, as
transformers does), or one such file given directly (``*.safetensors``, ``*.bin``/``*.pt``/``*.pth``,
``*.index.json``). ``.bin`` files are read with ``torch.load(weights_only=True)``. :func:`checkpoint_dtype` reads only
safetensors headers where it can.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors.torch import load_file

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# safetensors dtype names of the floating dtypes
_SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def weights_file(directory: str | os.PathLike) -> Path | None:
    """The weight file a Hugging Face model directory is loaded from (:data:`WEIGHT_FILES`, first found), or None."""
    return next((Path(directory) / n for n in WEIGHT_FILES if (Path(directory) / n).is_file()), None)


def checkpoint_dtype(path: str | os.PathLike, names: Collection[str] | None = None) -> torch.dtype:
    """The floating dtype a checkpoint (directory or weight file) stores its tensors in (those of ``names`` that
    it holds, when it holds any), from the safetensors headers (a ``.bin`` checkpoint is loaded); ValueError
    naming the file when they are in several floating dtypes or none, FileNotFoundError as :func:`load_state_dict`."""
    root = Path(path)
    file = weights_file(root) if root.is_dir() else root
    if file is None:
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} holds none of {', '.join(WEIGHT_FILES)}")
    shards = [file]
    if file.name.endswith(".index.json"):
        shards = [file.parent / s for s in dict.fromkeys(json.loads(file.read_text())["weight_map"].values())]
    if all(s.suffix == ".safetensors" for s in shards):
        dtypes = {k: _header_dtype(h) for s in shards for k, h in _safetensors_header(s).items()}
    else:
        dtypes = {k: str(t.dtype).removeprefix("torch.") for k, t in load_state_dict(path).items()}
    if names is not None and any(n in dtypes for n in names):
        dtypes = {k: v for k, v in dtypes.items() if k in set(names)}
    floats = sorted({n for n in dtypes.values() if n in _SAFETENSORS_FLOATS.values()})
    if len(floats) != 1:
        raise ValueError(
            f"checkpoint {str(file)!r} stores its floating tensors in {floats or 'no floating dtype'}; "
            "covgrad compares a checkpoint in one stored dtype"
        )
    return getattr(torch, floats[0])


def _safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor entries (name -> {dtype, shape, data_offsets}) of a safetensors file's JSON header."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _header_dtype(entry: dict) -> str:
    """The torch name of a safetensors header entry's dtype (its own name when it is not floating)."""
    return _SAFETENSORS_FLOATS.get(entry["dtype"], entry["dtype"])


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint at ``path`` (directory or file), on CPU, in their stored dtype.

    FileNotFoundError names a missing path, a directory with none of the weight files, or a missing
    shard; ValueError names an unknown file type, a shard that lacks a tensor its index lists, or a
    tensor stored in two shards.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist")
    if root.is_dir():
        file = weights_file(root)
        if file is None:
            raise FileNotFoundError(f"checkpoint directory {str(path)!r} holds none of {', '.join(WEIGHT_FILES)}")
        return _load_file(file)
    return _load_file(root)


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    if file.name.endswith(".index.json"):
        return _load_sharded(file)
    if file.suffix == ".safetensors":
        return load_file(str(file), device="cpu")
    if file.suffix in _TORCH_SUFFIXES:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{str(file)!r} holds a {type(state).__name__}, not a state dict of tensors")
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{str(file)!r}: entry {name!r} is a {type(value).__name__}, not a tensor")
        return state
    raise ValueError(f"checkpoint file {str(file)!r} is not .safetensors, {'/'.join(_TORCH_SUFFIXES)} or *.index.json")


def _load_sharded(index_file: Path) -> dict[str, torch.Tensor]:
    """The shards an ``*.index.json`` weight_map names, merged; checks that every listed tensor arrived."""
    weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        shard_path = index_file.parent / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"shard {str(shard_path)!r} listed in {str(index_file)!r} does not exist")
        for name, tensor in _load_file(shard_path).items():
            if name in state:
                raise ValueError(f"tensor {name!r} is stored in two shards of {str(index_file)!r}")
            state[name] = tensor
    for name, shard in weight_map.items():
        if name not in state:
            raise ValueError(f"tensor {name!r} is missing from shard {shard!r} listed in {str(index_file)!r}")
    return state
