"""Family matrix of the architectures people post-train in 2026: hybrid linear attention, state-space layers,
today's MoE designs. Tiny random models (2 layers, hidden 32) built from transformers' own configs, every
1-D parameter, bias, router and gate moved away from its init, a left-padded batch with prompt masks; every
tensor of every per-sample score within 1e-5 of a naive one-backward-per-sequence loop, and the fused
accumulator state within 1e-9 of numpy moments of the rows. Families that cannot be supported assert their
one-line refusal."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from covgrad.layout import ParamLayout, select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores import binding
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.dense_experts import _dense_experts_rule
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import generic_rule
from tests.families.matrix import EXTRA, PADDING_SENSITIVE, REPLAY_REFUSED
from tests.helpers.families_hybrid import FAMILIES, perturb
from tests.helpers.models import tiny_llama
from tests.helpers.persample import BATCH, PAD, V, hook_scores, make_batch, max_rel_err, naive_scores

FAMILIES = {**FAMILIES, **EXTRA}  # the hybrid, state-space and MoE families of the matrix


def naive_padded_scores(model: nn.Module, layout: ParamLayout, batch: dict, tau: float = 1.0) -> torch.Tensor:
    """(B, P): per padded row alone (its padding, mask and position ids), autograd of its own objective."""
    params = dict(model.named_parameters())
    ps = [params[e.name] for e in layout.entries]
    rows = []
    for n in range(batch["input_ids"].shape[0]):
        ids, attn = batch["input_ids"][n : n + 1], batch["attention_mask"][n : n + 1]
        z = model(input_ids=ids, attention_mask=attn, position_ids=batch["position_ids"][n : n + 1]).logits
        dz = score_logit_grad(z.detach(), ids, batch["target_mask"][n : n + 1], temperature=tau)
        grads = torch.autograd.grad(z, ps, dz.to(z.dtype), allow_unused=True)
        flat = [torch.zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(ps, grads, strict=True)]
        rows.append(torch.cat(flat))
    return torch.stack(rows)


def _worst(layout: ParamLayout, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    """Largest per-tensor ‖got − ref‖ / ‖ref‖; a tensor whose exact gradient is 0 (rounding noise only)
    is compared against 1e-6 of the whole gradient's norm."""
    floor = 1e-6 * float(ref.double().norm())
    worst = (0.0, "")
    for e in layout.entries:
        a = got[:, e.offset : e.offset + e.numel].double()
        b = ref[:, e.offset : e.offset + e.numel].double()
        worst = max(worst, (float((a - b).norm()) / max(float(b.norm()), floor), e.name))
    return worst


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_naive_loop(name):
    model = FAMILIES[name]()
    layout = select_parameters(model)
    batch = make_batch(30, **BATCH)
    got = hook_scores(model, layout, batch, tau=0.8)  # with the self-check
    if name in PADDING_SENSITIVE:
        ref = naive_padded_scores(model, layout, batch, tau=0.8)
    else:
        ref = naive_scores(model, layout, batch, tau=0.8)
    err, where = _worst(layout, got, ref)
    assert err < 1e-5, (name, err, where)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_state_matches_rows(name):
    model = FAMILIES[name]()
    layout = select_parameters(model)
    batch = make_batch(31, **BATCH)
    psg = PerSampleGrads(model, layout, check=False)
    args = (
        batch["input_ids"],
        batch["attention_mask"],
        lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"]),
    )
    rows = psg(*args, position_ids=batch["position_ids"]).double().numpy()
    a, half = np.array([0.7, -1.3, 0.2, 0.4]), np.array([0, 1, 0, 1])
    acc = MomentAccumulator(layout.P, "cpu", "float64")
    psg.accumulate(*args, acc, a, half, position_ids=batch["position_ids"])
    state = acc.rows()
    for h in (0, 1):
        s, ah = rows[half == h], a[half == h]
        d = s - s.mean(0)
        for key, want in {"mean_s": s.mean(0), "m2_s": (d * d).sum(0), "c_as": (ah - ah.mean()) @ d}.items():
            scale = max(float(np.abs(want).max()), 1e-30)
            assert float(np.abs(state[key][h] - want).max()) <= 1e-9 * scale, (name, key, h)


