"""Reading checkpoint weights as plain state dicts, in their stored dtype (storage owns the paths).

Accepted: a Hugging Face model directory (``model.safetensors``, a sharded ``model.safetensors.index.json``,
``pytorch_model.bin`` or a sharded ``pytorch_model.bin.index.json``, tried in that order, as
transformers does), or one such file given directly (``*.safetensors``, ``*.bin``/``*.pt``/``*.pth``,
``*.index.json``). ``.bin`` files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

_DIR_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


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
        for name in _DIR_FILES:
            if (root / name).is_file():
                return _load_file(root / name)
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} holds none of {', '.join(_DIR_FILES)}")
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
