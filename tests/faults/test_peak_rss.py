"""The per-stage peak resident memory that run_stage logs and records in the marker."""

from __future__ import annotations

import time

import numpy as np
import psutil

from covgrad.devices import PeakRSS


def test_peak_rss_sees_a_transient_allocation():
    with PeakRSS(interval=0.01) as rss:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched, freed before the block ends
        held = psutil.Process().memory_info().rss
        deadline = time.monotonic() + 10  # the sampler thread runs when it is scheduled: on a loaded machine, late
        while rss.peak < held and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    after = psutil.Process().memory_info().rss
    assert rss.peak - after >= 48 * 2**20
