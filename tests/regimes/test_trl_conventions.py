"""covgrad's conventions against TRL 1.16's: the advantages named as TRL names them (against float64 references
written here, and against TRL's own reward-scaling ops run in float64), and covgrad's G against the gradient of a
real ``GRPOTrainer`` at step 0 for every ``loss_type`` and every ``scale_rewards``, with covgrad's advantage of the
same name (docs/regimes.md, "Matching TRL's GRPOTrainer"); its KL term (``use_bias_correction_kl``) against
``kl_beta``; and ``CovgradRecorder`` under ``mask_truncated_completions``. The trainer tests need the ``trl`` extra.

The trainer runs one optimizer step at learning rate 0 on a float64 one-layer Llama over a character vocabulary,
so every loss type's gradient is taken at the step-0 weights on the batch the step trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.rollouts.batch import RolloutBatch
from covgrad.rollouts.imports import records_to_rollouts
from covgrad.rollouts.problems import addition_problems, build_char_tokenizer
from covgrad.rollouts.sampling import compute_advantages
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.models import tiny_llama
from tests.helpers.trainers import StepGradient

# --- advantages against float64 references ----------------------------------------------------------------------


def _reference(r: np.ndarray, group: np.ndarray, kind: str, eps: float = 1e-4) -> np.ndarray:
    """The advantages by their definitions, group by group in plain numpy (float64); equal rewards give 0."""
    out = np.empty_like(r)
    batch_std = r.std(ddof=1) if r.size > 1 else 0.0
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        x = r[idx]
        n = len(x)
        if np.all(x == x[0]):
            out[idx] = 0.0
        elif kind == "rloo":
            out[idx] = [x[i] - np.delete(x, i).mean() for i in range(n)]
        elif kind == "group_zscore":
            out[idx] = (x - x.mean()) / (x.std(ddof=1) + eps)
        else:
            out[idx] = (x - x.mean()) / (batch_std + eps)
    return out


def _rewards(seed: int, sizes: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Rewards with ties (multiples of 0.5), one continuous group and one constant group (its label last), in
    shuffled order with arbitrary integer labels."""
    rng = np.random.default_rng(seed)
    group = np.repeat(rng.permutation(len(sizes)) * 7 - 3, sizes)
    r = rng.integers(0, 4, size=group.size) * 0.5
    r[group == group[0]] = rng.normal(size=int((group == group[0]).sum()))
    r[group == group[-1]] = 0.1  # zero variance (0.1: its float mean need not be exactly 0.1)
    order = rng.permutation(group.size)
    return r[order], group[order], int(group[-1])


@pytest.mark.parametrize("kind", ["group_zscore", "batch_zscore", "rloo"])
@pytest.mark.parametrize("sizes", [[2] * 6, [4] * 5, [2, 3, 5, 8, 4]])
def test_advantages_match_their_definitions(kind, sizes):
    for seed in range(5):
        r, group, constant = _rewards(seed, sizes)
        got = compute_advantages(r, group, kind)
        np.testing.assert_allclose(got, _reference(r, group, kind), rtol=1e-12, atol=1e-15)
        assert (got[group == constant] == 0).all() and (got != 0).sum() >= len(sizes)


def test_group_of_two_zscore_is_plus_minus_one_over_root_two():
    """Two different rewards: the sample std (n − 1) is |r1 − r2|/√2, so A = ±(1/√2) · std / (std + eps)."""
    got = compute_advantages(np.array([3.0, 1.0]), np.array([0, 0]), "group_zscore")
    std = 2.0 / np.sqrt(2.0)
    np.testing.assert_allclose(got, [1.0 / (std + 1e-4), -1.0 / (std + 1e-4)], rtol=1e-15)


def test_rloo_is_group_mean_scaled_by_n_over_n_minus_one():
    r, group, _ = _rewards(3, [4] * 6)
    np.testing.assert_allclose(
        compute_advantages(r, group, "rloo"), compute_advantages(r, group, "group_mean") * 4 / 3, atol=1e-14
    )


