"""The zero-mismatch null test: rollouts sampled from the policy and imported with μ ≡ p (the policy's own
log-probabilities over the whole vocabulary, or ``mu_model`` = the policy's directory) give sampler-centred
statistics equal to the policy-centred ones to 1e-6 relative, a zero-mean statistic in its null band, and an
off-policy table with no mismatch."""

import json

import numpy as np
import pytest

from covgrad.report.sections import null_line, null_tests
from covgrad.rollouts.sampling import SamplerSpec, generate, recompute_sampler_logp
from storage.artifacts import ArtifactStore
from storage.models import load_model_and_tokenizer
from tasks.specs import plan
from tests.helpers.pipeline import run_planned
from tests.helpers.user import PROMPTS, user_config, write_checkpoint

G = 8

pytestmark = pytest.mark.slow


def policy_records(ckpt) -> list[dict]:
    """G responses per prompt drawn from the checkpoint at temperature 1, with the checkpoint's own log-probs
    of the sampled tokens and of the whole vocabulary at every position."""
    model, tok = load_model_and_tokenizer(str(ckpt), "float32", False)
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in PROMPTS]
    spec = SamplerSpec(max_new_tokens=3)
    out = generate(model, prompts, list(range(len(prompts))), G, spec, 0, 64, tok.eos_token_id, tok.pad_token_id)
    tokens, pl, rl = out["tokens"], out["prompt_len"], out["response_len"]
    log_mu = recompute_sampler_logp(model, tokens, pl, rl, spec)  # (N, L, V)
    records = []
    for n in range(len(pl)):
        p, r = int(pl[n]), int(rl[n])
        pos = range(p - 1, p + r - 1)
        response = tokens[n, p : p + r].tolist()
        records.append(
            {
                "prompt_ids": tokens[n, :p].tolist(),
                "response_ids": response,
                "reward": float(n % 3 == 0),
                "logprobs": [float(log_mu[n, t, y]) for t, y in zip(pos, response, strict=True)],
                "top_logprobs": [[list(range(log_mu.shape[2])), log_mu[n, t].tolist()] for t in pos],
                "group": int(out["prompt_index"][n]),
            }
        )
    return records


@pytest.fixture(scope="module")
def null_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("null")
    ckpt = write_checkpoint(tmp / "ckpt")
    path = tmp / "onpolicy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in policy_records(ckpt)))
    samplers = {
        "engine": {"import_path": str(path)},
        "rescored": {"import_path": str(path), "mu_model": str(ckpt)},
    }
    cfg = user_config(
        tmp / "runs",
        ckpt,
        tmp / "task.jsonl",
        **{"rollouts.samplers": samplers, "rollouts.analyse": "engine"},
    )
    names = {
        n for n, s in plan(cfg).items() if s.ref.stage in ("base_model", "rollouts", "scores", "stats", "offpolicy")
    }
    refs = {n: r.ref for n, r in run_planned(cfg, names).items()}
    return ArtifactStore(cfg.root), refs


@pytest.mark.parametrize("sampler", ["engine", "rescored"])
def test_sampler_centering_with_mu_equal_p_changes_nothing(null_run, sampler):
    store, refs = null_run
    s = store.open_group(refs[f"stats.{sampler}.sampler"], "stats.zarr", mode="r")
    p = store.open_group(refs[f"stats.{sampler}.policy"], "stats.zarr", mode="r")
    for name in ("m", "F", "Fvar", "G", "Cov"):
        a, b = s[name][:], p[name][:]
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), name
    for key in ("zero_mean_trace", "zero_mean_coord"):
        a, b = s.attrs["scalars"][key], p.attrs["scalars"][key]
        assert a == pytest.approx(b, rel=1e-6), key
    z = p.attrs["scalars"]["zero_mean_trace"]
    assert 0.2 < z < 3.0  # the null band of N·|m|²/tr Var(s) with E[s] = 0 (≈ 1)
    assert s.attrs["scalars"]["kl_sampler_policy_per_token"] < 1e-6


def test_offpolicy_table_shows_no_mismatch(null_run):
    store, refs = null_run
    rows = json.loads(store.fs.cat_file(store.path(refs["offpolicy"], "offpolicy.json")))
    for r in rows:
        assert r["rel_diff_G"] < 1e-6 and r["k3_kl"] < 1e-9 and r["rollout_probs_diff_max"] < 1e-5, r
        assert r["rel_diff_stats"] < 1e-6, r
    nulls = null_tests(rows)  # the report's null-test lines: both imports
    assert sorted(n["sampler"] for n in nulls) == ["engine", "rescored"]
    for n in nulls:
        assert 0.2 < n["zero_mean_trace_sampler"] < 3.0 and "Null test, sampler" in null_line(n)
        assert n["sampler_weights"] == "unknown" and "weights" not in null_line(n)  # imported: no identity
