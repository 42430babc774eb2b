"""Cheap checks of a model directory's weight files (no torch): a truncated or foreign file fails in
one line naming it, before any stage runs."""

from __future__ import annotations

import json
from pathlib import Path

_MAX_HEADER = 100 * 1024**2  # safetensors caps its JSON header at 100 MB


def check_safetensors(path: Path) -> None:
    """ValueError naming ``path`` unless it is a complete safetensors file.

    Reads only the 8-byte header length and the JSON header: the file must be exactly
    8 + header + the end of the last tensor's ``data_offsets`` bytes long.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"weights file {path} is truncated: {size} bytes, not even a safetensors header")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"weights file {path} is truncated or not safetensors: its header claims {n} bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ValueError(f"weights file {path} has an unreadable safetensors header") from None
    if size != 8 + n + end:
        raise ValueError(
            f"weights file {path} is truncated or damaged: {size} bytes, its header describes {8 + n + end}"
        )


def check_weights(directory: Path) -> None:
    """Check every safetensors file a model directory uses (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``); ValueError / FileNotFoundError naming the file."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        check_safetensors(single)
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"weights index {index} is not valid JSON with a weight_map") from None
        for shard in shards:
            if not (directory / shard).is_file():
                raise FileNotFoundError(f"weights shard {directory / shard} (listed in {index.name}) does not exist")
            check_safetensors(directory / shard)
