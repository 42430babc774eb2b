"""The op-level path of generic-rule parameters (covgrad.scores.optaps) against the naive per-sequence loop: the Gated
DeltaNet pattern (a functional depthwise conv on a child's weight, softplus(a + dt_bias), -exp(A_log) · …) planted
in a tiny Llama takes the op path and is exact; a use whose data input has the samples along another dimension
than its leading one (a time-major view; RecurrentGemma's per-head gates, a baddbmm over heads of a (heads, B·L, d)
view, with as many heads as samples or not) is split along that dimension, found by the rows probe, and is exact; a
use whose data input does not split by sample falls back to the module replay, still exact; a use that mixes
samples fails the separability check; a parameter expanded to the batch (GPT-OSS's attention sinks) is split by
sample, and one whose leading dimension happens to be B is not; a parameter used in a module whose call is not
batch-leading (Gemma 3n's AltUp output scale on a (k, B, L, H) stack) is taken at its op with the op's rows probed,
and refused where they are not the samples."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from covgrad.layout import select_parameters
from covgrad.scores import opgrads
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.opgrads import _DERIVED, _DSPLIT, _FLAT, _SPLIT, _Derived, _Record, _Use
from covgrad.scores.optaps import OpTaps
from tests.helpers.families import perturb
from tests.helpers.models import tiny_llama
from tests.helpers.persample import BATCH, PAD, V, make_batch, max_rel_err, naive_scores

H = 32


class GatedConvMixer(nn.Module):
    """The Gated DeltaNet's small parameters around a wrapped MLP: the Conv1d child's weight handed to
    F.conv1d by this forward (the child never runs), dt_bias inside softplus, A_log exponentiated first."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.conv = nn.Conv1d(H, H, 4, groups=H, bias=False, padding=3)
        self.proj_a = nn.Linear(H, 4, bias=False)
        self.dt_bias = nn.Parameter(torch.randn(4))
        self.A_log = nn.Parameter(torch.randn(4) * 0.5)

    def forward(self, x):
        L = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), self.conv.weight.squeeze(1).unsqueeze(1), None, padding=3, groups=H)
        y = F.silu(y[..., :L]).transpose(1, 2)  # (B, L, H)
        g = -self.A_log.float().exp() * F.softplus(self.proj_a(x).float() + self.dt_bias)  # (B, L, 4)
        gate = torch.sigmoid(g).repeat_interleave(H // 4, dim=-1)
        return self.mlp(x + y * gate)


class TimeMajorGain(nn.Module):
    """A gain applied to a time-major (L, B, H) view: its data input's leading dimension is not the batch, its
    second is."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(H))

    def forward(self, x):
        return (x.transpose(0, 1) * self.weight).transpose(0, 1)


class InterleavedGain(nn.Module):
    """A gain applied to an (L, H·B) view whose samples interleave with the channels (the sample index fastest):
    no dimension of its data input has the samples as contiguous blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(H))

    def forward(self, x):
        B, L, _ = x.shape
        y = x.permute(1, 2, 0).reshape(L, H * B) * self.weight.repeat_interleave(B)  # (L, H·B)
        return y.reshape(L, H, B).permute(2, 0, 1)


class HeadGates(nn.Module):
    """RecurrentGemma's RG-LRU gates: per-head (heads, d, d) weights and (heads, d) biases (d = H / heads) applied by
    one baddbmm to a (heads, B·L, d) view of the input (each sample's L rows a contiguous block of its second
    dimension), the bias through ``bias[:, None, :]``, and a recurrent parameter scaling the log-gate through
    ``softplus``; the gated input is returned. Planted besides: a (d,) scale of that view, elementwise (split along
    its leading dimension when heads = B, it would pass the separability check)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        d = H // heads
        self.heads = heads
        self.gate_weight = nn.Parameter(torch.randn(heads, d, d) / d**0.5)
        self.gate_bias = nn.Parameter(0.3 * torch.randn(heads, d))
        self.recurrent_param = nn.Parameter(torch.randn(H))
        self.scale = nn.Parameter(1.0 + 0.3 * torch.randn(d))

    def forward(self, x):
        B, L, _ = x.shape
        act = x.reshape(B * L, self.heads, H // self.heads).permute(1, 0, 2) * self.scale  # (heads, B·L, d)
        res = torch.baddbmm(self.gate_bias[:, None, :], act, self.gate_weight)
        gate = torch.sigmoid(res.transpose(0, 1).reshape(B, L, H))
        return x * torch.exp(-gate * F.softplus(self.recurrent_param))


class Gain(nn.Module):
    """x ⊙ w: a generic-rule parameter taken at its op, whose output gradient hook sits on the next module's input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(H))

    def forward(self, x):
        return x * self.weight


