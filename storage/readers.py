"""Read rollout records and prompt files from a local path or any fsspec URL.

``read_records`` feeds :func:`covgrad.rollouts.imports.records_to_rollouts`; ``read_prompt_file`` reads the
task prompts that generation starts from. Both stream JSONL line by line and report the file and the
1-based line number of a bad line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from covgrad.rollouts import parse_reward_fields, without_rewards

_PARQUET_BATCH_ROWS = 1024  # rows decoded at a time; bounds memory for large files


def _filesystem(path_or_url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and in-filesystem path; FileNotFoundError naming the input when it is absent."""
    fs, path = fsspec.core.url_to_fs(path_or_url)
    if not fs.isfile(path):
        raise FileNotFoundError(f"no such file: {path_or_url}")
    return fs, path


def _jsonl_objects(path_or_url: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; ValueError on a bad line or an empty file."""
    fs, path = _filesystem(path_or_url)
    found = False
    with fs.open(path, "rt", encoding="utf-8-sig") as f:  # a leading byte-order mark is skipped
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path_or_url}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path_or_url}:{lineno}: expected a JSON object; got {type(obj).__name__}")
            found = True
            yield lineno, obj
    if not found:
        raise ValueError(f"{path_or_url} is empty: it holds no JSON lines")


def _parquet_rows(path_or_url: str) -> Iterator[dict[str, Any]]:
    """Rows of a parquet file as dicts; ValueError when it is unreadable or has no rows."""
    fs, path = _filesystem(path_or_url)
    found = False
    with fs.open(path, "rb") as f:
        try:
            table = pq.ParquetFile(f)
        except pa.ArrowInvalid as err:
            raise ValueError(f"{path_or_url}: not a readable parquet file ({err})") from None
        for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                found = True
                yield row
    if not found:
        raise ValueError(f"{path_or_url} is empty: it holds no rows")


def read_records(path_or_url: str) -> Iterator[dict[str, Any]]:
    """Stream rollout records from a ``.jsonl`` or ``.parquet`` file.

    Args:
        path_or_url: local path or fsspec URL (``memory://``, ``s3://`` ...).

    Returns:
        An iterator over records (dicts), one per JSONL line or parquet row, in file order.

    Raises:
        FileNotFoundError: the file does not exist (raised here, before iteration).
        ValueError: an unsupported suffix (here); during iteration, a line that is not a JSON object
            (naming the file and line number), an unreadable parquet file, or an empty file.
    """
    name = path_or_url.rstrip("/")
    if not name.endswith((".jsonl", ".parquet")):
        raise ValueError(f"cannot read records from {path_or_url}: the name must end in .jsonl or .parquet")
    _filesystem(path_or_url)
    if name.endswith(".parquet"):
        return _parquet_rows(path_or_url)
    return (obj for _, obj in _jsonl_objects(path_or_url))


def read_located_records(path_or_url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Like :func:`read_records`, each record paired with where it is: ``file:line`` (1-based) for
    JSONL, ``file row r`` (0-based) for parquet; for error messages that point into the file."""
    records = read_records(path_or_url)
    if path_or_url.rstrip("/").endswith(".parquet"):
        return ((f"{path_or_url} row {r}", rec) for r, rec in enumerate(records))
    return ((f"{path_or_url}:{lineno}", obj) for lineno, obj in _jsonl_objects(path_or_url))


def first_record(path_or_url: str) -> tuple[str, dict[str, Any]] | None:
    """The first record of a rollouts file with where it is (:func:`read_located_records`), or None when
    nothing is at the path (the preflight names it). ValueError for an unreadable or empty file."""
    try:
        return next(iter(read_located_records(path_or_url)))
    except FileNotFoundError:
        return None


def unrewarded(cfg: Any) -> dict[str, str]:
    """The samplers of a ``PipelineConfig`` that are datasets of responses without rewards
    (``covgrad.rollouts.formats.without_rewards`` of their first record), each with where that record is; such a
    sampler has rollouts but no scores or stats (no rl analysis of it exists)."""
    out = {}
    for name, s in cfg.rollouts.samplers.items():
        if s.import_path is None or s.mu_known:
            continue
        first = first_record(s.import_path)
        options = parse_reward_fields(s.reward_fields) if s.reward_fields else {}
        if first is not None and without_rewards(s.format, first[1], options):
            out[name] = first[0]
    return out


def read_prompt_file(path: str) -> list[dict[str, Any]]:
    """Read a JSONL task file of ``{"prompt": str, "answer": ...}`` lines.

    Args:
        path: local path or fsspec URL.

    Returns:
        The line objects in file order (extra fields are kept).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line that is not a JSON object, a line without a string ``prompt``, a line whose
            ``answer`` is missing or null, or an empty file; the message names the file and line number.
    """
    prompts = []
    for lineno, obj in _jsonl_objects(path):
        if not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: the line needs a string 'prompt' field; got keys {sorted(obj)}")
        if obj.get("answer") is None:
            what = "is null" if "answer" in obj else "is missing"
            raise ValueError(
                f"{path}:{lineno}: the 'answer' field {what}; give every prompt an answer (\"\" when the reward "
                "does not use one)"
            )
        prompts.append(obj)
    return prompts


def prompt_locations(path: str) -> list[str]:
    """``file:line`` of each prompt of a JSONL task file, in the order :func:`read_prompt_file` returns them."""
    return [f"{path}:{lineno}" for lineno, _ in _jsonl_objects(path)]