@pytest.mark.parametrize(("kind", "scale"), [("group_zscore", "group"), ("batch_zscore", "batch")])
def test_zscores_are_trls_reward_scaling_run_in_float64(kind, scale):
    """TRL's own ops (``nanstd``, mean centring, ``/ (std + 1e-4)``) on float64 rewards of equal groups. TRL
    computes its Bessel factor count / (count − 1) in float32 (int64 / int64), so agreement is to 1e-7."""
    utils = pytest.importorskip("trl.trainer.utils")
    n = 4
    r, _, _ = _rewards(1, [n] * 6)
    group = np.repeat(np.arange(6), n)
    t = torch.from_numpy(r)
    mean = torch.nanmean(t.view(-1, n), dim=1).repeat_interleave(n)
    std = utils.nanstd(t.view(-1, n), dim=1).repeat_interleave(n) if scale == "group" else utils.nanstd(t)
    want = torch.nan_to_num((t - mean) / (std + 1e-4)).numpy()
    np.testing.assert_allclose(compute_advantages(r, group, kind), want, rtol=1e-7, atol=1e-9)


# --- a real GRPOTrainer at step 0 ---------------------------------------------------------------------------------

G_SIZE, PROMPTS, T_MAX = 4, 3, 5  # samples per prompt, prompts per step, max_completion_length
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
ADVANTAGE_OF = {"group": "group_zscore", "batch": "batch_zscore", "none": "group_mean"}  # scale_rewards -> covgrad


def _reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """0.5 · (digit sum mod 4) of the completion's text: rewards with ties within groups."""
    return [0.5 * (sum(int(c) for c in text if c.isdigit()) % 4) for text in completions]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A float64 one-layer Llama over the character vocabulary with its tokenizer, and a perturbed copy (a KL
    reference)."""
    root = tmp_path_factory.mktemp("trl_models")
    tok = build_char_tokenizer()
    V = len(tok.get_vocab())
    model = tiny_llama(V, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, pad_token_id=0, eos_token_id=2)
    model = model.to(torch.float64)
    model.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(root / "ref")
    tok.save_pretrained(root / "ref")
    return root / "policy", root / "ref"


def _trl_step0(model_dir: Path, out: Path, ref_dir: Path | None = None, **overrides: Any) -> dict[str, Any]:
    """One GRPOTrainer step at learning rate 0, recorded by CovgradRecorder: the trainer, its records, the gradient
    the step took and the batch it took it on."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from covgrad.integrations.trl import CovgradRecorder

    problems = addition_problems(PROMPTS, 1, 0)
    data = Dataset.from_list([{"prompt": p.prompt} for p in problems])
    settings = {
        "per_device_train_batch_size": G_SIZE * PROMPTS,
        "num_generations": G_SIZE,
        "max_completion_length": T_MAX,
        "max_steps": 1,
        "learning_rate": 0.0,
        "max_grad_norm": 0.0,  # no clipping: the raw gradient
        "gradient_checkpointing": False,
        "use_cpu": True,
        "bf16": False,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        **overrides,
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    if ref_dir is not None:  # TRL builds its reference from the policy's config path
        model.config._name_or_path = str(ref_dir)
    step = StepGradient()
    recorder = CovgradRecorder(out / "covgrad", checkpoint_steps=[])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=GRPOConfig(output_dir=str(out / "trl"), **settings),
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[recorder, step.callback],
    )
    recorder.attach(trainer)
    trainer.train()
    records = [json.loads(line) for line in (out / "covgrad" / "rollouts.jsonl").read_text().splitlines()]
    return {"trainer": trainer, "records": records, "step_grad": step.grad, "batch": trainer._buffered_inputs[0]}


def _trl_ascent(run: dict[str, Any], loss_type: str, **settings: Any) -> torch.Tensor:
    """−∇ of TRL's loss of ``loss_type`` (and ``settings``, TRL attributes or args) on the step's batch, (P,)."""
    trainer = run["trainer"]
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"  # LUSPO's own setting
    for name, value in settings.items():
        setattr(trainer.args, name, value)
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    model.zero_grad()
    trainer.compute_loss(trainer.model, run["batch"]).backward()
    return -torch.cat([p.grad.reshape(-1) for p in model.parameters()]).detach().clone()