class FlatRouter(nn.Module):
    """NemotronH's router pattern: its own weight applied to a (B·L, H) view made inside its forward (the op taps
    probe those rows back to the call's input by autograd, through the Gain's hook), around the wrapped MLP."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.weight = nn.Parameter(0.3 * torch.randn(4, H))

    def forward(self, x):
        logits = F.linear(x.reshape(-1, H), self.weight).sigmoid()  # (B·L, 4)
        return self.mlp(x) * (1.0 + logits.sum(-1).reshape(*x.shape[:-1], 1))


class BiasedRouter(nn.Module):
    """A router with a bias: ``F.linear`` of its own weight and bias on the (B·L, H) rows (``flat``) or on the
    (B, L, H) input, its logits' softmax scaling the wrapped MLP."""

    def __init__(self, mlp: nn.Module, flat: bool) -> None:
        super().__init__()
        self.mlp, self.flat = mlp, flat
        self.weight = nn.Parameter(0.3 * torch.randn(4, H))
        self.bias = nn.Parameter(0.1 * torch.randn(4))

    def forward(self, x):
        rows = x.reshape(-1, H) if self.flat else x
        probs = F.linear(rows, self.weight, self.bias).softmax(-1)
        return self.mlp(x) * probs[..., :1].reshape(*x.shape[:-1], 1)


