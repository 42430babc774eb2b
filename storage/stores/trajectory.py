"""The trajectory artifact's files: per-step records, the bit-packed changed sets, resume state, checkpoints.

Layout of ``{root}/trajectory/{key}/``:

- ``trajectory.zarr`` (arrays declared in ``storage/schema.py``): ``changed`` (step, param_byte) uint8,
  step t's changed set bit-packed (``np.packbits`` over the flat parameter axis), one row per step and
  written once; ``batch_done`` (batch = step), the progress array; once every step is done, the per-step
  scalars, threshold counts, per-tensor counts, decile tables and persistence histograms as arrays over
  ``step`` (:func:`finish_store`) and the tensor table.
- ``records/step_{t:06d}.json``: step t's scalar and small-array record, written before its progress mark.
- ``state/step_{t:06d}.pt``: the newest resume state (``torch.save`` of a plain dict of tensors and ints),
  written atomically; older ones are deleted once a newer one exists, the last one when the stage ends.
- ``checkpoints/step_{t:06d}/``: Hugging Face checkpoints (model and tokenizer) at the configured steps.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from covgrad.config import RegimeSection
from covgrad.layout import ParamLayout
from covgrad.regimes import regime_of
from covgrad.rollouts import SamplerSpec, group_batches
from covgrad.updates import (
    BATCH_KEYS,
    FixedBatches,
    OnPolicy,
    OptimizerSpec,
    StepLoss,
    StepZeroStats,
    text_rewards,
)
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import ModelSource, load_model_and_tokenizer, load_models
from storage.schema import REGIMES, ROLLOUTS, STATS, annotate, create, write
from storage.schema import TRAJECTORY as STORE
from storage.stores.prompts import load_task
from storage.stores.regimes import IMPORTED
from storage.stores.rollouts import read_batch

STATE_DIR = "state"
RECORDS_DIR = "records"
CHECKPOINTS_DIR = "checkpoints"


MANIFEST = "manifest.json"  # covgrad.integrations.trl writes it beside its checkpoints


def checkpoint_series(path: str) -> list[tuple[int, str]]:
    """(step, directory) of a series of Hugging Face checkpoints written by any trainer, ordered by step.

    ``path`` is a ``manifest.json`` (``{"checkpoints": [{"step": t, "path": dir}, ...]}``, paths relative to
    the manifest's folder: ``covgrad.integrations.trl.CovgradRecorder`` writes one), a folder holding one,
    or a folder of checkpoint subfolders whose names end in their step (``step_000128``, ``checkpoint-128``,
    ``global_step128``) and that hold a ``config.json``. At least two checkpoints, distinct steps.
    """
    p = Path(path)
    manifest = p if p.is_file() else p / MANIFEST
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text())["checkpoints"]
            series = [(int(e["step"]), str((manifest.parent / e["path"]).resolve())) for e in entries]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{manifest}: not a checkpoint manifest ({err}); need checkpoints: [...]") from None
    elif p.is_dir():
        series = []
        for d in p.iterdir():
            m = re.search(r"(\d+)$", d.name)
            if m and d.is_dir() and (d / "config.json").is_file():
                series.append((int(m.group(1)), str(d.resolve())))
    else:
        raise ValueError(f"trajectory.checkpoints {path!r} is neither a manifest nor a folder of checkpoints")
    series.sort()
    steps = [t for t, _ in series]
    if len(series) < 2:
        raise ValueError(f"trajectory.checkpoints {path!r} holds {len(series)} checkpoint(s); a series needs >= 2")
    if len(set(steps)) != len(steps):
        raise ValueError(f"trajectory.checkpoints {path!r}: two checkpoints share a step ({steps})")
    for _, d in series:
        if not (Path(d) / "config.json").is_file():
            raise ValueError(f"trajectory.checkpoints: {d} is not a Hugging Face checkpoint (no config.json)")
    return series


FIXED_KINDS = ("sft_drift", "sft_sampled")  # regimes whose data are fixed responses, never fresh samples


def optimizer_spec(s: Any) -> OptimizerSpec:
    """The optimizer of trajectory settings ``s`` (weight decay only for AdamW)."""
    decay = s.weight_decay if s.optimizer == "adamw" else None
    return OptimizerSpec(s.optimizer, s.lr, tuple(s.betas), decay, s.warmup)


def step_zero_stats(store: ArtifactStore, spec: Any, up: dict[str, ArtifactRef], columns: Any = None) -> StepZeroStats:
    """The step-0 predictors of trajectory spec ``spec``: F of the main statistics, G and ρ of the main statistics
    for rl and of the regime's own (the ``regimes`` stage) otherwise; all P columns, or those of ``columns`` (a
    ``covgrad.distributed.fsdp.RankColumns``), read run by run."""
    st = store.open_group(up["stats"], STATS, mode="r")
    rg = st if spec.regime is None else store.open_group(up["regimes"], REGIMES, mode="r")
    own = "" if spec.regime is None else f"_{spec.settings.regime}"

    def read(array: Any) -> np.ndarray:
        if columns is None:
            return array[:]
        parts = [np.asarray(array[a:b]) for a, b in zip(columns.starts, columns.stops, strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=array.dtype)

    return StepZeroStats(F=read(st["F"]), G=read(rg[f"G{own}"]), rho=read(rg[f"rho{own}"]), seed=spec.settings.seed)


def step_loss(
    store: ArtifactStore,
    base: ArtifactRef,
    policy: ModelSource,
    name: str,
    r: RegimeSection | None,
    teacher: ArtifactRef | None = None,
    meta: bool = False,
) -> StepLoss:
    """The loss regime ``name`` steps (None: rl), its teacher and reference loaded as fixed float32 models
    (``policy``: the start policy; ``stale``; ``trained``: the teacher stage's artifact ``teacher``; a model
    directory), on the meta device with ``meta`` (a rank that takes its shards from rank 0); ValueError for
    another vocabulary."""
    if r is None:
        return StepLoss()
    if r.teacher_logprobs:
        raise ValueError(
            f"regime {name}: teacher_logprobs imports the teacher's log-probs of fixed samples; a step needs the "
            "teacher model (set teacher to a model directory, stale or policy)"
        )

    def fixed(which: str | None, role: str) -> torch.nn.Module | None:
        if which is None:
            return None
        if which == "trained":
            if teacher is None:
                raise ValueError(f"regime {name}: teacher trained needs the teacher stage's artifact upstream")
            with store.local_dir(teacher, "teacher", write=False) as d:
                model = load_model_and_tokenizer(d, policy.dtype, policy.trust_remote_code, meta)[0].float().eval()
        else:
            model = load_models(store, base, which, policy, meta)[0].float().eval()
        V = int(model.get_output_embeddings().weight.shape[0])
        own = load_models(store, base, "policy", policy, meta=True)[0]  # its shapes only
        if int(own.get_output_embeddings().weight.shape[0]) != V:
            raise ValueError(f"regime {name}: the {role} {which!r} has vocabulary {V}, unlike the policy")
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    return StepLoss(
        regime_of(r),
        teacher=fixed(r.teacher, "teacher"),
        reference=fixed(r.reference if r.kl_beta else None, "reference"),
        use_advantages=r.advantages != "none",
    )


def fixed_batches(ro: Any, groups_per_batch: int, r: RegimeSection | None) -> list[dict[str, torch.Tensor]]:
    """The rollouts ``ro`` as minibatches of whole prompt groups: (n, L_b) rows trimmed of trailing padding,
    with the imported per-token ``token_advantages`` (n, L) at the store's width when regime ``r`` reads them."""
    imported = r is not None and r.kind == "rl_token" and r.advantages == "imported"
    if imported and IMPORTED["advantages"] not in ro:
        raise ValueError("regime rl_token with advantages=imported: these rollouts hold no imported advantages field")
    batches = []
    for lo, hi in group_batches(ro["group"][:], groups_per_batch):
        b = read_batch(ro, lo, hi, trim=not imported)
        batch = {k: getattr(b, k) for k in BATCH_KEYS}
        if imported:
            batch["token_advantages"] = torch.from_numpy(ro[IMPORTED["advantages"]][lo:hi].astype(np.float64))
        batches.append(batch)
    return batches


