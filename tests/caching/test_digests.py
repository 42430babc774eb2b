"""Content digests: a changed byte always changes the digest, even with size and mtime restored; an unchanged
file is served from the cache without being read."""

import os

import pytest

import storage.digests as digests
from storage.digests import content_digest


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COVGRAD_CACHE_DIR", str(tmp_path / "cache"))


def test_a_byte_changed_in_place_with_mtime_restored_changes_the_digest(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x00" * 4096)
    before = content_digest(f)
    st = f.stat()
    with open(f, "r+b") as h:  # same inode, same size
        h.seek(100)
        h.write(b"\x01")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert content_digest(f) != before


def test_a_directory_digest_sees_names_and_bytes(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"abc")
    first = content_digest(d)
    (d / "model.safetensors").write_bytes(b"abd")
    second = content_digest(d)
    (d / "model.safetensors").rename(d / "other.safetensors")
    assert len({first, second, content_digest(d)}) == 3


def test_an_unchanged_file_is_not_read_again(tmp_path, monkeypatch):
    f = tmp_path / "task.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    first = content_digest(f)
    monkeypatch.setattr(digests, "_hash_file", lambda p: pytest.fail(f"{p} was hashed again"))
    assert content_digest(f) == first


def test_the_digest_is_the_sha256_of_the_bytes(tmp_path):
    import hashlib

    f = tmp_path / "reward.py"
    f.write_bytes(b"def reward(p, r, a):\n    return 1.0\n")
    assert content_digest(f) == hashlib.sha256(f.read_bytes()).hexdigest()[:24]


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        content_digest(tmp_path / "nowhere.jsonl")
