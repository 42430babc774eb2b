"""The tiny models and rows of the trajectory tests: a 2-layer Llama, fixed rollouts, an on-policy source
and step 1's rows built by hand; the tiny pipeline's trajectory settings and an artifact's file digests."""

import hashlib
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from covgrad.rollouts.sampling import SamplerSpec, compute_advantages, generate
from covgrad.updates.stepping import OnPolicy, step_seed

VOCAB, EOS, PAD, SEED = 16, 15, 0, 7
GROUP, PER_STEP = 4, 2
SAMPLER = SamplerSpec(max_new_tokens=4)
LRS = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer Llama of width 16 over VOCAB tokens, seeded, in eval mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


def rollouts(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """Fixed right-padded rows (prompt, response, pad) with random tokens and centred advantages; their prompt
    and response lengths (n,)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, 4, (n,), generator=g)
    response_len = torch.randint(2, 6, (n,), generator=g)
    L = int((prompt_len + response_len).max()) + 1
    input_ids = torch.zeros(n, L, dtype=torch.long)
    attention_mask = torch.zeros(n, L, dtype=torch.long)
    response_mask = torch.zeros(n, L, dtype=torch.bool)
    for i in range(n):
        end = int(prompt_len[i] + response_len[i])
        input_ids[i, :end] = torch.randint(1, VOCAB, (end,), generator=g)
        attention_mask[i, :end] = 1
        response_mask[i, int(prompt_len[i]) : end] = True
    rewards = torch.randn(n, generator=g)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "advantages": rewards - rewards.mean(),
        "prompt_len": prompt_len,
        "response_len": response_len,
    }


def even_fraction(out, prompt_of):
    """Reward: the fraction of a response's tokens that are even ids."""
    return np.asarray(
        [
            float((row[int(p) : int(p) + int(r)] % 2 == 0).float().mean())
            for row, p, r in zip(out["tokens"], out["prompt_len"], out["response_len"], strict=True)
        ]
    )


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 1]]


def on_policy() -> OnPolicy:
    return OnPolicy(PROMPTS, even_fraction, GROUP, SAMPLER, PER_STEP, SEED, EOS, PAD)


def hand_rows(model):
    """Step 1's rows built by hand: the epoch-0 prompt order, generate at step_seed(SEED, 1), rewards,
    group-mean advantages."""
    idx = [int(i) for i in np.random.default_rng([SEED, 0]).permutation(len(PROMPTS))[:PER_STEP]]
    out = generate(model, [PROMPTS[i] for i in idx], [0, 1], GROUP, SAMPLER, step_seed(SEED, 1), 64, EOS, PAD)
    total = out["prompt_len"] + out["response_len"]
    attn = (torch.arange(out["tokens"].shape[1])[None] < total[:, None]).long()
    A = compute_advantages(even_fraction(out, None), out["prompt_index"].numpy(), "group_mean")
    return out["tokens"].long(), attn, out["response_mask"], torch.from_numpy(A)


# the tiny pipeline with a 6-step trajectory (resume state every 2 steps) and nothing else optional
STEPS = 6
OVERRIDES = {
    "tokens.enabled": False,
    "update_check.enabled": False,
    "trajectory.enabled": True,
    "trajectory.steps": STEPS,
    "trajectory.state_every": 2,
    "trajectory.lr": 1e-3,
    "trajectory.prompts_per_step": 2,
}


def digests(artifact: Path) -> dict[str, str]:
    """sha256 of every file of an artifact except its bookkeeping (marker, claim, manifest, zarr.json)."""
    skip = {"_COMPLETE.json", "_STARTED.json", "_MANIFEST.json", "zarr.json"}
    return {
        str(p.relative_to(artifact)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(artifact.rglob("*"))
        if p.is_file() and p.name not in skip
    }