@pytest.mark.parametrize("name", list(REPLAY_REFUSED))
def test_family_the_replay_alone_cannot_take_is_refused_in_one_line(name):
    """On the module replay alone (``op_taps=False``) the family is refused in one line naming its parameters, with
    a ``model.params`` selection that runs on that path and is exact."""
    model = FAMILIES[name]()
    batch = make_batch(30, **BATCH)
    with pytest.raises(ValueError, match=REPLAY_REFUSED[name]) as info:
        hook_scores(model, select_parameters(model), batch, op_taps=False)
    msg = str(info.value)
    assert "\n" not in msg and "model.params = " in msg
    layout = select_parameters(model, ast.literal_eval(msg.split("model.params = ")[1]))
    naive = naive_padded_scores if name in PADDING_SENSITIVE else naive_scores
    got = hook_scores(model, layout, batch, op_taps=False)
    err, where = _worst(layout, got, naive(model, layout, batch))
    assert err < 1e-5, (name, err, where)


class ShortConv(nn.Module):
    """LFM2's pattern: a depthwise causal conv whose Conv1d child's weight the parent hands to F.conv1d (the
    child's forward never runs), before the wrapped MLP."""

    def __init__(self, mlp: nn.Module, hidden: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.conv = nn.Conv1d(hidden, hidden, 3, groups=hidden, padding=2)

    def forward(self, x):
        y = F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=2, groups=x.shape[-1])
        return self.mlp(x + y[..., : x.shape[1]].transpose(1, 2))


class _OldStyleSquare(torch.autograd.Function):
    """x ⊙ w² as an autograd.Function without setup_context (torch.func cannot transform it)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * w, (g * x * 2 * w).sum(tuple(range(g.dim() - 1)))


class _BranchingSquare(_OldStyleSquare):
    """:class:`_OldStyleSquare` whose backward branches on its cotangent's values (vmap cannot batch it)."""

    @staticmethod
    def backward(ctx, g):
        if not bool(g.abs().sum() > 0):
            x, w = ctx.saved_tensors
            return torch.zeros_like(x), torch.zeros_like(w)
        return _OldStyleSquare.backward(ctx, g)


