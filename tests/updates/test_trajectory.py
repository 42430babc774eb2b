"""covgrad.updates.trajectory against references: hand-written optimizer steps on hand-built on-policy rows,
an uninterrupted run against runs resumed from stored state, covgrad.updates.diff on the step weights,
and a numpy brute force of every predictor metric."""

import copy
import dataclasses
import io
import math

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.moments.topk import top_k_masks
from covgrad.updates.check import run_update_cell
from covgrad.updates.diff import diff_state_dicts
from covgrad.updates.stepping import (
    ADAM_EPS,
    OPTIMIZERS,
    PRECISIONS,
    FixedBatches,
    OptimizerSpec,
    Stepper,
    bf16_rounded,
    stored_dtype,
)
from covgrad.updates.tracking import (
    DECILE_PREDICTORS,
    N_DECILES,
    SCOPES,
    SET_STATS,
    THRESHOLDS,
    ChangeTracker,
    StepZeroStats,
    group_ranks,
    random_values,
    stable_ranks,
)
from covgrad.updates.trajectory import load_trajectory_state, persistence, run_trajectory, trajectory_state
from tests.helpers.trajectory import (
    LRS,
    SEED,
    hand_rows,
    on_policy,
    rollouts,
    tiny_llama,
)


def spec(name: str) -> OptimizerSpec:
    return OptimizerSpec(name, LRS[name], warmup=2, weight_decay=0.1 if name == "adamw" else None)


@pytest.fixture(scope="module")
def layout():
    return select_parameters(tiny_llama())


def hand_step(name: str, precision: str) -> dict[str, torch.Tensor]:
    """One step written out: the REINFORCE loss, then torch's single-tensor SGD / Adam / AdamW update
    (warmup 2: step 1 at lr/2) in the precision regime's arithmetic."""
    master = bf16_rounded(tiny_llama())
    if precision == "bf16":
        master = master.to(torch.bfloat16)
    work = copy.deepcopy(master).to(torch.bfloat16) if precision == "fp32_master" else master
    ids, attn, resp, A = hand_rows(work)
    logp = torch.log_softmax(work(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    seq = torch.where(resp[:, 1:], tok, torch.zeros_like(tok)).sum(-1)
    (-(A.float() * seq).mean()).backward()
    if work is not master:
        for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
            pm.grad = pw.grad.float()
    return hand_update(master, work, name, LRS[name] * 0.5)


def hand_update(master, work, name: str, lr: float) -> dict[str, torch.Tensor]:
    """Torch's single-tensor SGD / Adam / AdamW (weight decay 0.1) first step of ``master`` from its gradients,
    the analysed copy ``work`` re-rounded from it; the analysed weights by name."""
    b1, b2 = 0.9, 0.999
    with torch.no_grad():
        for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
            g = pm.grad
            if name == "sgd":
                pm.add_(g, alpha=-lr)
            else:
                if name == "adamw":
                    pm.mul_(1 - lr * 0.1)
                m = torch.zeros_like(pm).lerp_(g, 1 - b1)
                v = torch.zeros_like(pm).mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / (1 - b2) ** 0.5).add_(ADAM_EPS)
                pm.addcdiv_(m, denom, value=-(lr / (1 - b1)))
            if pw is not pm:
                pw.copy_(pm)
    return {n: p.detach().clone() for n, p in work.named_parameters()}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_step_equals_a_hand_written_step(layout, name, precision):
    stepper = Stepper(bf16_rounded(tiny_llama()), spec(name), precision)
    (rec,) = run_trajectory(stepper, on_policy(), layout, 1)
    want = hand_step(name, precision)
    got = dict(stepper.model.named_parameters())
    for n, w in want.items():
        assert got[n].dtype == w.dtype == stored_dtype(precision)
        assert torch.equal(
            got[n].detach().view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32),
            w.view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32),
        ), n
    assert rec["step"] == 1 and rec["lr"] == LRS[name] / 2
    assert math.isfinite(rec["loss"]) and 0 <= rec["reward"] <= 1


