"""Verifying imported μ: a fraction of the records re-scored by the policy, per-record KL between the file's
log-probs and the recomputed ones, and one warning line naming the records whose log-probs came from another
checkpoint."""

import json

import numpy as np
import pytest
import torch

from covgrad.config import DemoModel
from covgrad.rollouts.imports import record_mismatch, verification_warning
from covgrad.rollouts.sampling import SamplerSpec, generate, recompute_sampler_logp
from storage.artifacts import ArtifactStore
from storage.models import load_model_and_tokenizer
from storage.schema import ROLLOUTS
from tasks.specs import plan
from tests.helpers.pipeline import run_planned
from tests.helpers.user import PROMPTS, user_config, write_checkpoint

G = 4
PLANTED = (3, 10)  # 1-based lines whose log-probs come from the other checkpoint


def test_record_mismatch_against_numpy():
    rng = np.random.default_rng(0)
    f, r = -rng.random((3, 4)) * 3, -rng.random((3, 4)) * 3
    rl = np.array([4, 2, 1])
    m = record_mismatch(f, r, rl)
    for n, k in enumerate(rl):
        d = r[n, :k] - f[n, :k]
        assert m["kl"][n] == pytest.approx(-d.mean())
        assert m["k3_kl"][n] == pytest.approx((np.exp(d) - d - 1).mean())
        assert m["max_abs_diff"][n] == pytest.approx(np.abs(d).max())
    same = record_mismatch(f, f, rl)
    assert (same["kl"] == 0).all() and (same["k3_kl"] == 0).all()


def test_warning_is_one_line_naming_the_worst_record():
    msg = verification_warning("rollouts.samplers.x", ["f:1", "f:2", "f:3"], np.array([0.0, 0.2, 0.07]), 0.05, "p")
    assert (
        "\n" not in msg and msg.startswith("rollouts.samplers.x: 2 of 3 verified records") and "worst f:2: 0.2" in msg
    )
    assert verification_warning("s", ["f:1"], np.array([0.01]), 0.05, "p") is None


def _records(policy_dir, other_dir) -> str:
    model, tok = load_model_and_tokenizer(str(policy_dir), "float32", False)
    other, _ = load_model_and_tokenizer(str(other_dir), "float32", False)
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in PROMPTS[:4]]
    spec = SamplerSpec(max_new_tokens=3)
    out = generate(model, prompts, list(range(len(prompts))), G, spec, 0, 64, tok.eos_token_id, tok.pad_token_id)
    tokens, pl, rl = out["tokens"], out["prompt_len"], out["response_len"]
    lines = []
    for n in range(len(pl)):
        source = other if n + 1 in PLANTED else model
        log_mu = recompute_sampler_logp(source, tokens[n : n + 1], pl[n : n + 1], rl[n : n + 1], spec)[0]
        p, r = int(pl[n]), int(rl[n])
        response = tokens[n, p : p + r].tolist()
        logprobs = [float(log_mu[t, y]) for t, y in zip(range(p - 1, p + r - 1), response, strict=True)]
        rec = {
            "prompt_ids": tokens[n, :p].tolist(),
            "response_ids": response,
            "reward": float(n % 2),
            "logprobs": logprobs,
        }
        lines.append(json.dumps(rec))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from covgrad.models import build_demo_model
    from covgrad.rollouts.problems import build_char_tokenizer

    tmp = tmp_path_factory.mktemp("verify")
    ckpt = write_checkpoint(tmp / "ckpt")
    tok = build_char_tokenizer()
    other = build_demo_model(DemoModel(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, seed=1), tok)
    with torch.no_grad():
        other.lm_head.weight.mul_(4.0)  # another checkpoint: seed 1, and a sharper head than the random policy's
    other.save_pretrained(tmp / "other")
    tok.save_pretrained(tmp / "other")
    path = tmp / "dump.jsonl"
    path.write_text(_records(ckpt, tmp / "other"))
    return tmp, ckpt, path


def _rollouts(tmp, ckpt, path, root, **sampler):
    samplers = {"engine": {"import_path": str(path), "on_policy": True, **sampler}}
    cfg = user_config(
        tmp / root, ckpt, tmp / "task.jsonl", **{"rollouts.samplers": samplers, "rollouts.analyse": "engine"}
    )
    names = {n for n, s in plan(cfg).items() if s.ref.stage in ("base_model", "rollouts")}
    refs = {n: r.ref for n, r in run_planned(cfg, names).items()}
    return ArtifactStore(cfg.root).open_group(refs["rollouts.engine"], ROLLOUTS, mode="r")


@pytest.mark.slow
def test_verification_flags_records_from_another_checkpoint(planted, monkeypatch):
    import tasks.rollouts

    logged = []
    monkeypatch.setattr(tasks.rollouts.log, "warning", lambda msg, *args: logged.append(msg % args))
    tmp, ckpt, path = planted
    g = _rollouts(tmp, ckpt, path, "runs-all", verify_records=100)
    k3 = g["verify_k3_kl"][:]
    planted_rows = np.array([n + 1 in PLANTED for n in range(len(k3))])  # groups are already in file order
    assert (k3[~planted_rows] < 1e-6).all() and (k3[planted_rows] > 0.05).all()
    info = g.attrs["import"]["verify"]
    assert info["records"] == len(k3) and info["model"] == "the policy"
    assert info["outliers"] == [f"{path}:{line}" for line in PLANTED]
    warnings = [m for m in logged if "verified records" in m]
    assert warnings == [info["warning"]] and "\n" not in warnings[0]
    assert "2 of 16 verified records have per-token k3-KL above 0.05 nats" in warnings[0]
    assert f"(worst {path}:{PLANTED[int(np.argmax(k3[planted_rows]))]}:" in warnings[0]


@pytest.mark.slow
def test_verify_records_rescores_a_subset(planted):
    tmp, ckpt, path = planted
    g = _rollouts(tmp, ckpt, path, "runs-half", verify_records=8)
    kl = g["verify_kl"][:]
    assert np.isnan(kl).sum() == 8 and g.attrs["import"]["verify"]["records"] == 8
