"""The tracker tests' shared run: the session's tiny run with an external trajectory (a Trainer series at steps
2 and 4 with a verl history), computed once per test worker and read by every tracker's writer."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xarray as xr

from storage.artifacts import ArtifactRef, ArtifactStore
from storage.stores.reports import report_numbers
from tests.helpers.histories import copied_run, external, trainer_series, write_verl
from tests.helpers.pipeline import tiny_config


@dataclass(frozen=True)
class TrackedRun:
    """``root``: the copied artifact root; ``refs``: instance -> artifact (the trajectory included); ``index``: the
    run index of those refs; ``numbers``: ``report.json``'s numbers; ``ds``: the external trajectory's dataset."""

    root: Path
    store: ArtifactStore
    refs: dict[str, ArtifactRef]
    index: dict[str, Any]
    numbers: dict[str, Any]
    ds: xr.Dataset


@pytest.fixture(scope="session")
def tracked_run(tiny_run, tmp_path_factory) -> TrackedRun:
    tmp = tmp_path_factory.mktemp("tracked")
    root = copied_run(tiny_run, tmp)
    policy = root / "base_model" / tiny_run[1]["base_model"].ref.key / "policy"
    ds, _, result = external(root, trainer_series(tmp / "run", policy), write_verl(tmp / "verl.jsonl"))
    store = ArtifactStore(tiny_config(str(root)).root)
    refs = {n: s.ref for n, s in tiny_run[1].items()} | {"trajectory": result.ref}
    index = {"artifacts": {n: {"stage": r.stage, "key": r.key} for n, r in refs.items()}}
    return TrackedRun(root, store, refs, index, report_numbers(store, refs["report"])["numbers"], ds)
