"""Where the work runs: the torch device of a device choice, its memory, whether moment state fits it, and
the peak resident memory of this process."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import threading
from pathlib import Path

import psutil
import torch

from covgrad.moments.accum import state_bytes_per_param


def pick_device(choice: str) -> torch.device:
    """The torch device of a ``model.device`` choice (``auto``: cuda when visible)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("model.device=cuda but no CUDA device is visible; use auto or cpu")
        return torch.device("cuda")
    return torch.device("cpu")


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


@functools.cache
def l2_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """Bytes of the first CPU core's level-2 cache (data or unified), from Linux sysfs' ``index*/{level,
    type,size}`` files under ``caches``; None where they are absent or unreadable (not Linux, a container
    hiding them)."""
    for index in sorted(caches.glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        found = re.fullmatch(r"(\d+)([KMG]?)", size)
        if level == "2" and kind in ("Data", "Unified") and found:
            return int(found[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[found[2]]
    return None


def device_memory(device: torch.device) -> int:
    """Bytes of memory of ``device`` (a cuda device's total; the host's RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def check_state_fits(device: torch.device, P: int, state_dtype: str, what: str, comoment: bool = True) -> None:
    """ValueError in one line, instead of an out-of-memory error, when the moment state of P parameter
    elements (two halves, ``state_dtype``, with or without the co-moment) exceeds the free memory of cuda
    ``device``; ``what`` names the parameters in the message. No check on other devices."""
    if device.type != "cuda":
        return
    need = state_bytes_per_param(state_dtype, comoment=comoment) * P
    free = torch.cuda.mem_get_info(device)[0]
    if need > free:
        raise ValueError(
            f"{what} ({P} parameters) needs {need / 1e9:.1f} GB of state but {device} has {free / 1e9:.1f} GB "
            "free; use more blocks (see `covgrad plan`) or scores.state_dtype=float32"
        )


class PeakRSS:
    """Context manager: the largest resident set size (bytes) of this process while the block runs,
    sampled every ``interval`` seconds by a daemon thread (``peak`` after exit). Work done in other
    processes (dask workers) is not included: they measure their own."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._process.memory_info().rss)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


# Host memory: Handing freed host memory back to the system between the large phases of a batch.
#
# glibc serves allocations below its mmap threshold from the heap, and the threshold rises to 32 MiB as soon
# as one mmapped block is freed, so a model's activations (2–30 MB tensors) come from the heap and their
# pages stay resident after the backward frees them. Before a large allocation that the heap cannot serve (a
# tied embedding's per-sample block, mmapped) and when a stage starts (what earlier stages of the process
# left), ``release_free_memory`` returns them (``malloc_trim``; a no-op without glibc; docs/memory.md has
# what it saves on SmolLM2-135M). Not in a hot loop: the pages handed back are faulted in again by the next
# allocations.
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
