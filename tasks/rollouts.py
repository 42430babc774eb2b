"""rollouts stage: responses from a sampler (or imported), rewards, advantages, the sampler's μ.

Store ``rollouts.zarr`` (arrays, dims, dtypes, chunks and attributes declared in ``storage/schema.py``):
per sample the token row (prompt, then response, right-padded), the response mask, prompt and response
lengths and texts, ``group``, ``prompt_index`` and ``sample_index`` (coordinates along ``sample``),
reward, advantage and the sampler's token log-probs; optionally μ (``mu_logp`` over the vocabulary, or
``mu_topk_ids`` / ``mu_topk_logp`` / ``mu_tail``); and the ``batch_done`` progress array. Generation
is resumable by batch of prompts; advantages are written once all rewards exist (``global_mean`` needs
them all). An import reads the sampler's ``format`` through ``covgrad.formats`` and adds what the dump
says about each record (``policy_version``, ``stack_advantage``, ``token_advantage``,
``sampling_params_index``, with ``verify_records`` the re-scored ``verify_kl`` / ``verify_k3_kl``; attrs
``import``); a μ record on a support adds attrs ``support_mu``, the bound of its centering error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.centering import sampled_token_logp
from covgrad.config import SamplerSection
from covgrad.formats import import_records, parse_reward_fields
from covgrad.inputs import check_context
from covgrad.models import context_length
from covgrad.problems import response_texts, score_rewards
from covgrad.rollout_import import record_mismatch, verification_warning
from covgrad.sampling import SamplerSpec, check_rewards, compute_advantages, generate
from covgrad.support_mu import gradient_error_factor, tail_summary
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from storage.models import load_models
from storage.prompts import load_task, prompt_places
from storage.readers import read_located_records
from storage.regimes import create_imported_token_arrays
from storage.rollouts import create_rollout_arrays, write_rollout_rows
from storage.schema import ROLLOUTS as STORE
from storage.schema import create
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.specs import RolloutsSpec


def _reward(reward_fn: Any, problem: Any, response: str, where: str) -> float:
    """The reward of one response; ValueError naming the prompt's location (``file:line``) otherwise."""
    try:
        return score_rewards(reward_fn, [problem.prompt], [response], [problem.answer])[0]
    except ValueError as exc:
        msg = str(exc).replace(" on record 0", "").replace(" for record 0", "")
        raise ValueError(f"{where}: {msg} (response {response!r})") from None


