"""Calls that stand aside from the taps' mode (covgrad.scores.quiet): a tapped module's own methods that read no
``self`` and its children that hold none of its tapped parameters. Which qualify, that their ops are no longer
followed, and that the per-sample scores stay exact against the naive loop whether a call stands aside or runs in
the mode (handed a derived tensor; a child tapped itself)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from torch import Tensor, nn
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

from covgrad.layout import select_parameters
from covgrad.scores import optaps
from covgrad.scores.quiet import quiet_children, quiet_methods
from tests.helpers.models import tiny_llama
from tests.helpers.persample import BATCH, PAD, V, hook_scores, make_batch, max_rel_err, naive_scores, right_padded


class Scanned(nn.Module):
    """A gated running sum over positions: the gate scale is a parameter used by one op, the scan a Python loop in
    a method of its own. ``handed``: the forward passes softplus(scale) into the scan (a derived tensor)."""

    def __init__(self, hidden: int, handed: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(hidden))
        self.handed = handed

    def forward(self, x: Tensor) -> Tensor:
        if self.handed:
            return self._scan_with(x, F.softplus(self.scale))
        return self._scan(torch.sigmoid(x) * F.softplus(self.scale))

    def _scan(self, gate: Tensor) -> Tensor:
        state, out = torch.zeros_like(gate[:, 0]), torch.zeros_like(gate)
        for t in range(gate.shape[1]):
            state = 0.5 * state + gate[:, t]
            out[:, t] = state
        return out

    def _scan_with(self, x: Tensor, d: Tensor) -> Tensor:
        state, out = torch.zeros_like(x[:, 0]), torch.zeros_like(x)
        for t in range(x.shape[1]):
            state = 0.5 * state + torch.sigmoid(x[:, t]) * d
            out[:, t] = state
        return out

    def _reads_param(self, x: Tensor) -> Tensor:
        return x * self.scale

    def _calls_method(self, x: Tensor) -> Tensor:
        return self._scan(x)

    def _captures(self, x: Tensor) -> Tensor:
        return (lambda: x * self.scale)()

    @staticmethod
    def _static(x: Tensor) -> Tensor:
        return x + 1


class Hiding(nn.Module):
    """A child that keeps another module's parameter out of its registry (in a tuple)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.kept = (weight,)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.kept[0]


class Gated(nn.Module):
    """x ↦ down(mlp(x) ⊙ gain) + scanned(x): ``gain`` is tapped (used by one op), ``mlp`` a child with rules of its
    own (stands aside), ``scanned`` a child tapped itself (runs in the mode)."""

    def __init__(self, mlp: nn.Module, hidden: int, handed: bool) -> None:
        super().__init__()
        self.mlp, self.scanned = mlp, Scanned(hidden, handed)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.down = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.mlp(x) * self.gain) + self.scanned(x)


def test_quiet_methods_read_no_self():
    assert quiet_methods(Scanned(4, False)) == ("_scan", "_scan_with")
    config = T.RecurrentGemmaConfig(hidden_size=8, lru_width=8, num_attention_heads=2, intermediate_size=16)
    assert "_rnn_scan" in quiet_methods(RecurrentGemmaRglru(config))


def test_quiet_children_hold_none_of_the_tapped_parameters():
    module = Gated(nn.Linear(4, 4), 4, False)
    module.hiding = Hiding(module.gain)
    module.owning = nn.Module()
    module.owning.gain = module.gain  # the tapped parameter registered again below
    assert quiet_children(module, {id(module.gain)}) == ("mlp", "scanned", "down")


def _model(handed: bool) -> nn.Module:
    model = tiny_llama(V, pad_token_id=PAD)
    torch.manual_seed(3)
    for layer in model.model.layers:
        layer.mlp = Gated(layer.mlp, 32, handed)
    return model.eval()


@pytest.mark.parametrize("handed", [False, True])
def test_quiet_calls_stand_aside_and_stay_exact(handed, monkeypatch):
    model = _model(handed)
    layout = select_parameters(model)
    batch = right_padded(make_batch(60, **BATCH))  # the scan carries its state forward: padding after the tokens
    seen: list[str] = []
    on_call = optaps.OpTaps.on_call

    def counting(self, func, args, kwargs):
        seen.append(getattr(func, "__name__", ""))
        return on_call(self, func, args, kwargs)

    monkeypatch.setattr(optaps.OpTaps, "on_call", counting)
    for check in (True, False):
        seen.clear()
        got = hook_scores(model, layout, batch, check=check)
        err, where = max_rel_err(layout, got, naive_scores(model, layout, batch))
        assert err < 1e-5, (handed, check, err, where)
    names = set(seen)
    assert ("__setitem__" in names) is handed  # the scan's ops: followed only where it was handed a derived tensor
    assert "silu" not in names  # the Llama MLP inside the tapped module: a quiet child, never followed
    for layer in model.model.layers:  # the wrappers are off after the pass
        assert "_scan" not in vars(layer.mlp.scanned) and "forward" not in vars(layer.mlp.mlp)
