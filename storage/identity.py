"""Where the model identity (``covgrad.identity``) of a scores artifact is kept, and how an artifact below it
(stats, masks, a trajectory's step-0 predictors) finds the identity of the weights it was computed from.

The scores stage writes the identity as the attribute :data:`IDENTITY_ATTR` of ``scores.zarr``, with the other
attributes it writes when it completes; the rollouts stage writes its sampler's as
:data:`SAMPLER_IDENTITY_ATTR` of ``rollouts.zarr`` (:func:`sampler_weights` compares the two). Artifacts below
a scores artifact reach it through their completion markers' ``upstream`` keys. Scores artifacts completed
before identities were recorded hold none: their statistics cannot be checked, and :func:`check_computed_on`
says so instead of refusing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from covgrad.identity import check_identity, same_weights
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import ROLLOUTS, SCORES

IDENTITY_ATTR = "model_identity"
SAMPLER_IDENTITY_ATTR = "sampler_identity"
"""Attribute of a generated ``rollouts.zarr``: the identity of the sampler's weights as it generated (its own
dtype). Imported rollouts and datasets have none (the engine's weights are not at hand)."""


def upstream_scores(store: ArtifactStore, key: str) -> list[ArtifactRef]:
    """The complete scores artifacts at or above the artifact with content key ``key`` (any stage), nearest
    first, through the completion markers' ``upstream`` keys; [] when ``key`` is not a complete artifact of
    ``store``."""
    start = store.find_marker(key)
    out, seen, todo = [], {key}, [] if start is None else [start]
    while todo:
        mark = todo.pop(0)
        if mark["stage"] == "scores":
            out.append(store.ref("scores", mark["key"]))
            continue
        for k in mark.get("upstream", []):
            up = store.find_marker(k) if k not in seen else None
            seen.add(k)
            if up is not None:
                todo.append(up)
    return out


def recorded_identity(store: ArtifactStore, key: str) -> tuple[ArtifactRef, dict[str, Any]] | None:
    """The nearest scores artifact at or above ``key`` that recorded a model identity, and the identity; None
    when none did (no scores upstream, or scores completed before identities were recorded)."""
    for ref in upstream_scores(store, key):
        identity = store.open_group(ref, SCORES, mode="r").attrs.get(IDENTITY_ATTR)
        if identity is not None:
            return ref, identity
    return None


def check_computed_on(
    store: ArtifactStore, key: str, state: Mapping[str, Tensor], what: str, fix: str
) -> ArtifactRef | None:
    """ValueError in one line (``what``, the first differing tensor, ``fix``) unless the statistics of the
    artifact ``key`` were computed on the weights ``state`` holds; the scores artifact checked against, or None
    when none upstream recorded one, or ``key`` is not in ``store`` (nothing to check)."""
    found = recorded_identity(store, key)
    if found is None:
        return None
    ref, identity = found
    check_identity(identity, state, f"{what} (model identity of scores {ref.key})", fix)
    return ref


def sampler_weights(store: ArtifactStore, rollouts: ArtifactRef, scores: ArtifactRef) -> str:
    """``policy`` when the sampler of ``rollouts`` generated with the very weights (names, dtypes, bytes) that
    ``scores`` scored as the policy, ``other`` when they differ, ``unknown`` when either recorded no identity
    (imported rollouts, a dataset, artifacts completed before identities were recorded)."""
    sampler = store.open_group(rollouts, ROLLOUTS, mode="r").attrs.get(SAMPLER_IDENTITY_ATTR)
    policy = store.open_group(scores, SCORES, mode="r").attrs.get(IDENTITY_ATTR)
    if sampler is None or policy is None:
        return "unknown"
    return "policy" if same_weights(sampler, policy) else "other"


def artifact_location(artifact_dir: str) -> tuple[ArtifactStore, str]:
    """The store and content key of an artifact directory ``{root}/{stage}/{key}`` on a local disk."""
    path = Path(artifact_dir).resolve()
    return ArtifactStore(str(path.parent.parent)), path.name
