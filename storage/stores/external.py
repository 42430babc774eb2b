"""External runs as the training stacks leave them: checkpoint series and grail's weight-delta traces.

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

A **delta trace** (``trajectory.deltas``, :func:`delta_trace`, :func:`replay_deltas`) is a folder of grail's
``delta_NNNNNN.pt`` files (``research/trl/delta_checkpoint_callback.py`` in one-covenant/grail at 54d6342; format:
docs/formats.md, "Weight-delta traces") beside the weights training started from.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the series reader and the trace's file checks run in the preflight, before torch loads
    import torch

    from covgrad.layout import ParamLayout

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

# the Hugging Face weight files in transformers' order: storage.checkpoints.WEIGHT_FILES, spelt out here because that
# module imports torch (tests/faults/test_inputs_preflight.py checks that the two agree)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

DELTA_FILE = re.compile(r"delta_(\d+)\.pt")
START_WEIGHTS = ("base_weights.pt", *WEIGHT_FILES)  # the trace's start weights, first found
TRACE_DTYPES = ("bfloat16", "float32")  # the torch dtype names a trace may store


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


@dataclass(frozen=True)
class DeltaTrace:
    """A folder of grail delta files.

    Attributes:
        path: the folder.
        start: the start weights file (``base_weights.pt``, or a Hugging Face weights file).
        files: (grail step, file) for steps 0, 1, …, T − 1; file s takes the weights from after trainer step s to
            after step s + 1 (grail's ``reconstruct_weights_at_step``).
        dtype: the dtype of every file's values (bf16 or float32): the trace's stored dtype.
    """

    path: str
    start: str
    files: tuple[tuple[int, str], ...]
    dtype: torch.dtype


def delta_files(path: str) -> tuple[list[tuple[int, Path]], Path]:
    """The (grail step, file) pairs of the delta trace at ``path``, steps 0, 1, …, and its start weights file, read
    from the file names alone (no torch: the preflight's check); ValueError in one line naming the file when the
    folder does not exist or holds no delta files, two files of one step, a gap in the steps or no start weights."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"trajectory.deltas {path!r} is not a folder of grail delta files (delta_NNNNNN.pt)")
    files = sorted((int(m[1]), f) for f in p.iterdir() if (m := DELTA_FILE.fullmatch(f.name)))
    if not files:
        raise ValueError(f"trajectory.deltas {path!r} holds no delta_NNNNNN.pt files")
    for (t, a), (u, b) in zip(files, files[1:], strict=False):
        if t == u:
            raise ValueError(f"trajectory.deltas: {a} and {b} are both step {t}; keep one file per step")
    for i, (t, _) in enumerate(files):
        if t != i:
            raise ValueError(
                f"trajectory.deltas: {p / f'delta_{i:06d}.pt'} is missing (the trace holds steps {files[0][0]}..."
                f"{files[-1][0]}); every step from delta_000000.pt is replayed"
            )
    start = next((p / n for n in START_WEIGHTS if (p / n).is_file()), None)
    if start is None:
        raise ValueError(
            f"trajectory.deltas {path!r} has no start weights: save the weights training started from beside the "
            "deltas as base_weights.pt (a dict name -> tensor, as grail's README does) or model.safetensors"
        )
    return files, start


def delta_trace(path: str) -> DeltaTrace:
    """The delta trace at ``path`` (:func:`delta_files`) with its dtype; ValueError in one line naming the file as
    :func:`delta_files` does, or for a first file that is not grail's format or stores another dtype."""
    import torch

    files, start = delta_files(path)
    first = _read_delta(files[0][1], 0)
    name = (first.get("metadata") or {}).get("dtype")
    name = name.removeprefix("torch.") if isinstance(name, str) else None
    values = [layer.get("values") for layer in first["layers"].values() if isinstance(layer, Mapping)]
    dtype = (
        getattr(torch, name, None) if name is not None else next((v.dtype for v in values if torch.is_tensor(v)), None)
    )
    if dtype not in [getattr(torch, n) for n in TRACE_DTYPES]:
        raise ValueError(f"{files[0][1]}: values in {name or dtype}; covgrad replays bfloat16 or float32 traces")
    return DeltaTrace(str(Path(path)), str(start), tuple((t, str(f)) for t, f in files), dtype)


def _read_delta(file: Path | str, step: int) -> dict[str, Any]:
    """A grail delta file's dict, checked to be the ``values`` format of step ``step``."""
    import torch

    try:
        delta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many kinds on a foreign or truncated file
        raise ValueError(
            f"{file}: not a readable delta file ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    if not isinstance(delta, dict) or not isinstance(delta.get("layers"), dict):
        raise ValueError(f"{file}: not a grail delta file (a dict with a layers dict)")
    if delta.get("format") != "values":
        raise ValueError(
            f"{file}: format {delta.get('format')!r}; covgrad replays format 'values' (the new weights at the "
            "changed positions, grail's DeltaCheckpointCallback): differences rounded to bf16 replay inexactly"
        )
    if delta.get("step") != step:
        raise ValueError(f"{file}: its step field is {delta.get('step')!r}, its name says step {step}")
    return delta


def replay_deltas(
    trace: DeltaTrace, shapes: Mapping[str, tuple[int, ...]], layout: ParamLayout, start: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """(trainer step s + 1, (P,) the selected weights after it, trace dtype) for each delta file s in order, from
    ``start`` (P,), the start weights in the trace dtype; each file's values replace the weights at its indices
    (COO (ndim, nnz) per tensor, raveled in row-major order at the tensor's layout offset). Tensors outside the
    layout are checked and skipped. The yielded tensor is updated in place by the next step: use it first.

    ``shapes``: every parameter of the start model by name. ValueError in one line naming the file and tensor
    for a tensor the start model lacks or holds in another shape, malformed or out-of-range indices, or values
    of another dtype or count."""
    entries = {e.name: e for e in layout.entries}
    w = start.clone()
    for t, file in trace.files:
        for name, layer in _read_delta(file, t)["layers"].items():
            flat, values = _layer(file, name, layer, shapes, trace.dtype)
            if name in entries:
                w[entries[name].offset + flat] = values
        yield t + 1, w


def _layer(
    file: str, name: str, layer: Any, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's entry of a delta file, checked against the start model: (flat row-major indices (nnz,) int64,
    values (nnz,))."""
    import torch

    where = f"{file}: tensor {name!r}"
    if name not in shapes:
        raise ValueError(f"{where} is not a parameter of the start model (model.path)")
    try:
        idx, values, given = layer["indices"], layer["values"], tuple(int(n) for n in layer["shape"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: not a delta entry with indices, values and shape ({err})") from None
    shape = tuple(shapes[name])
    if given != shape:
        raise ValueError(f"{where} has shape {given} in the delta, {shape} in the start model (model.path)")
    ok = torch.is_tensor(idx) and not idx.is_floating_point() and idx.dim() == 2 and idx.shape[0] == len(shape)
    if not ok:
        got = f"{idx.dtype} {tuple(idx.shape)}" if torch.is_tensor(idx) else type(idx).__name__
        raise ValueError(f"{where}: indices must be an integer COO tensor of shape ({len(shape)}, nnz), got {got}")
    if not torch.is_tensor(values) or values.shape != (idx.shape[1],) or values.dtype != dtype:
        got = f"{values.dtype} {tuple(values.shape)}" if torch.is_tensor(values) else type(values).__name__
        raise ValueError(f"{where}: values must be {dtype} of shape ({idx.shape[1]},) like the trace's, got {got}")
    idx = idx.long()
    bounds = torch.tensor(shape, dtype=torch.long).reshape(-1, 1)
    bad = ((idx < 0) | (idx >= bounds)).any(0)
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(f"{where}: index {idx[:, j].tolist()} is out of range for its shape {shape}")
    strides = torch.tensor([int(torch.tensor(shape[d + 1 :]).prod()) for d in range(len(shape))], dtype=torch.long)
    return (idx * strides.reshape(-1, 1)).sum(0), values