class OldStyleGain(nn.Module):
    """x ⊙ w² by :class:`_OldStyleSquare`; ``kind`` "stateful": like RecurrentGemma's RG-LRU, it runs only on the
    whole batch (its state is sized for it); "stateful-branching": so, with a backward vmap cannot batch
    (:class:`_BranchingSquare`); "graph-only": with grad enabled it runs only inside the model's forward (on an
    input that requires grad), so no replay of it can run."""

    def __init__(self, hidden: int, kind: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.kind = kind

    def forward(self, x):
        if self.kind.startswith("stateful") and x.shape[0] < 2:
            raise RuntimeError("the recurrent state was allocated for the whole batch")
        if self.kind == "graph-only" and torch.is_grad_enabled() and not x.requires_grad:
            raise RuntimeError("this forward runs only inside the model's")
        square = _BranchingSquare if self.kind == "stateful-branching" else _OldStyleSquare
        return square.apply(x, self.weight)


def planted_llama(kind: str) -> nn.Module:
    model = tiny_llama(V, intermediate=48, pad_token_id=PAD)
    for layer in model.model.layers:
        if kind == "conv":
            layer.mlp = ShortConv(layer.mlp, 32)
        else:
            layer.post_attention_layernorm = nn.Sequential(layer.post_attention_layernorm, OldStyleGain(32, kind))
    return perturb(model)


@pytest.mark.parametrize("kind", ["conv", "old-style-function", "stateful", "stateful-branching"])
def test_planted_parameters_take_the_generic_path_exactly(kind):
    """A weight used by its parent's forward (rebound to the parent), a forward torch.func cannot transform
    (looped over samples) and one that runs only on the whole batch (one forward, a backward per sample of its
    cotangent rows alone: vmapped, or one at a time where vmap cannot batch that backward) are exact, also
    without the self-check (the reference: the same weights in modules that also run one sample)."""
    model = planted_llama(kind)
    layout = select_parameters(model)
    batch = make_batch(33, **BATCH)
    ref = naive_scores(planted_llama("old-style-function" if kind.startswith("stateful") else kind), layout, batch)
    for check in (True, False):
        err, where = _worst(layout, hook_scores(model, layout, batch, check=check), ref)
        assert err < 1e-5, (kind, check, err, where)


def test_forward_that_cannot_run_per_sample_refused_naming_every_layer_and_a_selection_that_runs():
    """The module of every layer fails in the backward: one refusal names each one's parameter once, and the
    selection it proposes runs, exactly (the reference: the same weights in modules that also run one sample)."""
    model = planted_llama("graph-only")
    batch = make_batch(33, **BATCH)
    with pytest.raises(
        ValueError,
        match=r"2 selected parameters: 'model\.layers\.1\.post_attention_layernorm\.1\.weight': the per-sample "
        r"vector-Jacobian product of model\.layers\.1\.post_attention_layernorm\.1 \(a OldStyleGain\) failed",
    ) as info:
        hook_scores(model, select_parameters(model), batch, check=False)
    msg = str(info.value)
    assert "\n" not in msg and msg.count("'model.layers.0.post_attention_layernorm.1.weight'") == 1
    layout = select_parameters(model, ast.literal_eval(msg.split("model.params = ")[1]))
    assert not any(".post_attention_layernorm.1." in n for n in layout.names)
    ref = naive_scores(planted_llama("old-style-function"), layout, batch)
    err, where = _worst(layout, hook_scores(model, layout, batch), ref)
    assert err < 1e-5, (err, where)


def test_expert_tensors_take_the_fused_rule_and_small_parameters_the_generic_path():
    """Experts with biases and transposed weights (GPT-OSS) get the fused-experts rule; a mixer's own small
    parameters and its short conv (Qwen3.5's Gated DeltaNet) share one generic-rule binding of the mixer."""
    from covgrad.scores.binding import rule_for
    from covgrad.scores.experts import _experts_rule

    oss = FAMILIES["gpt-oss"]()
    assert rule_for(oss.model.layers[0].mlp.experts) == (
        _experts_rule,
        frozenset({"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}),
    )
    qwen = FAMILIES["qwen3.5"]()
    psg = PerSampleGrads(qwen, select_parameters(qwen))
    batch = make_batch(30, **BATCH)
    psg(
        batch["input_ids"],
        batch["attention_mask"],
        lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"]),
        position_ids=batch["position_ids"],
    )
    mixer = qwen.model.layers[0].linear_attn
    replays = [set(local) for m, rule, local in psg.bindings() if m is mixer]
    assert replays == [{"dt_bias", "A_log", "conv1d.weight"}]
    assert all(rule is generic_rule for m, rule, _ in psg.bindings() if m is mixer)
    # taken at the ops that use them (covgrad.scores.optaps), not by replaying the mixer
    paths = psg.generic_paths()
    assert {paths[f"model.layers.0.linear_attn.{n}"] for n in ("dt_bias", "A_log", "conv1d.weight")} == {"op"}


@pytest.mark.parametrize("name", ["qwen3.5", "lfm2", "gpt-oss", "deepseek-v3", "mamba2", "nemotron-h-moe"])
def test_token_backward_rows_match_per_sample_grads(name):
    """The token-Fisher engine's batched logit cotangents (the repeated-batch path, which every family with
    a generic-path parameter takes) give, per row, the per-sample gradients of that cotangent alone."""
    from covgrad.tokens.backward import TokenBackward

    model = FAMILIES[name]()
    layout = select_parameters(model)
    batch = make_batch(32, **BATCH)
    ids, attn, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    eng = TokenBackward(model, layout, ids, attn, pos)
    gen = torch.Generator().manual_seed(5)
    cot = torch.randn(2, *eng.logits.shape, generator=gen) * attn[None, :, :, None]  # (R, B, L, V)
    got = eng.grads(cot).double()  # (R, B, P)
    psg = PerSampleGrads(model, layout, check=False)
    for r in range(cot.shape[0]):
        ref = psg(ids, attn, lambda z, r=r: cot[r], position_ids=pos).double()
        err, where = _worst(layout, got[r], ref)
        assert err < 1e-5, (name, r, err, where)


@pytest.mark.parametrize("dense", [True, False])
def test_outer_major_rows_are_found_by_the_check(dense, monkeypatch):
    """Llama 4's routed experts see an (experts·B·L, H) batch, expert-major: the trace finds that layout
    (each sample's rows depend on its own embeddings only when read that way), and the dense experts rule splits
    it by (expert, sample) blocks; with that rule off (a class it does not know), the generic rule splits it by
    replaying the module, and ``generic_paths`` says so. Both against the naive loop."""
    if not dense:
        monkeypatch.setattr(binding, "_dense_experts_ok", lambda module: False)
    model = FAMILIES["llama4"]()
    layout = select_parameters(model)
    psg = PerSampleGrads(model, layout)
    batch = make_batch(30, **BATCH)
    ids = batch["input_ids"]
    got = psg(
        ids, batch["attention_mask"], lambda z: score_logit_grad(z, ids, batch["target_mask"]), batch["position_ids"]
    )
    experts = {n: m for n, m in model.named_modules() if type(m).__name__ == "Llama4TextExperts"}
    assert experts and all(id(m) in psg._outer for m in experts.values())
    rules = {rule for m, rule, _ in psg.bindings() if m in experts.values()}
    paths = psg.generic_paths()
    taken = {path for name, path in paths.items() if name.rsplit(".", 1)[0] in experts}
    assert (rules, taken) == (({_dense_experts_rule}, set()) if dense else ({generic_rule}, {"replay"}))
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
