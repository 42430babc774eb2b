"""Which per-sample rule each module takes, and what the fused reduction and the shard plan read from that choice.

:func:`rule_for` dispatches over the rules of :mod:`covgrad.scores.rules`, :mod:`covgrad.scores.experts` and
:mod:`covgrad.scores.mlp_experts`.
Fast rules are matched by exact class (a subclass may change the forward: Gemma's scaled embedding multiplies
inside it), RMSNorm and fused-expert classes by the source text of their forward, so any family whose norm is a
verbatim copy of Llama's, OLMo2's or Gemma's gets the fast rule. An experts block of any other class is recognised
by its shape (:func:`covgrad.scores.experts.experts_shape`); every other module gets :func:`generic_rule` over its
own parameters. :func:`writes_weight_in_row_chunks`, :func:`folds_in_row_chunks` and :func:`writes_row_parts` say
how the chosen rule writes a weight's per-sample block: in chunks of its rows, or only the rows of a row-cut block.

This module sits above the rule modules, which never import it.
"""

from __future__ import annotations

from torch import nn
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.pytorch_utils import Conv1D

from covgrad.scores.dense_experts import _dense_experts_ok, _dense_experts_rule
from covgrad.scores.experts import (
    _experts_params,
    _experts_rule,
    _fused_experts_ok,
    _routed_experts_rule,
    experts_shape,
)
from covgrad.scores.mlp_experts import MLP_EXPERTS_PARAMS, _mlp_experts_ok, _mlp_experts_rule
from covgrad.scores.rules import (
    Rule,
    _conv1d_rule,
    _embedding_rule,
    _layernorm_rule,
    _learned_positions_rule,
    _linear_rule,
    _rmsnorm_style,
    _scaled_embedding_rule,
    _scaled_embeddings,
    _torch_conv1d_rule,
    _torch_rmsnorm_rule,
    generic_rule,
    learned_positions_ok,
    plain_conv1d,
    rmsnorm_rule,
)

# Fast rules by exact class, and the parameter names each covers.
_EXACT: dict[type, tuple[Rule, frozenset[str]]] = {
    nn.Linear: (_linear_rule, frozenset({"weight", "bias"})),
    FalconLinear: (_linear_rule, frozenset({"weight", "bias"})),  # input @ weight.T + bias: the same map
    Conv1D: (_conv1d_rule, frozenset({"weight", "bias"})),
    nn.Embedding: (_embedding_rule, frozenset({"weight"})),
    nn.LayerNorm: (_layernorm_rule, frozenset({"weight", "bias"})),
    nn.RMSNorm: (_torch_rmsnorm_rule, frozenset({"weight"})),
    **_scaled_embeddings(),
}


def writes_weight_in_row_chunks(module: nn.Module) -> bool:
    """Whether the module's rule asks ``slot.rows`` for its weight (Linear, Falcon's Linear, GPT-2 Conv1D, the
    embeddings)."""
    found = rule_for(module)
    return not isinstance(found, str) and found[0] in (
        _linear_rule,
        _conv1d_rule,
        _embedding_rule,
        _scaled_embedding_rule,
    )


def folds_in_row_chunks(owners: list[nn.Module]) -> bool:
    """Whether the fused reduction forms a weight's per-sample block in row chunks, given the modules that own it:
    one whose rule writes its weight in chunks (:func:`writes_weight_in_row_chunks`), or two (a tied embedding),
    one of them writing in chunks and the other's rule adding rows to them (:func:`covgrad.scores.rules.adds_rows`)."""
    if len(owners) == 1:
        return writes_weight_in_row_chunks(owners[0])
    if len(owners) != 2:
        return False
    adds = [not isinstance(f := rule_for(m), str) and hasattr(f[0], "row_adder") for m in owners]
    return any(adds[i] and writes_weight_in_row_chunks(owners[1 - i]) for i in range(2))


def writes_row_parts(module: nn.Module) -> bool:
    """Whether the module's rule writes only the rows of a row-cut block (marked by
    :func:`covgrad.scores.rules.row_parts`)."""
    found = rule_for(module)
    return not isinstance(found, str) and getattr(found[0], "row_parts", False)


def rule_for(module: nn.Module) -> tuple[Rule, frozenset[str]] | str:
    """The module's rule and the parameter names it covers, or the reason it has none.

    Fast rules by exact class (and verified forward source for RMSNorms and fused, dense and plain-MLP experts);
    any other module gets :func:`generic_rule` over its own parameters (a module with parametrised submodules too:
    they keep their own rules, and its forward is replayed per sample with them as constants).
    """
    cls = type(module)
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
        return "max_norm and scale_grad_by_freq change the gradient and have no per-sample rule"
    if cls in _EXACT:
        return _EXACT[cls]
    if learned_positions_ok(cls) and module.max_norm is None and not module.scale_grad_by_freq:
        return _learned_positions_rule, frozenset({"weight"})
    if cls is nn.Conv1d and plain_conv1d(module):
        return _torch_conv1d_rule, frozenset({"weight", "bias"})
    if _rmsnorm_style(cls) is not None:
        return rmsnorm_rule, frozenset({"weight"})
    if _fused_experts_ok(module):
        return _experts_rule, _experts_params(module)
    if _dense_experts_ok(module):
        return _dense_experts_rule, frozenset({"gate_up_proj", "down_proj"})
    if _mlp_experts_ok(module):
        return _mlp_experts_rule, MLP_EXPERTS_PARAMS
    if (experts := experts_shape(module)) is not None:
        return _routed_experts_rule, experts.names()
    own = frozenset(pn for pn, _ in module.named_parameters(recurse=False))
    return generic_rule, own