def _covgrad_G(model: Any, batch: RolloutBatch, regime: Regime, **inputs: Any) -> torch.Tensor:
    """covgrad's G = mean_n g_n of ``regime`` on ``batch`` from the per-sample engine, (P,) float64."""
    model.eval()
    psg = PerSampleGrads(model, select_parameters(model), check=False)
    fn = RegimeGrad(regime, batch.input_ids, batch.response_mask, **inputs)
    return psg(batch.input_ids, batch.attention_mask, fn, position_ids=batch.position_ids).double().mean(0)


def _rollouts(records: list[dict], vocab: int, kind: str) -> tuple[dict[str, np.ndarray], RolloutBatch]:
    """The recorded rollouts as covgrad imports them, with covgrad's advantages of ``kind``."""
    arrays = records_to_rollouts(records, vocab, None)
    adv = compute_advantages(arrays["reward"], arrays["group"], kind)
    keys = ("tokens", "prompt_len", "response_len", "response_mask")
    return arrays, RolloutBatch.from_arrays(*(arrays[k] for k in keys), adv, arrays["group"], trim=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("scale", "temperature"), [("group", 1.0), ("batch", 0.7), ("none", 1.0)])
def test_covgrad_G_is_trls_step0_gradient_for_every_loss_type(model_dirs, tmp_path, scale, temperature):
    pytest.importorskip("trl")
    run = _trl_step0(model_dirs[0], tmp_path, scale_rewards=scale, temperature=temperature, loss_type="dapo")
    trainer, records = run["trainer"], run["records"]
    arrays, batch = _rollouts(records, len(trainer.processing_class.get_vocab()), ADVANTAGE_OF[scale])
    lengths = arrays["response_len"]
    assert len(set(lengths.tolist())) > 1, "equal lengths would not tell the loss normalisations apart"
    assert batch.advantages.abs().max() > 0.1
    # covgrad's advantage of the same name is TRL's (TRL's rewards and advantages are float32)
    np.testing.assert_allclose(batch.advantages.numpy(), [r["advantage"] for r in records], rtol=1e-6, atol=1e-6)

    model = trainer.accelerator.unwrap_model(trainer.model)
    ascent = {lt: _trl_ascent(run, lt) for lt in LOSS_TYPES}
    assert _rel(-run["step_grad"], ascent["dapo"]) < 1e-12  # the post-hoc loss is the step's own
    N, tokens = batch.size, float(lengths.sum())

    def G(kind: str = "rl_token", **options: Any) -> torch.Tensor:
        return _covgrad_G(model, batch, Regime(kind, temperature=temperature, **options), advantages=batch.advantages)

    per_token, sequence = G(), G("rl")
    per_length = G(length_norm="response_length")
    constant = G(length_norm="constant", max_length=T_MAX)
    clip = min(1.0, trainer.epsilon_high)  # CISPO's detached ratio clamp(1, max=epsilon_high)
    want = {
        "grpo": per_length,
        "sapo": per_length,
        "dr_grpo": constant,
        "luspo": sequence,
        "bnpo": per_token * N / tokens,
        "dapo": per_token * N / tokens,
        "vespo": per_token * N / tokens,
        "cispo": per_token * N / tokens * clip,
    }
    errors = {lt: _rel(want[lt], ascent[lt]) for lt in LOSS_TYPES}
    assert max(errors.values()) < 1e-5, errors
    assert _rel(per_length, ascent["dapo"]) > 1e-2  # the normalisations differ on this batch