class BinnedTable(nn.Module):
    """A table looked up by ids computed from the input (two sign bits of its first channels: 4 ids, id 1 the
    padding one), as OPT looks up its learned positions: ``F.embedding`` of its own weight, added to the MLP."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.weight = nn.Parameter(0.3 * torch.randn(4, H))

    def forward(self, x):
        ids = (x[..., 0] > 0).long() * 2 + (x[..., 1] > 0).long()
        return self.mlp(x) + F.embedding(ids, self.weight, 1)


class ShortConv(nn.Module):
    """A depthwise convolution of width 3 along each position's features, seen as 2 channels of H/2 (a short
    conv's layout, on rows of the flattened batch, so that padding cannot enter), called as transformers' Mamba
    layers call it (``F.conv1d`` with keyword weight, bias, padding and groups), added to the MLP."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.weight = nn.Parameter(0.3 * torch.randn(2, 1, 3))
        self.bias = nn.Parameter(0.1 * torch.randn(2))

    def forward(self, x):
        rows = x.reshape(-1, 2, H // 2)  # (B·L, 2, H/2)
        conv = F.conv1d(rows, weight=self.weight, bias=self.bias, padding=1, groups=2)
        return self.mlp(x) + conv.reshape(x.shape)


class Mixes(nn.Module):
    """Two matrices applied by ``@``: one on the left of the (B, H, L) channels-first input, one on the right
    of the (B, L, H) rows, added to the MLP."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.left = nn.Parameter(0.2 * torch.randn(H, H))
        self.right = nn.Parameter(0.2 * torch.randn(H, H))

    def forward(self, x):
        return self.mlp(x) + (self.left @ x.transpose(1, 2)).transpose(1, 2) + torch.tanh(x) @ self.right


class BatchSinks(nn.Module):
    """GPT-OSS's attention sinks around the wrapped MLP: one logit per head expanded to the batch (B, heads, L, 1),
    concatenated with each head's data logit and softmaxed; the data's share gates the MLP's output."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, x):
        B, L, _ = x.shape
        logits = x.reshape(B, L, 4, H // 4).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, 4, L, 1)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, L, -1)
        share = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :1]  # (B, 4, L, 1)
        return self.mlp(x) * (1.0 + share.transpose(1, 2).repeat_interleave(H // 4, dim=2).reshape(B, L, H))


class GroupGain(nn.Module):
    """x ⊙ w over groups of 4 channels, with w of shape (4,): its leading dimension is the batch size of BATCH,
    but it broadcasts over channels, so the taps must take it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(4))

    def forward(self, x):
        return (x.reshape(*x.shape[:-1], H // 4, 4) * self.weight).reshape(x.shape)


class StreamScale(nn.Module):
    """Gemma 3n's ``Gemma3nTextAltUp.correct_output_scale``: a scale whose forward its parent calls as a method
    (``scaled``), so no module call of it happens and the use belongs to the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.3 * torch.randn(H))

    def forward(self, x):
        return x * self.scale

    def scaled(self, x):
        return self.forward(x)


class Streams(nn.Module):
    """Gemma 3n's decoder layer pattern on a (k, B, L, H) stack of streams (the batch is its second dimension):
    the streams mixed by a (k, k) Linear, then rows of the mixed stack scaled by :class:`StreamScale` and added to
    every stream but the first. ``rows`` picks the scaled rows: "own" the first stream (B, L, H), cloned (Gemma
    3n's); "streams" sample 0's k streams (k, L, H), added back to sample 0's streams alone (the model keeps the
    samples apart), whose leading dimension is B when k = B but whose rows are not the samples; "swapped" the
    first stream with the rows of samples 1 and 2 swapped (and swapped back after): a leading dimension of B whose
    rows are the samples but two of them in each other's place."""

    def __init__(self, k: int, rows: str) -> None:
        super().__init__()
        self.mix = nn.Linear(k, k, bias=False)
        self.out = StreamScale()
        self.rows = rows

    def forward(self, stack):
        mixed = self.mix(stack.permute(1, 2, 3, 0)).permute(3, 0, 1, 2) + stack  # (k, B, L, H)
        if self.rows == "streams":  # sample 0's streams scaled, back into its own place: (k, L, H)
            return torch.cat([mixed[:, :1] + self.out.scaled(mixed[:, 0])[:, None], mixed[:, 1:]], dim=1)
        x = mixed[0].clone()
        swap = torch.arange(x.shape[0])
        if self.rows == "swapped" and len(swap) > 2:  # a batch of 2 (the first call's trace) or 1 stays in order
            swap[1:3] = swap[1:3].flip(0)
        return torch.cat([mixed[:1], mixed[1:] + self.out.scaled(x[swap])[swap]])


class StreamMLP(nn.Module):
    """The wrapped MLP on the mean of :class:`Streams` run on k scaled copies of its input, stacked (k, B, L, H)."""

    def __init__(self, mlp: nn.Module, k: int, rows: str) -> None:
        super().__init__()
        self.mlp = mlp
        self.streams = Streams(k, rows)
        self.k = k

    def forward(self, x):
        stack = torch.stack([x * (1.0 + 0.5 * i) for i in range(self.k)])
        return self.mlp(self.streams(stack).mean(0))


def streams_llama(k: int, rows: str = "own") -> nn.Module:
    torch.manual_seed(0)
    model = tiny_llama(V, intermediate=48, pad_token_id=PAD)
    for layer in model.model.layers:
        layer.mlp = StreamMLP(layer.mlp, k, rows)
    return perturb(model)


def planted(kind: str, heads: int = 4) -> nn.Module:
    torch.manual_seed(0)
    model = tiny_llama(V, intermediate=48, pad_token_id=PAD)
    for layer in model.model.layers:
        if kind == "mixer":
            layer.mlp = GatedConvMixer(layer.mlp)
        elif kind == "sinks":
            layer.mlp = BatchSinks(layer.mlp)
            layer.post_attention_layernorm = nn.Sequential(layer.post_attention_layernorm, GroupGain())
        elif kind == "router":
            layer.post_attention_layernorm = nn.Sequential(layer.post_attention_layernorm, Gain())
            layer.mlp = FlatRouter(layer.mlp)
        elif kind == "conv":
            layer.mlp = ShortConv(layer.mlp)
        elif kind == "matmul":
            layer.mlp = Mixes(layer.mlp)
        elif kind == "table":
            layer.mlp = BinnedTable(layer.mlp)
        elif kind in ("biased-flat", "biased"):
            layer.mlp = BiasedRouter(layer.mlp, flat=kind == "biased-flat")
        elif kind == "gates":
            layer.post_attention_layernorm = nn.Sequential(layer.post_attention_layernorm, HeadGates(heads))
        else:
            gain = TimeMajorGain() if kind == "time-major" else InterleavedGain()
            layer.post_attention_layernorm = nn.Sequential(layer.post_attention_layernorm, gain)
    return perturb(model)


def scores(model: nn.Module, batch: dict, **kw: object) -> tuple[PerSampleGrads, torch.Tensor]:
    psg = PerSampleGrads(model, select_parameters(model), **kw)
    ids = batch["input_ids"]
    rows = psg(
        ids, batch["attention_mask"], lambda z: score_logit_grad(z, ids, batch["target_mask"]), batch["position_ids"]
    )
    return psg, rows


@pytest.mark.parametrize("check", [True, False])
def test_mixer_parameters_take_the_op_path_exactly(check):
    model = planted("mixer")
    layout = select_parameters(model)
    batch = make_batch(41, **BATCH)
    psg, rows = scores(model, batch, check=check)
    paths = psg.generic_paths()
    small = {n for n in layout.names if n.endswith(("dt_bias", "A_log", "conv.weight"))}
    assert small and all(paths[n] == "op" for n in small), paths
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
    _, replayed = scores(model, batch, check=False, op_taps=False)
    err, where = max_rel_err(layout, rows, replayed)
    assert err < 1e-5, (err, where)


@pytest.mark.parametrize("check", [True, False])
def test_parameters_with_a_batch_leading_dimension_take_the_op_path_exactly(check):
    """Sinks expanded to the batch are split by sample (each sample's cotangent is its own row of the expanded
    tensor); a (4,) gain with B = 4 broadcast over channels is taken whole; both exact against the naive loop."""
    model = planted("sinks")
    layout = select_parameters(model)
    batch = make_batch(45, **BATCH)
    assert batch["input_ids"].shape[0] == 4
    psg, rows = scores(model, batch, check=check)
    taken = {n: p for n, p in psg.generic_paths().items() if n.endswith(("sinks", "1.weight"))}
    assert len(taken) == 4 and set(taken.values()) == {"op"}, taken
    modes = {sig[2]: split.modes for sig, split in psg._taps.verified.items()}
    assert modes["_VariableFunctionsClass.cat"][:2] == [_SPLIT, _DSPLIT] and _DERIVED in modes["TensorBase.mul"], modes
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_fused_reduction_with_op_taps_matches_its_rows():
    from covgrad.moments.accum import MomentAccumulator

    model = planted("mixer")
    layout = select_parameters(model)
    batch = make_batch(42, **BATCH)
    ids = batch["input_ids"]
    fn = lambda z: score_logit_grad(z, ids, batch["target_mask"])  # noqa: E731
    adv, half = torch.tensor([0.5, -1.0, 2.0, 0.25]).numpy(), torch.tensor([0, 1, 0, 1]).numpy()
    psg = PerSampleGrads(model, layout, check=False)
    acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=False)
    psg.accumulate(ids, batch["attention_mask"], fn, acc, adv, half, batch["position_ids"])
    assert all(p == "op" for p in psg.generic_paths().values())
    rows = naive_scores(model, layout, batch).double()
    for h in (0, 1):
        sel = torch.from_numpy(half == h)
        assert torch.allclose(acc.mean[h], rows[sel].mean(0), rtol=1e-5, atol=1e-7)
        m2 = ((rows[sel] - rows[sel].mean(0)) ** 2).sum(0)
        assert torch.allclose(acc.m2[h], m2, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("check", [True, False])
def test_rows_probe_passes_the_previous_taps_hook_without_running_it(check):
    """The router's flattened rows are probed by autograd mid-forward, through the gain's output, whose tap hook
    must stand aside (it once ran its rule there, before the pass had blocks: an AttributeError)."""
    model = planted("router")
    layout = select_parameters(model)
    batch = make_batch(44, **BATCH)
    psg, rows = scores(model, batch, check=check)
    taken = {n: p for n, p in psg.generic_paths().items() if n.endswith(("1.weight", "mlp.weight"))}
    assert len(taken) == 4 and set(taken.values()) == {"op"}, taken
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


CLOSED = [  # kind, closed form, its calls per pass, cotangents per call, the parameters it covers (name part, count)
    ("biased-flat", "_linear_cots", 2, 2, (".mlp.", 4)),
    ("biased", "_linear_cots", 2, 2, (".mlp.", 4)),
    ("table", "_embedding_cots", 2, 1, (".mlp.", 2)),
    ("sinks", "_cat_cots", 2, 1, (".mlp.", 2)),
    ("conv", "_conv1d_cots", 2, 2, (".mlp.", 4)),
    ("matmul", "_matmul_cots", 4, 1, (".mlp.", 4)),
    ("gates", "_baddbmm_cots", 2, 2, ("post_attention_layernorm.1.", 8)),
    ("gates", "_elementwise_cots", 4, 1, ("post_attention_layernorm.1.", 8)),  # the scale, -gate · softplus(p)
]


@pytest.mark.parametrize(("kind", "closed", "n_calls", "n_cots", "covered"), CLOSED)
def test_a_use_with_a_closed_form_takes_it_exactly(kind, closed, n_calls, n_cots, covered, monkeypatch):
    """``F.linear`` of a router's weight and bias on flattened or batch-leading rows, ``F.embedding`` of a table
    with a padding id on ids computed in the forward, sinks expanded to the batch and concatenated to data along
    its last dimension, a depthwise ``F.conv1d`` with keyword arguments, matrices on either side of ``@``, and
    RecurrentGemma's per-head ``baddbmm`` and scale on a (heads, B·L, d) view (the samples along its second
    dimension): their per-sample cotangents in closed form, exact against the naive loop and against the vmapped
    vjp they replace."""
    model = planted(kind)
    layout = select_parameters(model)
    batch = make_batch(46, **BATCH)
    real = getattr(opgrads, closed)
    taken = []

    def counted(*args):
        taken.append(real(*args))
        return taken[-1]

    forms = opgrads._CLOSED_FORMS
    monkeypatch.setattr(opgrads, "_CLOSED_FORMS", tuple(counted if f is real else f for f in forms))
    psg, rows = scores(model, batch, check=False)
    taken = [c for c in taken if c is not None]
    assert [len(c) for c in taken] == [n_cots] * n_calls, taken
    part, count = covered
    paths = {n: p for n, p in psg.generic_paths().items() if n.startswith("model.layers.") and part in n}
    assert len(paths) == count and set(paths.values()) == {"op"}, paths
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
    monkeypatch.setattr(opgrads, "_CLOSED_FORMS", tuple(f for f in forms if f is not real))
    _, vmapped = scores(model, batch, check=False)
    err, where = max_rel_err(layout, rows, vmapped)
    assert err < 1e-6, (err, where)


def test_use_whose_samples_are_another_dimension_takes_the_op_path_exactly():
    """A gain on a time-major (L, B, H) view (L = 10 rows, not a multiple of B = 4): the rows probe finds the samples
    in dimension 1 of its input and output; exact without the self-check."""
    model = planted("time-major")
    layout = select_parameters(model)
    batch = make_batch(43, **BATCH)
    psg, rows = scores(model, batch, check=False)
    gains = [n for n in layout.names if n.endswith("post_attention_layernorm.1.weight")]
    assert gains and all(psg.generic_paths()[n] == "op" for n in gains)
    assert {(split.dims, split.out_dim) for split in psg._taps.verified.values()} == {((1, 0), 1)}
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_per_head_gates_of_a_batched_matmul_over_heads_take_the_op_path_exactly(heads):
    """RecurrentGemma's gates: the baddbmm's (heads, B·L, d) operand and its output split along their second
    dimension, found by the rows probe, whatever the number of heads against B = 4: 2 (no split of the leading
    dimension), 4 (a leading dimension of B, but heads: its rows probe fails) or 8 (a multiple of B, flattened rows
    that are not the samples'), and so the view's elementwise scale; the weight and ``bias[:, None, :]`` are taken
    whole. Exact against the naive loop without the self-check (heads split as samples would still sum to the
    batched gradient)."""
    model = planted("gates", heads)
    layout = select_parameters(model)
    batch = make_batch(48, **BATCH)
    assert batch["input_ids"].shape[0] == 4
    psg, rows = scores(model, batch, check=False)
    paths = psg.generic_paths()
    gates = [n for n in layout.names if "post_attention_layernorm.1." in n]
    assert len(gates) == 8 and all(paths[n] == "op" for n in gates), paths
    splits = {sig[1:3]: split for sig, split in psg._taps.verified.items()}  # by (position, op) in each forward
    scale, bmm = splits[0, "TensorBase.mul"], splits[1, "_VariableFunctionsClass.baddbmm"]
    assert (scale.modes, scale.dims, scale.out_dim) == ([_FLAT, _DERIVED], (1, 0), 1), scale
    assert (bmm.modes, bmm.dims, bmm.out_dim) == ([_DERIVED, _FLAT, _DERIVED], (0, 1, 0), 1), bmm
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_use_that_does_not_split_by_sample_falls_back_to_the_replay_exactly():
    model = planted("interleaved")
    layout = select_parameters(model)
    batch = make_batch(43, **BATCH)
    psg, rows = scores(model, batch, check=False)
    gains = [n for n in layout.names if n.endswith("post_attention_layernorm.1.weight")]
    assert gains and all(psg.generic_paths()[n] == "replay" for n in gains)
    assert any("does not split by sample" in why for why in psg._taps.replay.values())
    err, where = max_rel_err(layout, rows, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_separability_check_catches_an_op_that_mixes_samples():
    """An op run per sample must reproduce the batched rows: one that reverses the batch does not."""
    taps = OpTaps(owner=None)  # the check itself reads nothing of the owner
    x, w = torch.randn(4, 5, 3), torch.randn(3)
    d = _Derived(w, w.detach().requires_grad_(), frozenset({"w"}), _Record(nn.Linear(1, 1), {}, 4, 0, {}))
    for func, mixes in ((torch.mul, False), (lambda a, b: a.flip(0) * b, True)):
        leaves, spec = tree_flatten(((x, w), {}))
        use = _Use(func, spec, leaves, [_SPLIT, _DERIVED], [d], frozenset({"w"}))
        why = taps._separable(use, func(x, w), 4)
        assert bool(why) == mixes, why


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("k", [3, 4])
def test_parameter_of_a_call_that_is_not_batch_leading_takes_the_op_path_exactly(k, check):
    """Gemma 3n's AltUp output scale: the trace finds the batch in dimension 1 of the (k, B, L, H) stack (k odd,
    or k = B: a leading dimension of B by coincidence), the op's (B, L, H) rows are probed back to the stack's
    samples, and the scores match the float64 one-backward-per-sequence loop. Without the op-level path the
    module replay would split the stack's streams as samples: refused."""
    model = streams_llama(k)
    layout = select_parameters(model)
    batch = make_batch(46, **BATCH)
    assert batch["input_ids"].shape[0] == 4
    psg, rows = scores(model, batch, check=check)
    scales = [n for n in layout.names if n.endswith("out.scale")]
    paths = psg.generic_paths()
    assert len(scales) == 2 and all(paths[n] == "op" for n in scales), paths
    assert {psg._names[i] for i in psg._crossed} == {f"model.layers.{i}.mlp.streams" for i in (0, 1)}
    err, where = max_rel_err(layout, rows, naive_scores(copy.deepcopy(model).double(), layout, batch))
    assert err < 1e-5, (err, where)
    with pytest.raises(ValueError, match=r"batch is dimension 1 of its first input: .* op-level path is off"):
        scores(model, batch, check=check, op_taps=False)


@pytest.mark.parametrize("rows", ["streams", "swapped"])
def test_op_rows_with_a_leading_dimension_of_b_that_are_not_the_samples_refused(rows):
    """The scaled rows have leading dimension B = k = 4 but are one sample's streams, or the samples with two of
    them swapped (an elementwise op on them passes the separability check, and the model keeps its samples
    apart): the rows probe refuses both, without the self-check, naming the scale of each layer once."""
    model = streams_llama(4, rows)
    batch = make_batch(47, **BATCH)
    with pytest.raises(ValueError, match=r"op-level path does not hold \(\S+ gives rows that are not sample") as info:
        scores(model, batch, check=False)
    msg = str(info.value)
    for i in (0, 1):
        assert msg.count(f"'model.layers.{i}.mlp.streams.out.scale'") == 1, msg
