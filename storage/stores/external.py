"""External runs as the training stacks leave them: checkpoint series and weight-delta traces.

A **checkpoint series** (``trajectory.checkpoints``, :func:`checkpoint_series`) is read in one of these layouts,
detected from the folder and named in the trajectory stage's log line:

- ``manifest``: a ``manifest.json`` (``{"checkpoints": [{"step": t, "path": dir}, ...]}``, paths inside the
  manifest's folder; ``covgrad.integrations.trl.CovgradRecorder`` writes one);
- ``verl``: ``checkpoints/<project>/<experiment>/global_step_N/actor/huggingface/`` (verl writes the Hugging Face
  weights there when ``checkpoint.contents`` includes ``hf_model``; a step holding only its FSDP shards
  ``actor/model_world_size_W_rank_r.pt`` is refused with verl's merge command);
- ``trainer``: the Hugging Face Trainer's (and TRL's) ``output_dir/checkpoint-N/``, whose newest
  ``trainer_state.json`` ``log_history`` gives the learning rate, loss and gradient norm per logged step;
- ``hub``: a local copy of a Hub series, ``step-N/`` or ``[stageK-]stepN-tokensMB/`` subfolders;
- ``covgrad``: ``step_NNNNNN/`` (a trajectory artifact's ``checkpoints/``).

Every checkpoint is a Hugging Face model directory (``config.json`` and weights); a step folder without them,
two folders of one step, two layouts in one folder and manifest paths outside the series folder are refused in
one line naming the file.

A **delta trace** (``trajectory.deltas``: grail's delta files, TRL's async-GRPO anchors and deltas, slime's delta
versions) is read by :mod:`storage.stores.deltas`; :func:`delta_files`, :func:`delta_trace` and :func:`replay_deltas`
are re-exported here.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from storage.stores.deltas import WEIGHT_FILES, DeltaTrace, delta_files, delta_trace, replay_deltas

__all__ = [
    "WEIGHT_FILES",
    "CheckpointSeries",
    "DeltaTrace",
    "checkpoint_series",
    "delta_files",
    "delta_trace",
    "replay_deltas",
]

MANIFEST = "manifest.json"  # covgrad.integrations.trl writes it beside its checkpoints
TRAINER_STATE = "trainer_state.json"  # the Hugging Face Trainer's state in each checkpoint-N/

# (layout, folder-name pattern whose group 1 is the step), tried in order
STEP_FOLDERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("covgrad", re.compile(r"step_(\d+)")),
    ("hub", re.compile(r"(?:stage\d+-)?step-?(\d+)(?:-tokens\d+[KMBT]?)?")),
    ("trainer", re.compile(r"checkpoint-(\d+)")),
    ("verl", re.compile(r"global_step_?(\d+)")),
)
VERL_SHARDS = "model_world_size_*_rank_*.pt"  # a verl actor's FSDP model shards
# the trainer_state.json log_history keys read, by record column
TRAINER_LOG = {"lr": "learning_rate", "loss": "loss", "grad_norm": "grad_norm"}


@dataclass(frozen=True)
class CheckpointSeries:
    """A run's checkpoints in step order.

    Attributes:
        layout: the layout the folder was read in (module docstring).
        checkpoints: (trainer step, resolved Hugging Face model directory), ascending distinct steps.
        logged: trainer step -> {"lr", "loss", "grad_norm"} as the trainer logged them (``trainer`` layout with a
            ``trainer_state.json``; a step holds the keys its log entries had), else None.
    """

    layout: str
    checkpoints: tuple[tuple[int, str], ...]
    logged: dict[int, dict[str, float]] | None = None


def checkpoint_series(path: str) -> CheckpointSeries:
    """The checkpoint series at ``path`` (a ``manifest.json``, or a folder holding one or step folders), its
    layout detected (module docstring); ValueError in one line naming the file for a malformed series."""
    p = Path(path)
    manifest = p if p.is_file() else p / MANIFEST
    if manifest.is_file():
        layout, found = "manifest", _manifest_entries(manifest)
    elif p.is_dir():
        layout, found = _step_folders(p)
    else:
        raise ValueError(f"trajectory.checkpoints {path!r} is neither a manifest nor a folder of checkpoints")
    found.sort(key=lambda e: e[0])
    for (t, a), (u, b) in zip(found, found[1:], strict=False):
        if t == u:
            raise ValueError(f"trajectory.checkpoints: {a} and {b} are both step {t}; keep one checkpoint per step")
    for t, d in found:
        _check_checkpoint(t, d)
    checkpoints = tuple((t, str(d.resolve())) for t, d in found)
    return CheckpointSeries(layout, checkpoints, _trainer_log(found) if layout == "trainer" else None)


def _manifest_entries(manifest: Path) -> list[tuple[int, Path]]:
    """(step, checkpoint directory) of a manifest, each path inside the manifest's folder."""
    try:
        entries = [(int(e["step"]), str(e["path"])) for e in json.loads(manifest.read_text())["checkpoints"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{manifest}: not a checkpoint manifest ({err}); need checkpoints: [...]") from None
    folder = manifest.parent.absolute()
    out = []
    for t, rel in entries:
        target = Path(os.path.normpath(folder / rel))
        if not target.is_relative_to(folder):
            raise ValueError(
                f"{manifest}: checkpoint {rel!r} (step {t}) is outside the series folder {folder}; "
                "move or link it inside"
            )
        out.append((t, target))
    return out


def _step_folders(folder: Path) -> tuple[str, list[tuple[int, Path]]]:
    """The layout of a folder of step folders and its (step, checkpoint directory) pairs: a verl step's
    ``actor/huggingface``, any other step folder itself; folders of no layout are skipped."""
    found: dict[str, list[tuple[int, Path]]] = {}
    first: dict[str, str] = {}  # layout -> the name of its first step folder
    for d in sorted(folder.iterdir()):
        if not d.is_dir():
            continue
        for layout, pattern in STEP_FOLDERS:
            m = pattern.fullmatch(d.name)
            if m:
                verl = layout == "verl" and (d / "actor").is_dir()
                found.setdefault(layout, []).append((int(m[1]), d / "actor" / "huggingface" if verl else d))
                first.setdefault(layout, d.name)
                break
    if len(found) > 1:
        examples = ", ".join(f"{name} ({layout})" for layout, name in first.items())
        raise ValueError(f"trajectory.checkpoints {str(folder)!r} mixes checkpoint layouts: {examples}; give one run")
    if not found:
        names = "step_N, step-N, stepN-tokensMB, checkpoint-N, global_step_N"
        raise ValueError(f"trajectory.checkpoints {str(folder)!r} holds no {MANIFEST} and no step folders ({names})")
    return next(iter(found.items()))


def _check_checkpoint(step: int, d: Path) -> None:
    """ValueError naming the file unless ``d`` is a Hugging Face model directory with weights (a verl step that
    holds only FSDP shards: verl's merge command)."""
    if not d.is_dir() and d.name != "huggingface":
        raise ValueError(f"trajectory.checkpoints: checkpoint {d} (step {step}) does not exist")
    if _weights_file(d) is None:
        actor = d.parent
        if d.name == "huggingface" and any(actor.glob(VERL_SHARDS)):
            raise ValueError(
                f"trajectory.checkpoints: {actor} (step {step}) holds only FSDP shards ({VERL_SHARDS}); merge them "
                f"into Hugging Face weights: python -m verl.model_merger merge --backend fsdp --local_dir {actor} "
                f"--target_dir {d}"
            )
        raise ValueError(
            f"trajectory.checkpoints: checkpoint {d} (step {step}) has no weights ({', '.join(WEIGHT_FILES)})"
        )
    if not (d / "config.json").is_file():
        raise ValueError(
            f"trajectory.checkpoints: {d / 'config.json'} does not exist; a checkpoint is a model directory"
        )


def _weights_file(directory: Path) -> Path | None:
    """The weight file a Hugging Face model directory is loaded from (:data:`WEIGHT_FILES`, first found), or None."""
    return next((directory / n for n in WEIGHT_FILES if (directory / n).is_file()), None)


def _trainer_log(found: list[tuple[int, Path]]) -> dict[int, dict[str, float]] | None:
    """Step -> the :data:`TRAINER_LOG` values of the newest ``trainer_state.json`` (it holds every logged step),
    or None when no checkpoint has one."""
    states = [d / TRAINER_STATE for _, d in found if (d / TRAINER_STATE).is_file()]
    if not states:
        return None
    out: dict[int, dict[str, float]] = {}
    try:
        for entry in json.loads(states[-1].read_text())["log_history"]:
            values = {col: float(entry[key]) for col, key in TRAINER_LOG.items() if entry.get(key) is not None}
            if values and "step" in entry:
                out.setdefault(int(entry["step"]), {}).update(values)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{states[-1]}: not a Trainer state with a log_history list ({err})") from None
    return out