def record_name(step: int) -> str:
    return f"{RECORDS_DIR}/step_{step:06d}.json"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS_DIR}/step_{step:06d}"


def rank_label(rank: int, ranks: int) -> str:
    """The name of rank ``rank`` of ``ranks``' resume states (a group of another size does not read them)."""
    return f"rank{rank}-of-{ranks}"


def _state_name(step: int, rank: str | None = None) -> str:
    """The resume state of step ``step``: of the whole run, or of one rank's shard (``rank``: its
    :func:`rank_label`)."""
    return f"{STATE_DIR}/step_{step:06d}.pt" if rank is None else f"{STATE_DIR}/step_{step:06d}.{rank}.pt"


def create_changed(g: Any, steps: int, P: int) -> None:
    """The ``changed`` (step, param_byte) array of a ``steps``-step run over P parameters (idempotent)."""
    create(g, STORE, "changed", (steps, -(-P // 8)))


def write_step(store: ArtifactStore, ref: ArtifactRef, g: Any, step: int, packed: np.ndarray, record: dict) -> None:
    """Step ``step``'s data (from 1): its packed changed set as row step - 1 and its record file."""
    g["changed"][step - 1] = packed
    store.write_json(ref, record_name(step), _plain(record))


def read_records(store: ArtifactStore, ref: ArtifactRef, steps: int) -> list[dict]:
    """The records of steps 1..``steps``, in order."""
    return [store.read_json(ref, record_name(t)) for t in range(1, steps + 1)]


def write_state(store: ArtifactStore, ref: ArtifactRef, state: dict, rank: str | None = None) -> None:
    """Store the resume state of step ``state["step"]`` atomically (of the rank labelled ``rank``'s shard:
    ``state/step_{t}.rank{r}-of-{R}.pt``), then, for the whole run, delete the older states (a rank's go in
    :func:`drop_older_states`, once every rank has written its own)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    step = int(state["step"])
    target = store.path(ref, _state_name(step, rank))
    store.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    if store.local:
        store.fs.pipe_file(target + ".partial", buf.getvalue())
        store.fs.mv(target + ".partial", target)
    else:
        store.fs.pipe_file(target, buf.getvalue())
    if rank is None:
        drop_older_states(store, ref, step)


def drop_older_states(store: ArtifactStore, ref: ArtifactRef, step: int, rank: str | None = None) -> None:
    """Delete the resume states (of rank ``rank``) other than step ``step``'s."""
    for old in _state_files(store, ref, rank):
        if not old.endswith(_state_name(step, rank)):
            store.fs.rm(old)


def state_steps(store: ArtifactStore, ref: ArtifactRef, rank: str | None = None) -> list[int]:
    """The steps of the stored resume states (of rank ``rank``), ascending."""
    return [int(re.search(r"step_(\d+)", f.rsplit("/", 1)[-1])[1]) for f in _state_files(store, ref, rank)]


def read_state(store: ArtifactStore, ref: ArtifactRef, rank: str | None = None, step: int | None = None) -> dict | None:
    """The stored resume state of step ``step`` (None: the newest; of rank ``rank``'s shard), or None."""
    steps = state_steps(store, ref, rank)
    if not steps:
        return None
    name = _state_name(steps[-1] if step is None else step, rank)
    return torch.load(io.BytesIO(store.fs.cat_file(store.path(ref, name))), weights_only=True)


def drop_state(store: ArtifactStore, ref: ArtifactRef) -> None:
    """Delete every stored resume state, the ranks' included (the stage's last write before its marker)."""
    d = store.path(ref, STATE_DIR)
    if store.fs.exists(d):
        store.fs.rm(d, recursive=True)


def _state_files(store: ArtifactStore, ref: ArtifactRef, rank: str | None = None) -> list[str]:
    """The stored states of the whole run (``rank`` None) or of one rank, by step."""
    d = store.path(ref, STATE_DIR)
    if not store.fs.exists(d):
        return []
    suffix = ".pt" if rank is None else f".{rank}.pt"
    names = [p for p in store.fs.ls(d, detail=False) if p.endswith(suffix)]
    return sorted(p for p in names if rank is not None or ".rank" not in p.rsplit("/", 1)[-1])


def finish_store(g: Any, records: list[dict], layout: ParamLayout) -> None:
    """The per-step arrays over ``step`` from the records (scalars (step,), the vectors by their second
    dim, ``persist_hist`` padded with zeros to (step, count = steps + 1)) and the tensor table."""
    K = len(records)
    for name in records[0]:
        values = [r[name] for r in records]
        if name == "persist_hist":
            table = np.zeros((K, K + 1), dtype=np.int64)
            for i, v in enumerate(values):
                table[i, : len(v)] = v
            write(g, STORE, name, table, overwrite=True)
        else:
            write(g, STORE, name, np.asarray(values, dtype=_dtype(values)), overwrite=True)
    annotate(g, STORE, layout)


def _dtype(values: list) -> type:
    """int64 for integer columns, float64 otherwise (NaN-able)."""
    flat = np.asarray(values).reshape(-1)
    return np.int64 if flat.dtype.kind in "iu" else np.float64


def _plain(record: dict) -> dict:
    """A record as JSON values: arrays to lists, numpy scalars to Python numbers."""
    return {k: v.tolist() if isinstance(v, np.ndarray | np.generic) else v for k, v in record.items()}


def step_source(
    store: ArtifactStore, spec: Any, up: dict[str, ArtifactRef], tokenizer: Any, loss: StepLoss
) -> FixedBatches | OnPolicy:
    """The data of every step of trajectory spec ``spec`` (a ``tasks.specs.TrajectorySpec``): fresh on-policy
    rows, or fixed minibatches of the upstream rollouts."""
    s, r = spec.settings, spec.regime
    if s.data == "fixed" or (r is not None and r.kind in FIXED_KINDS):
        ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
        return FixedBatches(fixed_batches(ro, spec.groups_per_batch, r), True, loss.needs)
    if r is not None and r.advantages == "imported":
        raise ValueError(
            f"trajectory: regime {s.regime} uses imported per-token advantages, which fresh samples lack; "
            "set trajectory.data=fixed"
        )
    problems, reward_fn = load_task(spec.task)
    sampler = spec.sampler
    return OnPolicy(
        prompts=[tokenizer(p.prompt)["input_ids"] for p in problems],
        rewards=text_rewards(tokenizer, problems, reward_fn),
        group_size=sampler.group_size,
        sampler=SamplerSpec.of(sampler),
        prompts_per_step=s.prompts_per_step,
        seed=s.seed,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        advantage=spec.advantage,
        batch_size=sampler.batch_size,
    )


def write_summary(store: ArtifactStore, ref: ArtifactRef, g: Any, layout: ParamLayout, summary: dict) -> None:
    """A finished trajectory's ``summary.json``, its store's attrs (tensors and summary), consolidated."""
    store.write_json(ref, "summary.json", summary)
    g.attrs.update({"tensors": layout.to_records(), "summary": summary})
    store.consolidate(ref, STORE)
