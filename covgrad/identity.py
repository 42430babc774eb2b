"""Model identity: per-tensor digests of the weights a statistic was computed from, and the check that a
checkpoint holds those weights.

A digest is blake2b with a 16-byte output over a tensor's raw bytes in the dtype the stage held it in (the
copy on the device: a bf16 policy is hashed as bf16), recorded with the tensor's name, dtype and shape. An
identity is ``{"algorithm": ALGORITHM, "tensors": [{"name", "dtype", "shape", "digest"}, ...]}`` in
``named_parameters()`` order, which lists a tied weight once, under its first name. A checkpoint matches an
identity when every recorded tensor is in its state dict under the same name and shape and, cast to the
recorded dtype (what ``from_pretrained(dtype=...)`` does when it loads the checkpoint), has the recorded
digest. Tensors the checkpoint holds beyond the record are not compared.

Cost: one read of every weight byte (blake2b runs at about 1 GB/s on one core; docs/formats.md times it on
SmolLM2-135M).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

ALGORITHM = "blake2b-128"
_DIGEST_BYTES = 16


def tensor_digest(t: Tensor) -> str:
    """blake2b-128 (32 hex digits) of the tensor's bytes in its own dtype, row-major; any shape or device."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_identity(named: Iterable[tuple[str, Tensor]]) -> dict[str, Any]:
    """The identity of ``named`` (e.g. ``model.named_parameters()``): one record per tensor, in order."""
    tensors = [
        {"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "digest": tensor_digest(t)}
        for name, t in named
    ]
    if not tensors:
        raise ValueError("the model has no tensors to identify")
    return {"algorithm": ALGORITHM, "tensors": tensors}


def same_weights(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two identities record the same tensors: the same names, dtypes, shapes and digests, in order
    (the same weights held in the same dtype, bit for bit)."""
    if a.get("algorithm") != ALGORITHM or b.get("algorithm") != ALGORITHM:
        raise ValueError(
            f"model identity algorithms {a.get('algorithm')!r}, {b.get('algorithm')!r}: need {ALGORITHM!r}"
        )
    return a["tensors"] == b["tensors"]


def first_difference(identity: Mapping[str, Any], state: Mapping[str, Tensor]) -> str | None:
    """None when ``state`` (name -> tensor, any dtype) holds every tensor of ``identity`` with its shape and,
    cast to its recorded dtype, its digest; else a phrase naming the first recorded tensor that differs and how.
    """
    if identity.get("algorithm") != ALGORITHM:
        raise ValueError(f"model identity algorithm {identity.get('algorithm')!r} is not {ALGORITHM!r}")
    for rec in identity["tensors"]:
        name = rec["name"]
        t = state.get(name)
        if t is None:
            return f"tensor {name!r} is not in the checkpoint"
        if list(t.shape) != list(rec["shape"]):
            return f"tensor {name!r} has shape {list(t.shape)}, the statistics' weights {rec['shape']}"
        dtype = getattr(torch, rec["dtype"])
        if tensor_digest(t.detach().to(dtype)) != rec["digest"]:
            return f"tensor {name!r} differs (its {rec['dtype']} bytes hash to another digest)"
    return None


def check_identity(identity: Mapping[str, Any], state: Mapping[str, Tensor], what: str, fix: str) -> None:
    """ValueError ``{what}: {the first difference}; {fix}`` unless ``state`` holds the weights of ``identity``."""
    diff = first_difference(identity, state)
    if diff is not None:
        raise ValueError(f"{what}: {diff}; {fix}")
