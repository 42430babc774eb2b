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
from torch import nn
from torch.utils._pytree import tree_flatten

from covgrad.layout import select_parameters
from covgrad.scores import opgrads
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.opgrads import _DERIVED, _DSPLIT, _FLAT, _SPLIT, _Derived, _Record, _Use
from covgrad.scores.optaps import OpTaps
from tests.helpers.persample import BATCH, make_batch, max_rel_err, naive_scores
from tests.helpers.planted_ops import planted, scores, streams_llama


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
