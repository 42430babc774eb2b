"""rollouts stage: responses from a sampler (or imported), rewards, advantages, the sampler's μ.

Store ``rollouts.zarr`` (arrays, dims, dtypes, chunks and attributes declared in ``storage/schema.py``):
per sample the token row (prompt, then response, right-padded), the response mask, prompt and response
lengths and texts, ``group``, ``prompt_index`` and ``sample_index`` (coordinates along ``sample``),
reward, advantage and the sampler's token log-probs; optionally μ (``mu_logp`` over the vocabulary, or
``mu_topk_ids`` / ``mu_topk_logp`` / ``mu_tail``); and the ``batch_done`` progress array. Generation
is resumable by batch of prompts; advantages are written once all rewards exist (``global_mean`` needs
them all). An import reads the sampler's ``format`` through ``covgrad.rollouts.formats`` and adds what the dump
says about each record (``policy_version``, ``stack_advantage``, ``token_advantage``,
``sampling_params_index``, with ``verify_records`` the re-scored ``verify_kl`` / ``verify_k3_kl``; attrs
``import``); a μ record on a support adds attrs ``support_mu``, the bound of its centering error. A dataset of
responses (``format: responses``) records ``mu_known: false`` (its ``sampler_logp`` is NaN) and, without rewards,
``rewards: false`` (``reward`` and ``advantage`` NaN, ``mean_reward`` null). Generated rollouts record the
identity of the sampler's weights (attrs ``sampler_identity``, ``storage.identity``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.identity import model_identity
from covgrad.models import context_length
from covgrad.rollouts import (
    SamplerSpec,
    check_context,
    check_rewards,
    check_sampler_logp,
    compute_advantages,
    generate,
    response_texts,
    score_rewards,
)
from covgrad.scores import gradient_error_factor, tail_summary
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from storage.identity import SAMPLER_IDENTITY_ATTR
from storage.models import load_models
from storage.schema import ROLLOUTS as STORE
from storage.schema import create
from storage.stores.prompts import load_task, prompt_places
from storage.stores.rollouts import create_rollout_arrays, dataset_attrs, write_rollout_rows
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.jobs.rollout_import import import_rollouts, sampler_source
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
    own = s.model != "policy" or s.dtype is not None  # a sampler model of its own (another dtype: a copy)
    sampler = load_models(store, base, s.model, sampler_source(spec.policy, s))[0] if own else policy
    V = policy.get_input_embeddings().num_embeddings
    if sampler.get_input_embeddings().num_embeddings != V:
        raise ValueError(f"sampler model {s.model!r} has a different vocabulary size than the policy ({V})")
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    where = prompt_places(spec.task, len(problems))
    # preflight checked the same with tokenizer.json; this is the loaded tokenizer's word
    check_context(
        [len(p) for p in prompts],
        where,
        s.max_new_tokens,
        context_length(policy, tokenizer, spec.policy.max_length),
        f"rollouts.samplers.{name}",
    )
    G, T = s.group_size, s.max_new_tokens
    per_batch = max(1, s.batch_size // G)
    n_batches = -(-len(prompts) // per_batch)
    N, width = len(prompts) * G, max(len(p) for p in prompts) + T
    g = store.open_group(ref, STORE, mode="a")
    create_rollout_arrays(g, N, width, T, V, per_batch * G, s)
    g.attrs[SAMPLER_IDENTITY_ATTR] = model_identity(sampler.named_parameters())
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


def _support_bound(g: Any, advantage: np.ndarray, sampler: str) -> dict[str, float]:
    """The centering-error bound of μ known on a support (``covgrad.scores.support_mu``): τ's summary and the factor
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
        g, eos, pad = (
            import_rollouts(store, r, spec, base, warn=lambda line: log.warning("%s", line))
            if s.import_path
            else _generate(store, r, spec, base)
        )
        if s.mu_known:  # a dataset of responses records no μ (NaN): nothing to check
            check_sampler_logp(g["sampler_logp"][:], f"rollouts.samplers.{spec.sampler}")
        rewards = g["reward"][:]
        rewarded = s.mu_known or not np.isnan(rewards).all()  # a dataset without rewards imports NaN
        if rewarded:
            check_rewards(rewards)
            adv = compute_advantages(rewards, g["group"][:], spec.advantage)
        else:  # no rewards, so no advantages: NaN, never invented
            adv = np.full(len(rewards), np.nan)
        create(g, STORE, "advantage", adv.shape, rows=g["reward"].chunks[0])[:] = adv
        if "mu_tail" in g:
            g.attrs["support_mu"] = _support_bound(g, adv, spec.sampler)
        mean_reward = float(np.mean(rewards)) if rewarded else None
        g.attrs.update(
            {
                "sampler": spec.sampler,
                "sampler_spec": s.model_dump(),
                "advantage_kind": spec.advantage,
                "eos_id": eos,
                "pad_id": pad,
                "n_samples": len(rewards),
                "mean_reward": mean_reward,
                **dataset_attrs(s.mu_known, rewarded),
            }
        )
        store.consolidate(r, STORE)
        return {"n_samples": len(rewards), "mean_reward": mean_reward}

    return run_stage(ref, spec, compute, resumable=True)
