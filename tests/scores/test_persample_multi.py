"""The multi-cotangent pass (PerSampleGrads.accumulate_many): one forward, the score's and regimes' per-sample
gradients folded into their own accumulators, byte for byte what separate passes fold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.regimes.fold import RegimeMoments
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import Cotangent, PerSampleGrads
from tests.helpers.families import FAMILIES
from tests.helpers.families_hybrid import family_model
from tests.helpers.persample import BATCH, MODELS, V, make_batch

BUILDERS = {
    "llama-tied": MODELS["llama-tied"],
    "llama-untied": MODELS["llama-untied"],
    "qwen3": FAMILIES["qwen3"],
    "qwen3-moe": FAMILIES["qwen3-moe"],
    "deepseek-v3": lambda: family_model("deepseek-v3"),  # flattened MoE, router on the generic path
}

# (seed, each sample's half): two left-padded batches, the second merging into started halves
BATCHES = ((43, [0, 1, 0, 1]), (44, [1, 1, 0, 1]))


def _inputs(seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    batch = make_batch(seed, **BATCH)
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(*batch["input_ids"].shape, V, generator=gen)
    adv = torch.randn(batch["input_ids"].shape, generator=gen, dtype=torch.float64)
    return batch, teacher, adv


def _regimes(batch: dict, teacher: torch.Tensor, adv: torch.Tensor) -> list[RegimeGrad]:
    ids, mask = batch["input_ids"], batch["target_mask"]
    return [
        RegimeGrad(Regime("distill_reverse_kl"), ids, mask, teacher_logits=teacher),
        RegimeGrad(Regime("rl_token"), ids, mask, advantages=adv),
    ]


def _state(acc: MomentAccumulator) -> dict[str, np.ndarray]:
    return acc.rows()


def _same_bytes(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_forward_folds_the_same_bytes_as_separate_passes(name):
    model = BUILDERS[name]().eval()
    layout = select_parameters(model)
    separate = PerSampleGrads(model, layout, check=True)
    fused = PerSampleGrads(model, layout, check=True)
    accs = [MomentAccumulator(layout.P, "cpu") for _ in range(2)]
    moms = [[RegimeMoments(layout.P, "cpu") for _ in range(2)] for _ in range(2)]
    rows_sep, rows_fused = [], []
    for seed, half in BATCHES:
        batch, teacher, adv = _inputs(seed)
        args = (batch["input_ids"], batch["attention_mask"])
        pos = batch["position_ids"]
        score = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        a, h = torch.linspace(-1.0, 1.0, 4), torch.tensor(half)
        out = torch.empty(4, layout.P)
        separate.accumulate(*args, score, accs[0], a, h, pos)
        for mom, fn in zip(moms[0], _regimes(batch, teacher, adv), strict=True):
            mom.fold(separate, *args, fn, h, pos, out=out)
        rows_sep.append(out.clone())
        fns = _regimes(batch, teacher, adv)
        out2 = torch.empty(4, layout.P)
        moms[1][1].fold(
            fused,
            *args,
            fns[1],
            h,
            pos,
            out=out2,
            also=[Cotangent(score, accs[1], a, h), moms[1][0].cotangent(fns[0], h)],
        )
        rows_fused.append(out2)
    _same_bytes(_state(accs[0]), _state(accs[1]))
    for m0, m1 in zip(*moms, strict=True):
        _same_bytes(_state(m0.acc), _state(m1.acc))
        assert m0.bound_sum.tobytes() == m1.bound_sum.tobytes()
        assert m0.bound_count.tolist() == m1.bound_count.tolist() == [3.0, 5.0]
        assert m1.acc.c is None and "c_as" not in m1.acc.rows()  # groups of one size: no co-moment kept
    for r0, r1 in zip(rows_sep, rows_fused, strict=True):
        assert r0.numpy().tobytes() == r1.numpy().tobytes()
    assert accs[1].count.tolist() == [3.0, 5.0]


def test_compiled_fold_and_float32_state_fold_the_same_bytes():
    """The started merges of the compiled fold and the float32 state, fused against separate."""
    model = BUILDERS["llama-untied"]().eval()
    layout = select_parameters(model)
    psg = PerSampleGrads(model, layout, check=False)
    for state_dtype in ("float64", "float32"):
        accs = [MomentAccumulator(layout.P, "cpu", state_dtype, compiled=True) for _ in range(4)]
        for seed, half in BATCHES:
            batch, teacher, adv = _inputs(seed)
            args = (batch["input_ids"], batch["attention_mask"])
            score = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
            fn = _regimes(batch, teacher, adv)[0]
            a, h, zero = torch.linspace(-1.0, 1.0, 4), torch.tensor(half), np.zeros(4)
            psg.accumulate(*args, score, accs[0], a, h, batch["position_ids"])
            psg.accumulate(*args, fn, accs[1], zero, h, batch["position_ids"])
            psg.accumulate_many(
                *args, [Cotangent(score, accs[2], a, h), Cotangent(fn, accs[3], zero, h)], batch["position_ids"]
            )
        assert accs[2].fold_path == "compiled"
        _same_bytes(_state(accs[0]), _state(accs[2]))
        _same_bytes(_state(accs[1]), _state(accs[3]))


def test_multi_pass_refuses_shared_or_missing_accumulators_and_aborts_every_batch_on_failure():
    model = BUILDERS["llama-untied"]().eval()
    layout = select_parameters(model)
    psg = PerSampleGrads(model, layout, check=False)
    batch, _, _ = _inputs(43)
    args = (batch["input_ids"], batch["attention_mask"])
    score = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    acc, h = MomentAccumulator(layout.P, "cpu"), np.arange(4) % 2
    with pytest.raises(ValueError, match="at least one cotangent"):
        psg.accumulate_many(*args, [])
    with pytest.raises(ValueError, match="its own accumulator"):
        psg.accumulate_many(*args, [Cotangent(score, acc, np.ones(4), h), Cotangent(score, acc, np.ones(4), h)])
    other = MomentAccumulator(layout.P, "cpu")

    def broken(z: torch.Tensor) -> torch.Tensor:
        return z[:, :-1]

    with pytest.raises(ValueError, match="dlogits_fn must return"):
        psg.accumulate_many(*args, [Cotangent(score, acc, np.ones(4), h), Cotangent(broken, other, np.zeros(4), h)])
    # every batch was aborted (the state is then restored from a checkpoint, as after any failed accumulate)
    assert acc.count.tolist() == other.count.tolist() == [0.0, 0.0]
    psg.accumulate_many(*args, [Cotangent(score, other, np.ones(4), h)])
    assert other.count.tolist() == [2.0, 2.0]
