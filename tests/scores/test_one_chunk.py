"""A selection whose whole (B, P) block fits one row chunk is one chunk, folded at the end of the backward
(covgrad.scores.blocks): the state is the per-tensor folds' bytes, the self-check still sees every tensor, the buffer
is reused, and a selection one byte larger than the chunk is not staged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.families.matrix import MATRIX
from tests.helpers.moments import assert_close, numpy_moments, state
from tests.helpers.persample import BATCH, MODELS, doubled_up_proj, llama, make_batch

# llama-tied: the LM head's rows with the embedding's added; gpt2-conv1d: Conv1D; mixtral: fused experts and the
# op-level router; lfm2: the short conv on the op-level path
CASES = ["llama-untied", "llama-tied", "gpt2-conv1d", "mixtral", "lfm2"]


def _model(name: str) -> torch.nn.Module:
    return MODELS[name]() if name in MODELS else MATRIX[name]()


def _batches(model: torch.nn.Module) -> list[tuple[dict, np.ndarray, np.ndarray]]:
    vocab = model.config.vocab_size
    out = []
    for seed in (50, 51, 52):
        batch = make_batch(seed, **BATCH)
        batch["input_ids"] = batch["input_ids"] % vocab
        gen = np.random.default_rng(seed)
        out.append((batch, gen.standard_normal(4), np.array([0, 1, 1, seed % 2])))
    return out


def _run(model, layout, batches, chunk_bytes, compiled, rows=False) -> tuple[MomentAccumulator, list, list]:
    """Accumulate ``batches``; the accumulator, every fold call's (offset, shape), and the rows of each batch."""
    psg = PerSampleGrads(model, layout, check=True, chunk_bytes=chunk_bytes)
    acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=compiled)
    calls, seen = [], []
    real_fold = acc.fold
    acc.fold = lambda offset, block: (calls.append((offset, tuple(block.shape))), real_fold(offset, block))
    for batch, a, h in batches:
        out = torch.empty(len(a), layout.P) if rows else None
        fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, h, batch["position_ids"], out=out)
        if rows:
            seen.append(out.clone())
    return acc, calls, seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", CASES)
def test_one_chunk_state_is_the_per_tensor_folds_bytes(name, compiled):
    """The one chunk is folded in one call where the fold is column by column (the compiled batches: the second
    and third, whose halves have samples), tensor by tensor where it is not (the eager GEMMs); either way the state
    is byte for byte that of a fold per tensor (no chunks), and numpy float64's moments of the rows to 1e-9."""
    model = _model(name)
    layout = select_parameters(model)
    batches = _batches(model)
    one = 4 * 4 * layout.P  # B = 4 rows of P float32
    whole = (0, (4, layout.P))
    per_tensor = [(e.offset, (4, e.numel)) for e in layout.entries]
    staged, calls, _ = _run(model, layout, batches, one, compiled)
    assert calls == per_tensor + [whole] * 2 if compiled else per_tensor * 3
    apart, calls, _ = _run(model, layout, batches, 0, compiled)
    assert whole not in calls and len(calls) >= 3 * len(layout.entries)
    _, calls, _ = _run(model, layout, batches, one - 1, compiled)  # one byte short of the chunk: not staged
    assert whole not in calls and len(calls) >= 3 * len(layout.entries)
    for key, value in staged.rows().items():
        assert value.tobytes() == apart.rows()[key].tobytes(), key
    with_rows, calls, rows = _run(model, layout, batches, one, compiled, rows=True)
    assert calls.count(whole) == (2 if compiled else 0)
    for key, value in with_rows.rows().items():
        assert value.tobytes() == staged.rows()[key].tobytes(), key
    S = torch.cat(rows).double().numpy()
    A = np.concatenate([a for _, a, _ in batches])
    half = np.concatenate([h for _, _, h in batches])
    assert_close(state(staged), numpy_moments(S, A, half), 1e-9)


def test_one_chunk_self_check_catches_a_rule_mismatch():
    """The self-check compares every tensor of the one chunk: a module whose rule does not match its forward is
    named."""
    model = doubled_up_proj(llama(tied=False))
    layout = select_parameters(model)
    batch = make_batch(53, **BATCH)
    psg = PerSampleGrads(model, layout, check=True, chunk_bytes=4 * 4 * layout.P)
    acc = MomentAccumulator(layout.P, "cpu")
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    args = (batch["input_ids"], batch["attention_mask"], fn, acc, np.ones(4), np.zeros(4, int), batch["position_ids"])
    with pytest.raises(ValueError, match=r"self-check failed for parameter 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        psg.accumulate(*args)
    assert psg._blocks.staged is False  # the call's state is dropped with the error


def test_one_chunk_buffer_is_reused_and_follows_the_batch():
    """The (B, P) buffer is made once and reused; a larger batch grows it; a smaller one uses its head."""
    model = llama(tied=True)
    layout = select_parameters(model)
    psg = PerSampleGrads(model, layout, check=False, chunk_bytes=8 * 4 * layout.P)
    acc = MomentAccumulator(layout.P, "cpu")
    buffers = []
    for n in (4, 4, 8, 2):
        batch = make_batch(54, prompt_lens=[3] * n, resp_lens=[4] * n)
        fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, np.arange(float(n)), np.arange(n) % 2)
        buffers.append((psg._blocks.stage.data_ptr(), psg._blocks.stage.numel()))
    assert buffers[0] == buffers[1] and buffers[2] == buffers[3]
    assert buffers[2][1] == 8 * layout.P > buffers[0][1] == 4 * layout.P