def _generate(store: ArtifactStore, ref: ArtifactRef, spec: RolloutsSpec, base: ArtifactRef):
    s, name = spec.settings, spec.sampler
    problems, reward_fn = load_task(spec.task)
    policy, tokenizer = load_models(store, base, "policy", spec.policy)
    sampler = policy if s.model == "policy" else load_models(store, base, s.model, spec.policy)[0]
    V = policy.get_input_embeddings().num_embeddings
    if sampler.get_input_embeddings().num_embeddings != V:
        raise ValueError(f"sampler model {s.model!r} has a different vocabulary size than the policy ({V})")
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    where = prompt_places(spec.task, len(problems))
    # preflight checked the same with tokenizer.json; this is the loaded tokenizer's word
    check_context(
        [len(p) for p in prompts], where, s.max_new_tokens, context_length(policy), f"rollouts.samplers.{name}"
    )
    G, T = s.group_size, s.max_new_tokens
    per_batch = max(1, s.batch_size // G)
    n_batches = -(-len(prompts) // per_batch)
    N, width = len(prompts) * G, max(len(p) for p in prompts) + T
    g = store.open_group(ref, STORE, mode="a")
    create_rollout_arrays(g, N, width, T, V, per_batch * G, s)
    create_progress(g, STORE, n_batches)
    sampling = SamplerSpec.of(s)
    todo = pending_batches(g)
    with progress_bar(f"rollouts {ref.key[:8]}", n_batches) as bar:
        bar.update(n_batches - len(todo))
        for b in todo:
            idx = list(range(b * per_batch, min(len(prompts), (b + 1) * per_batch)))
            out = generate(
                sampler,
                [prompts[i] for i in idx],
                idx,
                G,
                sampling,
                s.seed,
                batch_size=s.batch_size,
                eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id,
                mu_mode=s.store_mu,
                mu_topk=s.mu_topk if s.store_mu == "topk" else 0,
            )
            texts = response_texts(tokenizer, out["tokens"].tolist(), out["prompt_len"], out["response_len"])
            pi = [idx[int(k)] for k in out["prompt_index"]]
            out["prompt_index"] = np.asarray(pi, dtype=np.int32)
            out["group"] = out["prompt_index"]
            out["reward"] = [_reward(reward_fn, problems[i], text, where[i]) for i, text in zip(pi, texts, strict=True)]
            out["prompt"] = np.asarray([problems[i].prompt for i in pi], dtype=object).astype(str)
            out["response"] = np.asarray(texts, dtype=object).astype(str)
            out["sample_index"] = out["sample_index"].numpy().astype(np.int32)
            for key in ("prompt_len", "response_len"):
                out[key] = out[key].numpy().astype(np.int32)
            write_rollout_rows(g, b * per_batch * G, out, width)
            mark_batch_done(g, b)
            bar.update(1)
    return g, tokenizer.eos_token_id, tokenizer.pad_token_id


def import_options(s: SamplerSection) -> dict[str, Any]:
    """The options of ``covgrad.formats.import_records`` for sampler section ``s``: its sampling settings
    stand for those of records that carry none; ``reward_fields`` name the reward columns."""
    options: dict[str, Any] = {"sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}}
    if s.reward_fields:
        options.update(parse_reward_fields(s.reward_fields))
    return options


def _verify(
    store: ArtifactStore, base: ArtifactRef, spec: RolloutsSpec, policy: Any, data: dict, where: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Re-score ``verify_records`` of the imported records (chosen with the sampler's seed) with the policy,
    or with ``mu_model``, at the section's sampling settings; (N,) arrays ``verify_kl`` / ``verify_k3_kl``
    (NaN where not re-scored) and a summary for the attrs; one warning line for outliers."""
    s, N = spec.settings, len(data["prompt_len"])
    n = min(s.verify_records, N)
    idx = np.sort(np.random.default_rng(s.seed).choice(N, size=n, replace=False))
    model, label = policy, "the policy"
    if s.mu_model is not None:
        model, label = load_models(store, base, s.mu_model, spec.policy)[0], s.mu_model
    tokens, pl, rl = (torch.from_numpy(data[k][idx]) for k in ("tokens", "prompt_len", "response_len"))
    rescored = sampled_token_logp(model, tokens, pl, rl, SamplerSpec.of(s)).numpy()
    T = rescored.shape[1]
    m = record_mismatch(data["sampler_logp"][idx, :T], rescored, data["response_len"][idx])
    arrays = {name: np.full(N, np.nan) for name in ("verify_kl", "verify_k3_kl")}
    arrays["verify_kl"][idx], arrays["verify_k3_kl"][idx] = m["kl"], m["k3_kl"]
    places = [where[i] for i in idx]
    what = f"rollouts.samplers.{spec.sampler}"
    warning = verification_warning(what, places, m["k3_kl"], s.verify_max_kl, label)
    if warning:
        log.warning("%s", warning)
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


def _import(store: ArtifactStore, ref: ArtifactRef, spec: RolloutsSpec, base: ArtifactRef):
    s = spec.settings
    assert s.import_path is not None
    policy, tokenizer = load_models(store, base, "policy", spec.policy)
    V = policy.get_input_embeddings().num_embeddings
    data, extras, summary = import_records(
        read_located_records(s.import_path),
        s.format,
        V,
        context_length(policy),
        tokenizer=tokenizer,
        pad_id=tokenizer.pad_token_id,
        options=import_options(s),
        source=s.import_path,
    )
    where, sampling_index = summary.pop("where"), np.asarray(summary.pop("sampling_index"), dtype=np.int32)
    if summary["message"]:
        log.warning("%s", summary["message"])
    data.update(_extra_arrays(data, extras, sampling_index if summary["mixed_sampling_params"] else None))
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
        checks, verified = _verify(store, base, spec, policy, data, where)
        data.update(checks)
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


def _extra_arrays(data: dict, extras: dict[str, np.ndarray], sampling_index: np.ndarray | None) -> dict:
    """The rollouts arrays of ``covgrad.formats.import_records``' extras: ``policy_version``,
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


def _support_bound(g: Any, advantage: np.ndarray, sampler: str) -> dict[str, float]:
    """The centering-error bound of μ known on a support (``covgrad.support_mu``): τ's summary and the factor
    β of |Ĝ_i − G_i| ≤ β · max R_i, logged in one line."""
    tail, rl = torch.from_numpy(g["mu_tail"][:]), torch.from_numpy(g["response_len"][:])
    out = {**tail_summary(tail, rl), "gradient_error_factor": gradient_error_factor(tail, torch.from_numpy(advantage))}
    log.info(
        "rollouts.samplers.%s: μ is known on a support; the mass outside it is %.3g per position on average "
        "(max %.3g), so the sampler-centred G is within %.3g × max R_i of its full-μ value (docs/formats.md)",
        sampler,
        out["support_tail_mean"],
        out["support_tail_max"],
        out["gradient_error_factor"],
    )
    return out


@task(name="rollouts")
def rollouts_task(ref: ArtifactRef, spec: RolloutsSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Generate (or import) the rollouts of sampler ``spec.sampler``."""
    s = spec.settings

    def compute(store: ArtifactStore, r: ArtifactRef) -> dict[str, Any]:
        base = upstream["base_model"]
        g, eos, pad = _import(store, r, spec, base) if s.import_path else _generate(store, r, spec, base)
        rewards = g["reward"][:]
        check_rewards(rewards)
        adv = compute_advantages(rewards, g["group"][:], spec.advantage)
        create(g, STORE, "advantage", adv.shape, rows=g["reward"].chunks[0])[:] = adv
        if "mu_tail" in g:
            g.attrs["support_mu"] = _support_bound(g, adv, spec.sampler)
        g.attrs.update(
            {
                "sampler": spec.sampler,
                "sampler_spec": s.model_dump(),
                "advantage_kind": spec.advantage,
                "eos_id": eos,
                "pad_id": pad,
                "n_samples": len(rewards),
                "mean_reward": float(np.mean(rewards)),
            }
        )
        store.consolidate(r, STORE)
        return {"n_samples": len(rewards), "mean_reward": float(np.mean(rewards))}

    return run_stage(ref, spec, compute, resumable=True)
