"""rollouts stage: responses from a sampler (or imported), rewards, advantages, the sampler's μ.

Store ``rollouts.zarr`` (arrays, dims, dtypes, chunks and attributes declared in ``storage/schema.py``):
per sample the token row (prompt, then response, right-padded), the response mask, prompt and response
lengths and texts, ``group``, ``prompt_index`` and ``sample_index`` (coordinates along ``sample``),
reward, advantage and the sampler's token log-probs; optionally μ (``mu_logp`` over the vocabulary, or
``mu_topk_ids`` / ``mu_topk_logp`` / ``mu_tail``); and the ``batch_done`` progress array. Generation
is resumable by batch of prompts; advantages are written once all rewards exist (``global_mean`` needs
them all).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prefect import task

from covgrad.inputs import check_context
from covgrad.models import context_length
from covgrad.problems import response_texts, score_rewards
from covgrad.rollout_import import records_to_rollouts
from covgrad.sampling import SamplerSpec, check_rewards, compute_advantages, generate
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from storage.models import load_models
from storage.prompts import load_task, prompt_places
from storage.readers import read_located_records
from storage.regimes import create_imported_token_arrays
from storage.rollouts import create_rollout_arrays, write_rollout_rows
from storage.schema import ROLLOUTS as STORE
from storage.schema import create
from tasks.common import StageResult, progress_bar, run_stage
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


def _import(store: ArtifactStore, ref: ArtifactRef, spec: RolloutsSpec, base: ArtifactRef):
    s = spec.settings
    assert s.import_path is not None
    policy, tokenizer = load_models(store, base, "policy", spec.policy)
    V = policy.get_input_embeddings().num_embeddings
    data = records_to_rollouts(
        read_located_records(s.import_path),
        V,
        context_length(policy),
        tokenizer=tokenizer,
        pad_id=tokenizer.pad_token_id,
    )
    order = np.argsort(data["group"], kind="stable")
    data = {k: v[order] for k, v in data.items()}
    sizes = np.bincount(data["group"])
    if np.any(sizes != sizes[0]):
        bad = int(np.flatnonzero(sizes != sizes[0])[0])
        raise ValueError(
            f"imported group {bad} has {sizes[bad]} samples but group 0 has {sizes[0]}; "
            "covgrad needs groups of equal size"
        )
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
    create_progress(g, STORE, 1)
    rows = {k: v for k, v in data.items() if k != "reward"}
    for k in ("prompt_len", "response_len", "group", "prompt_index", "sample_index"):
        rows[k] = rows[k].astype(np.int32)
    rows["reward"] = data["reward"]
    rows["prompt"] = np.asarray(prompts, dtype=object).astype(str)
    rows["response"] = np.asarray(texts, dtype=object).astype(str)
    write_rollout_rows(g, 0, rows, width)
    mark_batch_done(g, 0)
    return g, tokenizer.eos_token_id, tokenizer.pad_token_id


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
