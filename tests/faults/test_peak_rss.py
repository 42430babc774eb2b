"""The per-stage peak resident memory that run_stage logs and records in the marker."""

from __future__ import annotations

import mmap
import time

import psutil

from covgrad.devices import PeakRSS


def test_peak_rss_sees_a_transient_allocation():
    """64 MiB mapped, touched and unmapped inside the block (an anonymous mapping, so the pages are new whatever the
    process's heap holds) show in the peak."""
    with PeakRSS(interval=0.01) as rss:
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"\x01" * len(block))
        held = psutil.Process().memory_info().rss
        deadline = time.monotonic() + 10  # the sampler thread runs when it is scheduled: on a loaded machine, late
        while rss.peak < held and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    after = psutil.Process().memory_info().rss
    assert rss.peak - after >= 48 * 2**20
