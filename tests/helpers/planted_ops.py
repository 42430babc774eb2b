"""Tiny Llamas with planted modules whose small parameters meet the data in one op (covgrad.scores.optaps' cases):
a Gated DeltaNet-like mixer, gains along other dimensions than the batch, per-head gates of a batched matmul over
heads, flat and biased routers, a binned table, a short conv, a matmul mixing positions, attention-sink-like
parameters expanded to the batch, AltUp-like streams that are not batch-leading; and the per-sample rows of a
model's every trainable parameter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from covgrad.layout import select_parameters
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.families import perturb
from tests.helpers.models import tiny_llama
from tests.helpers.persample import PAD, V

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
