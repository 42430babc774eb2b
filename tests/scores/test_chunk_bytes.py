"""The CPU row-chunk size of the fused reduction: four times the core's L2 cache read from sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

import covgrad.scores.blocks as blocks
from covgrad.devices import l2_cache_bytes


def _caches(root: Path, entries: list[tuple[str, str, str]]) -> Path:
    """A sysfs-like ``cache`` directory: one ``index<i>`` per (level, type, size)."""
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(value + "\n")
    return root


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (
            [("1", "Data", "48K"), ("1", "Instruction", "64K"), ("2", "Unified", "2048K"), ("3", "Unified", "480M")],
            2 << 20,
        ),
        ([("1", "Data", "32K"), ("2", "Unified", "512K")], 512 << 10),
        ([("2", "Instruction", "1M"), ("2", "Data", "1M")], 1 << 20),
        ([("1", "Data", "32K"), ("3", "Unified", "32M")], None),
        ([("2", "Unified", "lots")], None),
    ],
    ids=["xeon", "epyc", "split-l2", "no-l2", "malformed"],
)
def test_l2_cache_bytes_reads_the_level_2_data_cache(tmp_path, entries, expected):
    assert l2_cache_bytes(_caches(tmp_path / "cache", entries)) == expected


def test_l2_cache_bytes_without_sysfs(tmp_path):
    assert l2_cache_bytes(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("l2", "chunk"),
    [(512 << 10, 2 << 20), (2 << 20, 8 << 20), (128 << 10, 1 << 20), (64 << 20, 64 << 20), (None, 2 << 20)],
)
def test_default_chunk_bytes_scales_with_l2_within_bounds(monkeypatch, l2, chunk):
    monkeypatch.setattr(blocks, "l2_cache_bytes", lambda: l2)
    assert blocks.default_chunk_bytes("cpu") == chunk
    assert blocks.default_chunk_bytes("cuda") == 256 << 20
