"""covgrad.updates.check against slow references: unpadded per-row log-probs, hand-made optimizer steps in
float64, numpy bit manipulation for bf16, and a per-sample loop for the score moments."""

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from covgrad.layout import select_parameters
from covgrad.updates.check import (
    ABS_THRESHOLD,
    bf16_half_spacing,
    changed_sets,
    mask_from_order,
    matched_sgd_lr,
    rl_minibatches,
    rule_masks,
    run_update_cell,
    sequence_logp,
    set_metrics,
    update_grid,
)
from tests.helpers.models import tiny_llama as build_llama
from tests.helpers.trajectory import rollouts

VOCAB = 16


def tiny_llama() -> LlamaForCausalLM:
    return build_llama(
        VOCAB, hidden=16, intermediate=32, heads=2, kv_heads=1, max_positions=32, attn_implementation="eager"
    ).train()


@pytest.fixture(scope="module")
def layout():
    return select_parameters(tiny_llama())


@pytest.fixture(scope="module")
def batches():
    return [rollouts(1), rollouts(2)]


def bf16_start_model(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = tiny_llama().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model.to(dtype)


def row_logp(model, batch, i: int) -> torch.Tensor:
    """log p(response) of row i from an unpadded forward and an explicit loop over response tokens."""
    start, end = int(batch["prompt_len"][i]), int(batch["prompt_len"][i] + batch["response_len"][i])
    ids = batch["input_ids"][i, :end]
    logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
    return sum(logp[t - 1, ids[t]] for t in range(start, end))


def flat_grad(model, layout) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.cat([params[e.name].grad.reshape(-1) for e in layout.entries])


def score_moments(layout, batch):
    """F = mean(s²), G = mean(A·s), ρ, rms(A) at the bf16 start; one backward per sample, float64 sums."""
    model = bf16_start_model()
    scores = []
    for i in range(batch["input_ids"].shape[0]):
        model.zero_grad()
        row_logp(model, batch, i).backward()
        scores.append(flat_grad(model, layout).double())
    s = torch.stack(scores)  # (N, P)
    A = batch["advantages"].double()
    F, G, m = (s**2).mean(0), (A[:, None] * s).mean(0), s.mean(0)
    rho = (G - A.mean() * m) / (A.std(unbiased=False) * (F - m**2).sqrt())
    return F, G, rho, float((A**2).mean().sqrt())


def test_sequence_logp_matches_unpadded_rows(batches):
    model = bf16_start_model()
    batch = batches[0]
    got = sequence_logp(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    want = torch.stack([row_logp(model, batch, i) for i in range(got.shape[0])])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    bf16_got = sequence_logp(
        model.to(torch.bfloat16), batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    )
    assert bf16_got.dtype == torch.float32


def test_sequence_logp_rejects_bad_masks(batches):
    model = bf16_start_model()
    batch = batches[0]
    at_zero = batch["response_mask"].clone()
    at_zero[0, 0] = True
    with pytest.raises(ValueError, match="position 0"):
        sequence_logp(model, batch["input_ids"], batch["attention_mask"], at_zero)
    on_pad = batch["response_mask"].clone()
    on_pad[:, -1] = True
    with pytest.raises(ValueError, match="padding"):
        sequence_logp(model, batch["input_ids"], batch["attention_mask"], on_pad)
    with pytest.raises(ValueError, match=r"\(N, L\)"):
        sequence_logp(model, batch["input_ids"], batch["attention_mask"][:, 1:], batch["response_mask"])


def test_fp32_sgd_one_step_is_minus_lr_times_gradient(layout, batches):
    lr = 0.01
    result = run_update_cell(tiny_llama, layout, batches, "sgd", "fp32", lr, steps=1, fresh_minibatches=True)
    model = bf16_start_model()
    batch = batches[0]
    A = batch["advantages"]
    loss = -sum(A[i] * row_logp(model, batch, i) for i in range(A.shape[0])) / A.shape[0]
    loss.backward()
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(result["start"], start, rtol=0, atol=0)
    torch.testing.assert_close(result["end"], start - lr * flat_grad(model, layout), rtol=0, atol=2e-8)
    assert 0 < result["changed_abs"].sum() < layout.P


def numpy_round_to_bf16_bits(x32: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 values to bf16 bit patterns (uint16), from the float32 bits."""
    bits = x32.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_float64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_bf16_sgd_changed_masks_match_a_hand_made_step(layout, batches):
    lr = 0.01
    result = run_update_cell(tiny_llama, layout, batches, "sgd", "bf16", lr, steps=1, fresh_minibatches=True)
    model = bf16_start_model(torch.bfloat16)
    batch = batches[0]
    logp = sequence_logp(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    (-(batch["advantages"] * logp).mean()).backward()
    w = result["start"].double().numpy()
    new64 = w - lr * flat_grad(model, layout).double().numpy()
    new_bits = numpy_round_to_bf16_bits(new64.astype(np.float32))
    # the optimizer rounds w - lr·g once from float32 arithmetic; drop values within a few float32 ulps
    # of a bf16 rounding midpoint, where that arithmetic and this float64 step may round differently
    low = bf16_bits_to_float64(new64.astype(np.float32).view(np.uint32) >> 16)
    gap = bf16_bits_to_float64((new64.astype(np.float32).view(np.uint32) >> 16) + 1) - low
    clear = np.abs(np.abs(new64 - low) - np.abs(gap) / 2) > 4 * np.abs(new64) * 2.0**-23
    assert clear.mean() > 0.99
    start_bits = numpy_round_to_bf16_bits(w.astype(np.float32))
    want_bf16 = new_bits != start_bits
    want_abs = np.abs(bf16_bits_to_float64(new_bits) - w) > ABS_THRESHOLD
    assert 0 < want_bf16.sum() < layout.P
    np.testing.assert_array_equal(result["changed_bf16"].numpy()[clear], want_bf16[clear])
    np.testing.assert_array_equal(result["changed_abs"].numpy()[clear], want_abs[clear])
    counts = [t["changed_bf16"] for t in result["per_tensor"]]
    assert sum(counts) == int(result["changed_bf16"].sum())
    assert [t["name"] for t in result["per_tensor"]] == layout.names


@pytest.mark.parametrize("precision", ["fp32", "fp32_master", "bf16"])
def test_sgd_bound_rule_contains_every_changed_parameter_after_one_step(layout, batches, precision):
    """Exact in fp32 (|lr·G| <= lr·rms(A)·sqrt(F) and a change needs a step of half the bf16 gap);
    in fp32_master and bf16 the gradient carries bf16 rounding, which the Cauchy–Schwarz slack covers here."""
    F, G, _, adv_rms = score_moments(layout, batches[0])
    lr = 0.01
    result = run_update_cell(tiny_llama, layout, batches, "sgd", precision, lr, steps=1, fresh_minibatches=True)
    rules = rule_masks(result["start"], F, G, adv_rms, "sgd", lr, steps=1)
    bound = set_metrics(rules["bound"], result["changed_bf16"])
    assert bound["recall"] == 1.0
    assert bound["precision"] < 0.9  # a strict superset: the bound is loose for most parameters
    if precision == "fp32":
        assert set_metrics(rules["absorb"], result["changed_bf16"])["recall"] == 1.0


def test_adam_first_step_rule_predicts_the_changed_set(layout, batches):
    F, G, _, adv_rms = score_moments(layout, batches[0])
    lr = 1e-5
    result = run_update_cell(tiny_llama, layout, batches, "adam", "fp32", lr, steps=1, fresh_minibatches=False)
    metrics = set_metrics(rule_masks(result["start"], F, G, adv_rms, "adam", lr, 1)["absorb"], result["changed_bf16"])
    assert metrics["recall"] == 1.0
    assert metrics["precision"] > 0.99
    assert 0.01 < result["changed_bf16"].float().mean() < 0.9


def test_minibatch_choice(layout, batches):
    def end(batch_list, fresh):
        return run_update_cell(tiny_llama, layout, batch_list, "sgd", "fp32", 0.01, 2, fresh)["end"]

    torch.testing.assert_close(end(batches, False), end(batches[:1], True), rtol=0, atol=0)
    assert not torch.equal(end(batches, True), end(batches[:1], True))


def test_rl_minibatches_skip_those_with_no_rl_gradient(layout, batches):
    """A minibatch with A ≡ 0 moves no parameter under SGD (its rl gradient is exactly 0); rl_minibatches
    drops it and keeps the others in order, and keeps every minibatch when none has a gradient."""
    silent = {**batches[0], "advantages": torch.zeros_like(batches[0]["advantages"])}
    moved = run_update_cell(tiny_llama, layout, [silent], "sgd", "fp32", 0.01, 1, False)
    assert not moved["changed_abs"].any() and torch.equal(moved["start"], moved["end"])
    kept, dropped = rl_minibatches([silent, batches[0], silent, batches[1]])
    assert dropped == [0, 2] and len(kept) == 2 and kept[0] is batches[0] and kept[1] is batches[1]
    kept, dropped = rl_minibatches([silent, silent])
    assert dropped == [] and len(kept) == 2


def all_finite_bf16_bits() -> np.ndarray:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    return bits[((bits >> 7) & 0xFF) != 0xFF]


def test_bf16_half_spacing_against_neighbours_from_bits():
    bits = all_finite_bf16_bits()  # every finite bf16 value: ±0, subnormals, normals, ±max
    magnitude = bits & 0x7FFF
    value = np.abs(bf16_bits_to_float64(bits))
    up_bits = magnitude.astype(np.uint32) + 1
    up = np.where(up_bits < 0x7F80, bf16_bits_to_float64(up_bits), np.inf) - value
    down = np.where(magnitude > 0, value - bf16_bits_to_float64(np.maximum(magnitude, 1) - 1), up)
    want = np.minimum(up, down) / 2
    w = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    got = bf16_half_spacing(w)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.double().numpy(), want)
    assert got[w == 0].unique().tolist() == [2.0**-134]
    x32 = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 10.0 ** torch.randint(-40, 30, (1000,))
    torch.testing.assert_close(bf16_half_spacing(x32), bf16_half_spacing(x32.to(torch.bfloat16)), rtol=0, atol=0)


def test_bf16_half_spacing_rejects_bad_input():
    with pytest.raises(ValueError, match="inf or NaN"):
        bf16_half_spacing(torch.tensor([1.0, math.inf]))
    with pytest.raises(ValueError, match="floating"):
        bf16_half_spacing(torch.tensor([1, 2]))


def test_set_metrics_hand_examples():
    m = set_metrics(torch.tensor([1, 1, 0, 0, 1]).bool(), torch.tensor([1, 0, 1, 0, 1]).bool())
    assert m == {"precision": 2 / 3, "recall": 2 / 3, "jaccard": 2 / 4, "size": 3}
    m = set_metrics(torch.tensor([1, 1, 0, 0]).bool(), torch.tensor([1, 0, 0, 0]).bool())
    assert m == {"precision": 0.5, "recall": 1.0, "jaccard": 0.5, "size": 2}
    empty = set_metrics(torch.zeros(3, dtype=torch.bool), torch.tensor([0, 1, 0]).bool())
    assert math.isnan(empty["precision"]) and empty["recall"] == 0.0 and empty["size"] == 0
    with pytest.raises(ValueError, match="shapes differ"):
        set_metrics(torch.zeros(3, dtype=torch.bool), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        set_metrics(torch.zeros(3), torch.zeros(3, dtype=torch.bool))


def test_mask_from_order_takes_the_first_k():
    order = torch.tensor([4, 0, 2, 1, 3])
    assert mask_from_order(order, 0).tolist() == [False] * 5
    assert mask_from_order(order, 3).tolist() == [True, False, True, False, True]


def test_matched_sgd_lr_gives_the_adam_count():
    g = torch.Generator().manual_seed(5)
    start = (torch.randn(4000, generator=g) * 0.02).to(torch.bfloat16).float()
    G = torch.randn(4000, generator=g).double() * 1e-3
    adam_lr = 1e-5
    half = bf16_half_spacing(start).double().numpy()
    k = int((adam_lr * np.abs(G.numpy()) / (np.abs(G.numpy()) + 1e-8) >= half).sum())
    ratios = np.sort(half / np.abs(G.numpy()))
    lr = matched_sgd_lr(start, G, adam_lr)
    assert lr == ratios[k - 1]
    predicted = rule_masks(start, torch.zeros(4000), G, 1.0, "sgd", lr * (1 + 1e-12), 1)["absorb"]
    assert int(predicted.sum()) == k
    with pytest.raises(ValueError, match="zero everywhere"):
        matched_sgd_lr(start, torch.zeros(4000), adam_lr)


def test_update_grid_snapshots_match_separate_runs(layout, batches):
    F, G, rho, adv_rms = score_moments(layout, batches[0])
    cells = {
        "optimizers": ("sgd", "adamw"),
        "precisions": ("fp32_master",),
        "adam_lrs": (1e-5,),
        "sgd_lrs": (0.01,),
        "steps": (1, 3),
    }
    rows = update_grid(tiny_llama, layout, batches, F, G, rho, adv_rms, **cells)
    assert [(r["optimizer"], r["steps"]) for r in rows] == [
        ("sgd", 1),
        ("sgd", 3),
        ("adamw", 1),
        ("adamw", 3),
    ]
    for row in rows:
        single = run_update_cell(
            tiny_llama, layout, batches, row["optimizer"], "fp32_master", row["lr"], row["steps"], True
        )
        assert row["n_changed_bf16"] == int(single["changed_bf16"].sum())
        assert row["frac_changed_abs"] == int(single["changed_abs"].sum()) / layout.P
        k = row["n_changed_bf16"]
        order = torch.from_numpy(np.argsort(-G.abs().numpy(), kind="stable"))  # ties to the lowest index
        want = set_metrics(mask_from_order(order, k), single["changed_bf16"])
        assert {s: row[f"bf16_absG_{s}"] for s in want} == want
        assert row["bf16_F_size"] == row["bf16_random_size"] == row["bf16_smallw_size"] == k
        assert ("bf16_bound_recall" in row) == (row["optimizer"] == "sgd")
    assert rows[0]["bf16_bound_recall"] == 1.0
    loaded = []

    def loader(t: torch.Tensor, name: str):
        def load() -> torch.Tensor:
            loaded.append(name)
            return t.clone()

        return load

    lazy_stats = (loader(F, "F"), loader(G, "G"), loader(rho, "rho"))
    lazy = update_grid(tiny_llama, layout, batches, *lazy_stats, adv_rms, **cells)
    assert lazy == rows  # same rows, same column order
    assert [list(r) for r in lazy] == [list(r) for r in rows]
    assert loaded == ["F", "G", "rho", "G", "F"]  # each ranked predictor once, then G and F for the rules


def test_update_grid_in_chunks_of_the_flat_axis_equals_whole_tensors(layout, batches, monkeypatch):
    """Changed masks and rule counts taken in chunks of 48 elements (cutting every tensor, not dividing P)
    give the rows of whole tensors, and the rules' metrics are set_metrics of rule_masks on the changed set."""
    F, G, rho, adv_rms = score_moments(layout, batches[0])
    cells = {"optimizers": ("sgd", "adam"), "precisions": ("bf16",), "adam_lrs": (1e-4,), "sgd_lrs": (0.05,)}
    rows = update_grid(tiny_llama, layout, batches, F, G, rho, adv_rms, steps=(2,), **cells)
    for row in rows:
        single = run_update_cell(tiny_llama, layout, batches, row["optimizer"], "bf16", row["lr"], 2, True)
        rules = rule_masks(single["start"], F, G, adv_rms, row["optimizer"], row["lr"], 2)
        assert 0 < rules["absorb"].sum() < layout.P and 0 < single["changed_bf16"].sum() < layout.P
        for rule, pred in rules.items():
            for metric in ("bf16", "abs"):
                want = set_metrics(pred, single[f"changed_{metric}"])
                assert {s: row[f"{metric}_{rule}_{s}"] for s in want} == pytest.approx(want, nan_ok=True)
    assert layout.P % 48 and min(e.numel for e in layout.entries) < 48 < max(e.numel for e in layout.entries)
    monkeypatch.setattr("covgrad.updates.check.CHUNK", 48)
    assert update_grid(tiny_llama, layout, batches, F, G, rho, adv_rms, steps=(2,), **cells) == rows


def test_changed_sets_counts_per_tensor(layout):
    g = torch.Generator().manual_seed(6)
    start = torch.randn(layout.P, generator=g).to(torch.bfloat16).float()
    end = start.clone()
    moved = torch.randperm(layout.P, generator=g)[:300]
    end[moved] += start[moved].abs() * 2.0**-6  # a few bf16 ulps: a change in both metrics unless |w| is tiny
    out = changed_sets(layout, start, end)
    assert int(out["changed_bf16"].sum()) == 300
    want_abs = (end.double() - start.double()).abs() > ABS_THRESHOLD
    assert torch.equal(out["changed_abs"], want_abs)
    ids = layout.tensor_ids()
    for j, t in enumerate(out["per_tensor"]):
        assert t["changed_bf16"] == int(out["changed_bf16"][ids == j].sum())


def test_run_update_cell_rejects_bad_arguments(layout, batches):
    args = {"lr": 0.01, "steps": 1, "fresh_minibatches": True}
    with pytest.raises(ValueError, match="'rmsprop'"):
        run_update_cell(tiny_llama, layout, batches, "rmsprop", "fp32", **args)
    with pytest.raises(ValueError, match="'fp16'"):
        run_update_cell(tiny_llama, layout, batches, "sgd", "fp16", **args)
    with pytest.raises(ValueError, match="learning rate"):
        run_update_cell(tiny_llama, layout, batches, "sgd", "fp32", 0.0, 1, True)
    no_adv = [{k: v for k, v in batches[0].items() if k != "advantages"}]
    with pytest.raises(ValueError, match="advantages"):
        run_update_cell(tiny_llama, layout, no_adv, "sgd", "fp32", **args)
    other = select_parameters(
        LlamaForCausalLM(
            LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
        )
    )
    with pytest.raises(ValueError, match="is not a parameter"):
        run_update_cell(tiny_llama, other, batches, "sgd", "fp32", **args)