def test_kl_beta_is_trls_bias_corrected_kl(model_dirs, tmp_path):
    """TRL's β·ρ·k3 per token (use_bias_correction_kl=True, its default) has at ρ = 1 the gradient of covgrad's
    per-token penalty −β·(log p − log p_ref); with False TRL differentiates k3, which is another gradient."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    beta = 0.5
    run = _trl_step0(model_dirs[0], tmp_path, ref_dir=model_dirs[1], beta=beta, loss_type="grpo", temperature=0.7)
    trainer = run["trainer"]
    _, batch = _rollouts(run["records"], len(trainer.processing_class.get_vocab()), "group_zscore")
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float64).eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    model = trainer.accelerator.unwrap_model(trainer.model)
    grpo = {"kind": "rl_token", "temperature": 0.7, "length_norm": "response_length"}
    G = _covgrad_G(model, batch, Regime(**grpo, kl_beta=beta), advantages=batch.advantages, ref_logits=ref_logits)
    without_kl = _covgrad_G(model, batch, Regime(**grpo), advantages=batch.advantages)
    corrected = _trl_ascent(run, "grpo", use_bias_correction_kl=True)
    assert _rel(G, corrected) < 1e-5
    assert _rel(without_kl, corrected) > 1e-2  # the reference differs: the KL term is tested
    assert _rel(G, _trl_ascent(run, "grpo", use_bias_correction_kl=False)) > 1e-3


def test_masked_truncated_completions_are_recorded_with_advantage_zero(model_dirs, tmp_path):
    """With mask_truncated_completions the recorder keeps truncated completions whole at advantage 0, and their
    imported per-token advantages give TRL's gradient (dapo: over the unmasked tokens)."""
    pytest.importorskip("trl")
    run = _trl_step0(model_dirs[0], tmp_path, mask_truncated_completions=True, loss_type="dapo")
    trainer, records = run["trainer"], run["records"]
    assert len(records) == G_SIZE * PROMPTS
    ends = {trainer.processing_class.eos_token_id, trainer.processing_class.pad_token_id}
    truncated = np.array([r["response_ids"][-1] not in ends for r in records])  # TRL's test
    assert truncated.any() and not truncated.all()
    assert all(len(r["response_ids"]) == T_MAX for r, t in zip(records, truncated, strict=True) if t)
    assert all(r["advantage"] == 0.0 for r, t in zip(records, truncated, strict=True) if t)
    assert any(r["advantage"] != 0.0 for r, t in zip(records, truncated, strict=True) if not t)
    assert all(r["advantages"] == [r["advantage"]] * len(r["response_ids"]) for r in records)

    arrays, batch = _rollouts(records, len(trainer.processing_class.get_vocab()), "group_zscore")
    model = trainer.accelerator.unwrap_model(trainer.model)
    imported = torch.from_numpy(arrays["token_advantage"])
    G = _covgrad_G(model, batch, Regime("rl_token"), advantages=imported)
    unmasked = float(arrays["response_len"][~truncated].sum())
    assert _rel(G * batch.size / unmasked, _trl_ascent(run, "dapo")) < 1e-5


# --- TRL's completion rows as the imported advantages --------------------------------------------------------------


def test_preflight_takes_trl_rows_advantage_as_the_imported_advantages(tmp_path):
    """A ``format: trl`` dump feeds ``advantages: imported`` from its ``advantage`` column; a row without it is
    refused before any stage, in one line naming its file and line."""
    from flows.preflight import preflight
    from tests.helpers.pipeline import tiny_config

    def row() -> dict:
        return {"step": 0, "prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [-0.1, -0.2], "reward": 1.0}

    def config(records: list[dict]) -> Any:
        path = tmp_path / "trl.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return tiny_config(
            str(tmp_path / "root"),
            **{
                "rollouts.samplers.engine": {"import_path": str(path), "on_policy": True, "format": "trl"},
                "regimes": {"tok": {"kind": "rl_token", "sampler": "engine", "advantages": "imported"}},
            },
        )

    preflight(config([{**row(), "advantage": 0.5}, {**row(), "advantage": -0.5}]), architecture=False)
    with pytest.raises(ValueError, match=r"^regimes\.tok: .*trl\.jsonl:2 has no 'advantage' field \(format trl") as e:
        preflight(config([{**row(), "advantage": 0.5}, row()]), architecture=False)
    assert "\n" not in str(e.value)
