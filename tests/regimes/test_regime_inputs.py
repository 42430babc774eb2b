"""Regime inputs: imported per-token fields, and the preflight's one-line refusals before any stage."""

import json

import numpy as np
import pytest

from covgrad.rollouts.imports import records_to_rollouts
from tests.helpers.pipeline import tiny_config


def _rec(**extra):
    return {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "reward": 1.0, "logprobs": [-0.1, -0.2, -0.3], **extra}


def test_imported_per_token_fields_are_token_aligned():
    out = records_to_rollouts(
        [
            _rec(advantages=[0.5, -1.0, 2.0], teacher_logprobs=[-1.0, -2.0, -3.0]),
            _rec(advantages=[1, 1, 1], teacher_logprobs=[0, 0, 0]),
        ],
        vocab_size=8,
        max_len=None,
    )
    np.testing.assert_array_equal(out["token_advantage"][0], [0, 0, 0.5, -1.0, 2.0])
    np.testing.assert_array_equal(out["teacher_logprob"][0], np.float32([0, 0, -1, -2, -3]))
    assert out["token_advantage"].dtype == np.float64 and out["teacher_logprob"].dtype == np.float32


def test_imported_advantages_of_the_wrong_length_are_refused_with_their_line():
    with pytest.raises(ValueError, match=r"^r\.jsonl:2: 'advantages' has 2 entries for 3 response tokens$"):
        records_to_rollouts(
            [("r.jsonl:1", _rec(advantages=[0, 0, 0])), ("r.jsonl:2", _rec(advantages=[0, 0]))], 8, None
        )
    with pytest.raises(ValueError, match="lacks 'advantages'"):
        records_to_rollouts([_rec(advantages=[0, 0, 0]), _rec()], 8, None)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_preflight_refuses_bad_regime_inputs_in_one_line(tmp_path):
    from flows.preflight import preflight

    bad = _write(tmp_path / "bad.jsonl", [_rec(advantages=[0, 0, 0]), _rec(advantages=[0])])
    cfg = tiny_config(
        str(tmp_path / "root"),
        **{
            "rollouts.samplers.engine": {"import_path": bad, "on_policy": True},
            "regimes": {"tok": {"kind": "rl_token", "sampler": "engine", "advantages": "imported"}},
        },
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'advantages' has 1 entries for 3 response tokens"):
        preflight(cfg, architecture=False)
    plain = _write(tmp_path / "plain.jsonl", [_rec(), _rec()])
    cfg = tiny_config(
        str(tmp_path / "root"),
        **{
            "rollouts.samplers.engine": {"import_path": plain, "on_policy": True},
            "regimes": {"tok": {"kind": "rl_token", "sampler": "engine", "advantages": "imported"}},
        },
    )
    with pytest.raises(ValueError, match=r"regimes\.tok: .*plain\.jsonl:1 has no 'advantages' field"):
        preflight(cfg, architecture=False)


def test_preflight_refuses_a_teacher_with_another_vocabulary(tmp_path):
    from flows.preflight import preflight

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 7})
    )
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(teacher / "model.safetensors"))
    cfg = tiny_config(str(tmp_path / "root"), regimes={"d": {"kind": "distill_reverse_kl", "teacher": str(teacher)}})
    with pytest.raises(ValueError, match=r"^regimes\.d\.teacher .*vocabulary 7.*policy"):
        preflight(cfg, architecture=False)


def test_config_refuses_an_sft_regime_without_responses():
    with pytest.raises(ValueError, match="sft_sampled needs responses"):
        tiny_config("runs", regimes={"s": {"kind": "sft_sampled"}})
    with pytest.raises(ValueError, match="sft_drift needs a teacher"):
        tiny_config("runs", regimes={"s": {"kind": "sft_drift", "sampler": "stale"}})
    with pytest.raises(ValueError, match="regimes.s.sampler 'nope' is not one of"):
        tiny_config("runs", regimes={"s": {"kind": "sft_sampled", "sampler": "nope"}})


def test_a_regime_setting_changes_exactly_its_fold_the_regimes_stage_and_the_report():
    from tasks.specs import plan

    base = {"d": {"kind": "distill_reverse_kl", "teacher": "stale"}, "r": {"kind": "rl"}}
    p0 = plan(tiny_config("runs", regimes=base))
    p1 = plan(tiny_config("runs", regimes={**base, "d": {**base["d"], "teacher_temperature": 0.5}}))
    # the update check steps each regime's loss and reads the regimes statistics
    assert {n for n in p0 if p0[n].ref.key != p1[n].ref.key} == {"regime.d", "regimes", "update_check", "report"}
    p2 = plan(tiny_config("runs", regimes=base, **{"scores.checkpoint_batches": 7}))
    assert {n for n in p0 if p0[n].ref.key != p2[n].ref.key} == {"report"}  # placement: no key below the report
    assert list(plan(tiny_config("runs"))) == [n for n in p0 if not n.startswith("regime")]
