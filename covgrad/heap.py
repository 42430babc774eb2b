"""Handing freed host memory back to the system between the large phases of a batch.

glibc serves allocations below its mmap threshold from the heap, and the threshold rises to 32 MiB as soon
as one mmapped block is freed, so a model's activations (2–30 MB tensors) come from the heap and their
pages stay resident after the backward frees them. Before a large allocation that the heap cannot serve (a
tied embedding's per-sample block, mmapped) and when a stage starts (what earlier stages of the process
left), ``release_free_memory`` returns them (``malloc_trim``; a no-op without glibc; docs/memory.md has
what it saves on SmolLM2-135M). Not in a hot loop: the pages handed back are faulted in again by the next
allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``; elsewhere nothing)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
