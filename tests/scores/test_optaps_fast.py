"""The op-level taps' fast paths (covgrad.scores.optaps, covgrad.scores.opgrads) give what the general ones give: a
call flattened by hand has tree_flatten's leaves and spec (one spec object per structure) and is rebuilt as
tree_unflatten rebuilds it; a derived tensor that is its parameter reshaped by views takes its cotangent reshaped,
bit for bit what the batched backward through those views gives, and no other does; the closed form that took a
signature's last call is tried first, the others only when it does not take the call, with the same scores pass
after pass; an attribute read in the taps' mode marks only a tensor it returns."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from covgrad.layout import select_parameters
from covgrad.scores import opgrads
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.opgrads import (
    _DERIVED,
    _SPLIT,
    _batched_grad,
    _closed_cots,
    _Derived,
    _flatten,
    _Layout,
    _Record,
    _reshaped,
    _unflatten,
    _Use,
)
from covgrad.scores.optaps import OpTaps, _Flow
from tests.helpers.persample import BATCH, make_batch, max_rel_err, naive_scores
from tests.helpers.planted_ops import planted, scores

Point = namedtuple("Point", "x y")
x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)

CALLS = [  # (args, kwargs), whether its spec is the one of its structure (flattened by hand)
    (((x, w), {}), True),
    (((x, w, None), {}), True),
    (((x,), {"weight": w, "bias": None}), True),
    ((([x, w], -1), {}), True),
    ((((x, w), 0), {}), True),
    (((x, w, b, (1,), (2,), (1,), 3), {}), True),  # conv1d's stride, padding and dilation tuples
    ((([],), {"dim": 0}), True),
    (((), {}), True),
    (((x, torch.Size([2, 3])), {}), False),
    (((x, {"a": w}), {}), False),
    (((x, [[w]]), {}), False),
    (((x, Point(1, 2)), {}), False),
    (((x,), {"shape": (Point(1, 2),)}), False),
]


def _same(a: object, b: object) -> bool:
    """Equal trees whose leaves are the same objects."""
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    return sa == sb and all(p is q for p, q in zip(la, lb, strict=True))


@pytest.mark.parametrize(("call", "by_hand"), CALLS)
def test_a_call_flattened_by_hand_is_what_tree_flatten_gives(call, by_hand):
    args, kwargs = call
    leaves, spec = _flatten(args, kwargs)
    ref_leaves, ref_spec = tree_flatten((args, kwargs))
    assert spec == ref_spec and all(p is q for p, q in zip(leaves, ref_leaves, strict=True))
    assert (_flatten(args, kwargs)[1] is spec) is by_hand  # one spec object per structure: its rebuild by hand
    assert _same(_unflatten(leaves, spec), tree_unflatten(ref_leaves, ref_spec))
    assert _same(_unflatten(leaves, ref_spec), tree_unflatten(leaves, ref_spec))  # another spec object


VIEWS = [  # how a derived tensor is made from its (4, 8) parameter, whether that is the parameter reshaped
    (lambda p: p[:, None, :], True),  # RecurrentGemma's gate bias
    (lambda p: p.unsqueeze(1).squeeze(1), True),
    (lambda p: p.view(32), True),
    (lambda p: p.reshape(2, 16), True),
    (lambda p: p.flatten().unflatten(0, (8, 4)), True),
    (lambda p: p.t(), False),
    (lambda p: p.t().reshape(32), False),
    (lambda p: p.expand(3, 4, 8), False),
    (lambda p: p[1:], False),
    (lambda p: p.view(32)[::2], False),
    (lambda p: p * 2.0, False),
    (lambda p: (p * 2.0).view(32), False),
]


@pytest.mark.parametrize(("make", "reshape"), VIEWS)
def test_a_parameter_reshaped_by_views_takes_its_cotangent_reshaped(make, reshape):
    leaf = torch.randn(4, 8).requires_grad_()
    with torch.enable_grad():
        out = make(leaf)
    assert _reshaped(out, leaf) is reshape
    assert not _reshaped(out, torch.randn(4, 8).requires_grad_())  # another leaf
    if reshape:
        cot = torch.randn(5, *out.shape)
        cot[0, 0] = -0.0
        got = cot.reshape(5, *leaf.shape)
        (ref,) = _batched_grad(out, [leaf], cot)
        assert ref.shape == got.shape and torch.equal(ref.view(torch.int32), got.view(torch.int32))


def test_the_closed_form_of_a_signature_is_tried_first_pass_after_pass(monkeypatch):
    """A router's ``F.linear``: the first pass tries the elementwise form before the linear one; later passes of
    the same signatures go straight to the linear form, with the same scores bit for bit, exact."""
    model = planted("biased")
    layout = select_parameters(model)
    batch = make_batch(46, **BATCH)
    calls: list[str] = []

    def counted(form):
        def run(*args):
            calls.append(form.__name__)
            return form(*args)

        return run

    monkeypatch.setattr(opgrads, "_CLOSED_FORMS", tuple(counted(f) for f in opgrads._CLOSED_FORMS))
    psg, first = scores(model, batch, check=False)
    first = first.clone()
    assert calls == ["_elementwise_cots", "_linear_cots"] * 2, calls
    forms = {sig[2]: split.form for sig, split in psg._taps.verified.items()}
    assert set(forms) == {"linear"} and all(f is not None for f in forms.values()), forms
    ids = batch["input_ids"]
    for _ in range(2):
        calls.clear()
        rows = psg(
            ids,
            batch["attention_mask"],
            lambda z: score_logit_grad(z, ids, batch["target_mask"]),
            batch["position_ids"],
        )
        assert calls == ["_linear_cots"] * 2, calls
        assert torch.equal(rows, first)
    err, where = max_rel_err(layout, first, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_a_form_that_does_not_take_the_call_hands_it_to_the_others():
    """A signature whose last call the linear form took, now with a ``mul``: the elementwise form takes it (and is
    remembered), with the cotangent the loop over the forms gives."""
    data, weight = torch.randn(4, 5, 3), torch.randn(3)
    d = _Derived(weight, weight.detach().requires_grad_(), frozenset({"w"}), _Record(nn.Linear(1, 1), {}, 4, 0, {}))
    leaves, spec = _flatten((data, weight), {})
    g = torch.randn(4, 5, 3)
    layout = _Layout([_SPLIT, _DERIVED], form=opgrads._linear_cots)
    use = _Use(torch.mul, spec, leaves, [_SPLIT, _DERIVED], [d], frozenset({"w"}), layout=layout)
    ref = _closed_cots(_Use(torch.mul, spec, leaves, [_SPLIT, _DERIVED], [d], frozenset({"w"})), g, 4)
    got = _closed_cots(use, g, 4)
    assert layout.form is opgrads._elementwise_cots
    assert ref is not None and got is not None and torch.equal(got[0], ref[0])
    assert torch.equal(got[0], (g * data).sum(1))


def test_an_attribute_read_in_the_mode_marks_only_a_tensor_it_returns():
    taps = OpTaps(owner=None)  # a data-only call reads nothing of the owner
    data = torch.randn(2, 3).requires_grad_()
    with _Flow(taps):
        shape, dtype = data.shape, data.dtype
        assert not taps._data
        t = data.T  # a tensor of data: data
        fresh = torch.arange(2.0)  # a constant: not data
        both = t * fresh
    assert shape == (2, 3) and dtype == torch.float32
    assert id(t) in taps._data and id(fresh) not in taps._data and id(both) in taps._data
