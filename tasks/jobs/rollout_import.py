"""Imported rollouts into the rollouts store: a stack's dump read through ``covgrad.rollouts.formats``, what it says
about each record (policy version, the stack's advantage, per-token advantages, mixed sampling parameters) as
extra arrays, and the optional re-scoring of records (``verify_records``) against the policy or ``mu_model``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from covgrad.config import SamplerSection
from covgrad.models import context_length
from covgrad.rollouts import (
    SamplerSpec,
    import_records,
    parse_reward_fields,
    record_mismatch,
    response_texts,
    verification_warning,
)
from covgrad.scores import sampled_token_logp
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done
from storage.models import ModelSource, load_models
from storage.readers import read_located_records
from storage.schema import ROLLOUTS as STORE
from storage.schema import create
from storage.stores.regimes import create_imported_token_arrays
from storage.stores.rollouts import create_rollout_arrays, write_rollout_rows
from tasks.specs import RolloutsSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def sampler_source(policy: ModelSource, s: SamplerSection) -> ModelSource:
    """How sampler ``s`` loads its model (``model``, or ``mu_model``): as the policy says, in the sampler's own
    ``dtype`` when it sets one (an engine's bf16 / fp16 copy of the weights)."""
    if s.dtype is None:
        return policy
    return policy.model_copy(update={"dtype": s.dtype})  # type: ignore[attr-defined]


def import_options(s: SamplerSection) -> dict[str, Any]:
    """The options of ``covgrad.rollouts.formats.import_records`` for sampler section ``s``: its sampling settings
    stand for those of records that carry none; ``reward_fields`` name the reward columns."""
    options: dict[str, Any] = {"sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}}
    if s.reward_fields:
        options.update(parse_reward_fields(s.reward_fields))
    return options


def verify_import(
    store: ArtifactStore, base: ArtifactRef, spec: RolloutsSpec, policy: PreTrainedModel, data: dict, where: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Re-score ``verify_records`` of the imported records (chosen with the sampler's seed) with the policy,
    or with ``mu_model``, at the section's sampling settings; (N,) arrays ``verify_kl`` / ``verify_k3_kl``
    (NaN where not re-scored) and a summary for the attrs, whose ``warning`` is one line naming the outliers."""
    s, N = spec.settings, len(data["prompt_len"])
    n = min(s.verify_records, N)
    idx = np.sort(np.random.default_rng(s.seed).choice(N, size=n, replace=False))
    model, label = policy, "the policy"
    if s.mu_model is not None:
        model, label = load_models(store, base, s.mu_model, sampler_source(spec.policy, s))[0], s.mu_model
    tokens, pl, rl = (torch.from_numpy(data[k][idx]) for k in ("tokens", "prompt_len", "response_len"))
    rescored = sampled_token_logp(model, tokens, pl, rl, SamplerSpec.of(s)).numpy()
    T = rescored.shape[1]
    m = record_mismatch(data["sampler_logp"][idx, :T], rescored, data["response_len"][idx])
    arrays = {name: np.full(N, np.nan) for name in ("verify_kl", "verify_k3_kl")}
    arrays["verify_kl"][idx], arrays["verify_k3_kl"][idx] = m["kl"], m["k3_kl"]
    places = [where[i] for i in idx]
    what = f"rollouts.samplers.{spec.sampler}"
    warning = verification_warning(what, places, m["k3_kl"], s.verify_max_kl, label)
    summary = {
        "records": int(n),
        "model": label,
        "kl_mean": float(m["kl"].mean()),
        "k3_kl_mean": float(m["k3_kl"].mean()),
        "k3_kl_max": float(m["k3_kl"].max()),
        "max_kl": s.verify_max_kl,
        "outliers": [places[i] for i in np.flatnonzero(m["k3_kl"] > s.verify_max_kl)],
        "warning": warning,
    }
    return arrays, summary


def import_rollouts(
    store: ArtifactStore, ref: ArtifactRef, spec: RolloutsSpec, base: ArtifactRef, warn: Callable[[str], None]
) -> tuple[Any, int, int]:
    """Import the records of rollouts spec ``spec`` (with ``import_path``) into
    the rollouts store of ``ref``, in its sampler's ``format``; warning lines go to ``warn``. Returns the store's
    group, the tokenizer's EOS and pad ids."""
    s = spec.settings
    assert s.import_path is not None
    policy, tokenizer = load_models(store, base, "policy", spec.policy)
    V = policy.get_input_embeddings().num_embeddings
    data, extras, summary = import_records(
        read_located_records(s.import_path),
        s.format,
        V,
        context_length(policy, tokenizer, spec.policy.max_length),
        tokenizer=tokenizer,
        pad_id=tokenizer.pad_token_id,
        options=import_options(s),
        source=s.import_path,
        eos_id=tokenizer.eos_token_id,
    )
    where, sampling_index = summary.pop("where"), np.asarray(summary.pop("sampling_index"), dtype=np.int32)
    if summary["message"]:
        warn(summary["message"])
    data.update(import_extra_arrays(data, extras, sampling_index if summary["mixed_sampling_params"] else None))
    order = np.argsort(data["group"], kind="stable")
    data = {k: v[order] for k, v in data.items()}
    where = [where[i] for i in order]
    sizes = np.bincount(data["group"])
    if np.any(sizes != sizes[0]):
        bad = int(np.flatnonzero(sizes != sizes[0])[0])
        raise ValueError(
            f"imported group {bad} has {sizes[bad]} samples but group 0 has {sizes[0]}; "
            "covgrad needs groups of equal size"
        )
    verified = None
    if s.verify_records > 0:
        checks, verified = verify_import(store, base, spec, policy, data, where)
        data.update(checks)
        if verified["warning"]:
            warn(verified["warning"])
    N, width = data["tokens"].shape
    T = data["sampler_logp"].shape[1]
    s = s.model_copy(update={"group_size": int(sizes[0]), "max_new_tokens": T})
    if "mu_topk_ids" in data:
        s = s.model_copy(update={"store_mu": "topk", "mu_topk": int(data["mu_topk_ids"].shape[2])})
    texts = response_texts(tokenizer, data["tokens"].tolist(), data["prompt_len"], data["response_len"])
    prompts = [
        tokenizer.decode(list(r[:p]), skip_special_tokens=True)
        for r, p in zip(data["tokens"], data["prompt_len"], strict=True)
    ]
    g = store.open_group(ref, STORE, mode="a")
    create_rollout_arrays(g, N, width, T, V, N, s)
    create_imported_token_arrays(g, data, N)
    for name in IMPORT_EXTRAS:
        if name in data:
            create(g, STORE, name, data[name].shape, rows=N)
    create_progress(g, STORE, 1)
    rows = {k: v for k, v in data.items() if k != "reward"}
    for k in ("prompt_len", "response_len", "group", "prompt_index", "sample_index"):
        rows[k] = rows[k].astype(np.int32)
    rows["reward"] = data["reward"]
    rows["prompt"] = np.asarray(prompts, dtype=object).astype(str)
    rows["response"] = np.asarray(texts, dtype=object).astype(str)
    write_rollout_rows(g, 0, rows, width)
    mark_batch_done(g, 0)
    if s.format != "covgrad" or extras or verified is not None or summary["message"]:
        versions = {"none" if v is None else str(v): c for v, c in summary["policy_versions"].items()}
        g.attrs["import"] = {**summary, "policy_versions": versions, "verify": verified}
    return g, tokenizer.eos_token_id, tokenizer.pad_token_id


IMPORT_EXTRAS = ("policy_version", "stack_advantage", "sampling_params_index", "verify_kl", "verify_k3_kl")
"""Per-record arrays of an import beyond ``records_to_rollouts``' (``storage.schema.ROLLOUTS_VARS``)."""


def import_extra_arrays(data: dict, extras: dict[str, np.ndarray], sampling_index: np.ndarray | None) -> dict:
    """The rollouts arrays of ``covgrad.rollouts.formats.import_records``' extras: ``policy_version``,
    ``stack_advantage`` and, when the records mix sampling parameters, ``sampling_params_index`` (N,);
    the per-token advantages as the token-aligned ``token_advantage`` (N, L) float64 unless the records'
    own ``advantages`` field gave it."""
    out: dict[str, np.ndarray] = {}
    if "policy_version" in extras:
        out["policy_version"] = extras["policy_version"]
    if "advantage" in extras:
        out["stack_advantage"] = extras["advantage"]
    if sampling_index is not None:
        out["sampling_params_index"] = sampling_index
    if "token_advantages" in extras and "token_advantage" not in data:
        adv = np.zeros(data["tokens"].shape, dtype=np.float64)
        for n, (p, r) in enumerate(zip(data["prompt_len"], data["response_len"], strict=True)):
            adv[n, p : p + r] = extras["token_advantages"][n, :r]
        out["token_advantage"] = adv
    return out