def hand_trainer_step(name: str, precision: str, max_norm: float, parts: int, lr: float) -> dict[str, torch.Tensor]:
    """One trainer step written out: the REINFORCE loss of each of ``parts`` equal row slices divided by
    ``parts`` and backpropagated in turn (under fp32_master each slice's bf16 gradient cast to float32 and
    added to the master's), the global norm clipped to ``max_norm`` by torch's clip_grad_norm_ on the master's
    gradients, then torch's single-tensor SGD / AdamW update at ``lr`` (weight decay 0.1)."""
    master = bf16_rounded(tiny_llama())
    if precision == "bf16":
        master = master.to(torch.bfloat16)
    work = copy.deepcopy(master).to(torch.bfloat16) if precision == "fp32_master" else master
    ids, attn, resp, A = hand_rows(work)
    n = ids.shape[0] // parts
    for i in range(parts):
        rows = slice(i * n, (i + 1) * n)
        logits = work(input_ids=ids[rows], attention_mask=attn[rows]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        tok = logp.gather(-1, ids[rows, 1:, None]).squeeze(-1)
        seq = torch.where(resp[rows, 1:], tok, torch.zeros_like(tok)).sum(-1)
        (-(A[rows].float() * seq).mean() / parts).backward()
        if work is not master:
            for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
                pm.grad = pw.grad.float() if pm.grad is None else pm.grad + pw.grad.float()
                pw.grad = None
    torch.nn.utils.clip_grad_norm_(list(master.parameters()), max_norm)
    return hand_update(master, work, name, lr)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_clipped_accumulated_cosine_step_equals_a_hand_written_step(layout, name, precision):
    """Gradient accumulation over 2 minibatches, global-norm clipping that binds, and the first step of a
    cosine schedule (no warmup, 4 steps): byte-identical to the step written out in plain torch."""
    opt = OptimizerSpec(
        name,
        LRS[name],
        weight_decay=0.1 if name == "adamw" else None,
        schedule="cosine",
        total_steps=4,
        max_grad_norm=1e-3,
    )
    stepper = Stepper(bf16_rounded(tiny_llama()), opt, precision, minibatches=2)
    (rec,) = run_trajectory(stepper, on_policy(), layout, 1)
    lr = LRS[name] * 0.5 * (1 + math.cos(math.pi / 4))
    assert rec["lr"] == lr and rec["grad_norm"] > 1e-3  # the clip binds
    want = hand_trainer_step(name, precision, 1e-3, 2, lr)
    got = dict(stepper.model.named_parameters())
    bits = torch.int16 if stored_dtype(precision) == torch.bfloat16 else torch.int32
    for n, w in want.items():
        assert torch.equal(got[n].detach().view(bits), w.view(bits)), n


def test_schedules_follow_their_definitions():
    """Warmup then constant, warmup then cosine to 0 at the last step, transformers' cosine schedule one step
    later; the bad settings refused in one line."""
    from transformers import get_cosine_schedule_with_warmup

    const = OptimizerSpec("adam", 1.0, warmup=4)
    assert [const.lr_at(t) for t in (1, 2, 4, 5, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    cos = OptimizerSpec("adam", 2.0, warmup=2, schedule="cosine", total_steps=10)
    assert cos.lr_at(1) == 1.0 and cos.lr_at(2) == 2.0 and cos.lr_at(10) == 0.0
    assert cos.lr_at(6) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 4 / 8)), abs=0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    hf = get_cosine_schedule_with_warmup(opt, 2, 10)
    hf_lrs = []
    for _ in range(10):
        hf_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        hf.step()
    assert hf_lrs[1:] == pytest.approx([cos.lr_at(t) for t in range(1, 10)], rel=1e-12)
    for bad in (
        {"schedule": "linear"},
        {"schedule": "cosine", "total_steps": 2, "warmup": 2},
        {"max_grad_norm": 0.0},
        {"max_grad_norm": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            OptimizerSpec("adam", 1.0, **bad)
    with pytest.raises(ValueError, match="minibatches"):
        Stepper(tiny_llama(), const, "fp32", minibatches=0)


def fresh_run(precision: str, name: str, stats: StepZeroStats | None, layout):
    """Stepper, tracker and start-model reference of one run, built from scratch."""
    stepper = Stepper(bf16_rounded(tiny_llama()), spec(name), precision)
    tracker = ChangeTracker(layout, stepper.flat(layout), spec(name), stats)
    reference = bf16_rounded(tiny_llama()).to(stored_dtype(precision))
    return stepper, tracker, reference


def stats_for(layout) -> StepZeroStats:
    g = np.random.default_rng(3)
    return StepZeroStats(g.random(layout.P), g.standard_normal(layout.P), g.uniform(-1, 1, layout.P), seed=11)


def same(a, b) -> bool:
    """Equality of two records / states, NaN equal to NaN, tensors and arrays by bytes."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        as_bytes = (a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*as_bytes)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


@pytest.mark.parametrize(("precision", "name"), [("bf16", "adam"), ("fp32_master", "sgd")])
def test_resumed_runs_are_byte_identical(layout, precision, name):
    K = 5
    stats = stats_for(layout)
    stepper, tracker, ref = fresh_run(precision, name, stats, layout)
    whole = list(run_trajectory(stepper, on_policy(), layout, K, tracker, ref))
    whole_state = trajectory_state(stepper, tracker, SEED)
    assert whole[0]["kl"] == 0.0 and whole[-1]["kl"] > 0

    cuts = sorted(np.random.default_rng(5).choice(np.arange(1, K), 2, replace=False).tolist())
    stepper, tracker, ref = fresh_run(precision, name, stats, layout)
    pieces: list[dict] = []
    for stop in [*cuts, K]:
        pieces += run_trajectory(stepper, on_policy(), layout, stop, tracker, ref)
        buf = io.BytesIO()
        torch.save(trajectory_state(stepper, tracker, SEED), buf)  # what a caller stores
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        stepper, tracker, ref = fresh_run(precision, name, stats, layout)  # a new process
        load_trajectory_state(state, stepper, tracker, SEED)
    assert same(pieces, whole)
    assert same(trajectory_state(stepper, tracker, SEED), whole_state)


def test_packed_sets_equal_ckpt_diff(layout):
    stepper, tracker, _ = fresh_run("bf16", "adam", None, layout)
    weights = [{n: p.detach().clone() for n, p in stepper.model.named_parameters()}]
    recs = []
    for rec in run_trajectory(stepper, on_policy(), layout, 3, tracker):
        recs.append(rec)
        weights.append({n: p.detach().clone() for n, p in stepper.model.named_parameters()})
    for k, rec in enumerate(recs, start=1):
        changed = np.unpackbits(rec["changed"], count=layout.P).astype(bool)
        assert 0 < changed.sum() < layout.P
        step = diff_state_dicts(weights[k - 1], weights[k], masks={"packed": changed}, layout=layout)
        assert step["overlap"]["packed"]["exact"]["precision"] == 1.0
        assert step["overlap"]["packed"]["exact"]["recall"] == 1.0
        assert rec["per_tensor_step"].tolist() == [t["changed_exact"] for t in step["tensors"]]
        for scope, before in (("step", weights[k - 1]), ("cum", weights[0])):
            for i, atol in enumerate(THRESHOLDS):
                d = diff_state_dicts(before, weights[k], atol=atol)
                assert rec[f"n_above_{scope}"][i] == d["changed_abs"]
        cum = diff_state_dicts(weights[0], weights[k])
        assert rec["per_tensor_cum"].tolist() == [t["changed_exact"] for t in cum["tensors"]]
        assert rec["n_changed_cum"] == cum["changed_exact"]


class Capturing(ChangeTracker):
    """A tracker that keeps what it was given, for the brute force."""

    def record(self, now, grad, lr, adv_rms):
        self.seen = [*getattr(self, "seen", []), (now.clone(), grad.clone(), lr, adv_rms)]
        return super().record(now, grad, lr, adv_rms)


def np_half(w: torch.Tensor) -> np.ndarray:
    """Half the gap to the nearer neighbour in w's dtype, from bit patterns / np.nextafter, float64."""
    if w.dtype == torch.float32:
        x = w.numpy()
        up = np.nextafter(x, np.float32(np.inf)).astype(np.float64) - x
        down = x - np.nextafter(x, np.float32(-np.inf)).astype(np.float64)
        return np.minimum(up, down) / 2
    mag = (w.view(torch.int16).numpy().view(np.uint16) & 0x7FFF).astype(np.uint32)

    def val(m):
        return (m.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    up = val(mag + 1) - val(mag)
    down = np.where(mag > 0, val(mag) - val(np.maximum(mag, 1) - 1), up)
    return np.minimum(up, down) / 2


def np_metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    both, n_pred, n_true = int((pred & true).sum()), int(pred.sum()), int(true.sum())
    union = n_pred + n_true - both
    nan = float("nan")
    return {
        "precision": both / n_pred if n_pred else nan,
        "recall": both / n_true if n_true else nan,
        "jaccard": both / union if union else nan,
        "size": n_pred,
    }


def np_top(values: np.ndarray, k: int, largest: bool) -> np.ndarray:
    order = np.argsort(-values if largest else values, kind="stable")
    mask = np.zeros(values.shape, dtype=bool)
    mask[order[:k]] = True
    return mask


@pytest.mark.parametrize(
    ("precision", "name", "samples", "chunk"),
    [("bf16", "sgd", 0, 1 << 22), ("fp32", "adam", 0, 64), ("fp32_master", "adamw", 8, 120)],
)
def test_predictor_metrics_equal_a_numpy_brute_force(layout, precision, name, samples, chunk):
    """Every count of the tracker (column files read in chunks of ``chunk``, top-k sets from rank buckets and
    the order on disk) equals a whole-array numpy recount."""
    stats = dataclasses.replace(stats_for(layout), samples_per_step=samples)
    stepper = Stepper(bf16_rounded(tiny_llama()), spec(name), precision)
    start = stepper.flat(layout)
    tracker = Capturing(layout, start, spec(name), stats, chunk=chunk)
    batches = FixedBatches([rollouts(1), rollouts(2)])
    recs = list(run_trajectory(stepper, batches, layout, 3, tracker))
    w0 = start.float().numpy().astype(np.float64)
    rand = np.random.default_rng([stats.seed, 0]).random(layout.P, dtype=np.float32)
    values = {
        "F": (stats.F, True),
        "absG": (np.abs(stats.G), True),
        "absrho": (np.abs(stats.rho), True),
        "smallw": (np.abs(w0), False),
        "random": (rand, True),
    }
    if samples:  # the Adam drift predictor: sign consistency over the half-gap at w_0
        r2 = np.minimum(stats.rho**2, 1.0)
        c = np.sqrt(r2 / (r2 * (1.0 - 1.0 / samples) + 1.0 / samples))
        h0 = np_half(start)
        values["drift"] = (c / h0, True)
        c32, h32 = c.astype(np.float32).astype(np.float64), h0.astype(np.float32).astype(np.float64)
        lr_sum = lr_sq = 0.0
        crossings = np.zeros(layout.P, dtype=np.int64)
    decile = np.empty(layout.P, dtype=int)
    decile[np.argsort(np.abs(w0), kind="stable")] = np.arange(layout.P) * N_DECILES // layout.P
    prev, union, counts, last = start, {}, np.zeros(layout.P, dtype=int), None
    for t, (rec, (now, grad, lr, adv_rms)) in enumerate(zip(recs, tracker.seen, strict=True), start=1):
        step_set = (now != prev).numpy()
        sets = {"step": step_set, "cum": (now != start).numpy()}
        h = np_half(prev)
        g = grad.double().numpy()
        rules = {"absorb": (lr * np.abs(g) if name == "sgd" else lr * np.abs(g) / (np.abs(g) + ADAM_EPS)) >= h}
        if name == "sgd":
            rules["bound"] = lr * adv_rms * np.sqrt(stats.F) >= h
        if samples:
            lr_sum, lr_sq = lr_sum + lr, lr_sq + lr * lr
            reach = np.sqrt((lr_sum * c32) ** 2 + lr_sq * (1.0 - c32 * c32))
            now_crossings = np.floor(np.minimum((reach / h32 + 1.0) / 2.0, 2.0**30)).astype(np.int64)
            rules["drift_rule"] = now_crossings > crossings
            crossings = now_crossings
        for r, m in rules.items():
            union[r] = union.get(r, np.zeros(layout.P, dtype=bool)) | m
        for scope in SCOPES:
            true = sets[scope]
            k = int(true.sum())
            want = {n: np_top(v, k, big) for n, (v, big) in values.items()}
            tr = np.zeros(layout.P, dtype=bool)
            for e in layout.entries:
                c = slice(e.offset, e.offset + e.numel)
                tr[c] = np_top(rand[c], int(true[c].sum()), True)
            want["tensor_random"] = tr
            want.update(rules if scope == "step" else union)
            for n, pred in want.items():
                for s, v in np_metrics(pred, true).items():
                    assert same(rec[f"{scope}_{n}_{s}"], v), (t, scope, n, s)
            for n in (n for n in DECILE_PREDICTORS if n in values):
                v, big = values[n]
                for d in range(N_DECILES):
                    idx = np.flatnonzero(decile == d)
                    m = np_metrics(np_top(v[idx], int(true[idx].sum()), big), true[idx])
                    for s in SET_STATS:
                        assert same(float(rec[f"decile_{scope}_{n}_{s}"][d]), float(m[s])), (t, scope, n, d, s)
        counts += step_set
        assert rec["persist_hist"].tolist() == np.bincount(counts, minlength=t + 1).tolist()
        want_j = np_metrics(step_set, last)["jaccard"] if last is not None else float("nan")
        assert same(rec["jaccard_prev"], want_j)
        assert rec["sign_flips_cum"] == int((np.sign(now.float().numpy()) != np.sign(w0)).sum())
        prev, last = now, step_set
    assert recs[0]["step_absorb_recall"] > 0.5
    summary = persistence(recs, layout.P, ks=(1, 2, 3))
    for k in (1, 2, 3):
        assert summary[f"frac_ge_{k}"] == (counts >= k).mean()
    assert summary["frac_cum"] == sets["cum"].mean()


@pytest.mark.parametrize("largest", [True, False])
def test_stable_ranks_give_the_top_k_masks(largest):
    """ranks < k equals covgrad.moments.topk.top_k_masks for every k, on values with ties, ±0, ±inf and NaN."""
    rng = np.random.default_rng(3)
    v = rng.integers(-4, 5, 400).astype(np.float64) / 2
    v[rng.choice(400, 30, replace=False)] = np.nan
    v[rng.choice(400, 10, replace=False)] = -0.0
    v[:3], v[-3:] = np.inf, -np.inf
    ranks = stable_ranks(v, largest)
    assert sorted(ranks.tolist()) == list(range(400))
    ks = list(range(0, 401, 7)) + [400]
    for k, mask in zip(ks, top_k_masks(v, ks, largest), strict=True):
        assert np.array_equal(ranks < k, mask), k
    f32 = rng.random(300, dtype=np.float32)
    assert np.array_equal(stable_ranks(f32) < 50, next(top_k_masks(f32, [50])))


def test_update_check_is_the_fixed_data_case(layout):
    batches = [rollouts(1), rollouts(2)]
    cell = run_update_cell(tiny_llama, layout, batches, "adamw", "fp32_master", 1e-3, steps=3, fresh_minibatches=True)
    stepper = Stepper(bf16_rounded(tiny_llama()), OptimizerSpec("adamw", 1e-3), "fp32_master")
    list(run_trajectory(stepper, FixedBatches(batches), layout, 3))
    assert torch.equal(stepper.flat(layout).float(), cell["end"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerSpec("lion", 1e-3)
    with pytest.raises(ValueError, match="learning rate"):
        OptimizerSpec("sgd", 0.0)
    with pytest.raises(ValueError, match="warmup"):
        OptimizerSpec("adam", 1e-3, warmup=-1)
    with pytest.raises(ValueError, match="precision"):
        Stepper(tiny_llama(), OptimizerSpec("sgd", 0.1), "fp16")
    with pytest.raises(ValueError, match="lacks"):
        FixedBatches([{"input_ids": torch.zeros(1, 2)}])
    assert OptimizerSpec("adam", 1.0, warmup=4).lr_at(1) == 0.25
    assert OptimizerSpec("adam", 1.0, warmup=4).lr_at(9) == 1.0


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_random_values_drawn_in_chunks_are_the_whole_draw(monkeypatch, chunk: int):
    """A shard's random predictor values, drawn RANDOM_CHUNK at a time, are numpy's one draw of all P at its
    columns (odd chunk sizes split numpy's 64-bit outputs between calls)."""
    monkeypatch.setattr("covgrad.updates.tracking.RANDOM_CHUNK", chunk)
    P = 53
    whole = np.random.default_rng([5, 0]).random(P, dtype=np.float32)
    index = np.sort(np.random.default_rng(1).choice(P, 20, replace=False))
    assert np.array_equal(random_values(5, P, index), whole[index])
    assert np.array_equal(random_values(5, P), whole)


def test_group_ranks_count_the_values_before_each_in_its_group():
    """group_ranks against the definition: in its group, the values ordered before it (larger, or smaller with
    largest=False; ties by the lower index; NaN last; -0 tied with +0)."""
    rng = np.random.default_rng(2)
    values = rng.integers(0, 4, 60).astype(np.float64)
    values[[3, 9]] = np.nan
    values[[4, 5]] = [-0.0, 0.0]
    groups = rng.integers(0, 3, 60)
    for largest in (True, False):
        key = np.where(np.isnan(values), np.inf, -values if largest else values)
        want = [
            sum(groups[j] == groups[i] and (key[j] < key[i] or (key[j] == key[i] and j < i)) for j in range(60))
            for i in range(60)
        ]
        np.testing.assert_array_equal(group_ranks(values, largest, groups), want)
        np.testing.assert_array_equal(group_ranks(values, largest), stable_ranks(values, largest))
