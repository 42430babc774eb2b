"""``enable_input_require_grads`` (turned on by TRL's and PEFT's gradient checkpointing) makes the embedding output a
leaf that requires grad: the engine must still start its backward there, not serve zero rows."""

from __future__ import annotations

import pytest

from covgrad.layout import select_parameters
from tests.helpers.persample import hook_scores, llama, make_batch, max_rel_err, naive_scores


@pytest.mark.parametrize("tied", [True, False])
def test_scores_with_input_require_grads_equal_the_naive_loop(tied):
    model = llama(tied).eval()
    model.enable_input_require_grads()
    layout = select_parameters(model)
    batch = make_batch(1, [3, 5, 2], [4, 2, 3])
    got = hook_scores(model, layout, batch, check=False)
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch))
    assert got.abs().sum() > 0 and err < 1e-4, (err, where)
