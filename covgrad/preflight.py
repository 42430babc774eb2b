"""Per-sample machinery checked against a model before any stage runs.

Two steps, seconds in all, so that an unsupported module or a rule that does not match its module's
forward is reported before rollouts are sampled:

1. the full architecture on the meta device (no memory, no weights): every selected parameter must be
   owned by a module with a per-sample rule (:class:`covgrad.persample.PerSampleGrads` names the
   parameter and the module type otherwise);
2. the same architecture cut to at most two layers, randomly initialised on the CPU in float32, runs
   one checked per-sample pass on a two-sample, left-padded batch: the parameters of every module type
   selected in step 1 go through their rules and the self-check (Σ_n s_n against the batched gradient).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from covgrad.layout import select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad

_LAYERS = 2


def _reduced(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with at most ``layers`` decoder layers (per-layer lists cut to match)."""
    config = config.__class__.from_dict(config.to_dict())
    text = config.get_text_config()
    n = getattr(text, "num_hidden_layers", None)
    if n is None or n <= layers:
        return config
    for key, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) == n:
            setattr(text, key, value[:layers])
    text.num_hidden_layers = layers
    return config


def _selected_types(model: nn.Module, names: set[str]) -> set[tuple[type, str]]:
    """(module type, local parameter name) of every selected parameter."""
    return {
        (type(m), pn)
        for mn, m in model.named_modules()
        for pn, _ in m.named_parameters(recurse=False)
        if (f"{mn}.{pn}" if mn else pn) in names
    }


def meta_model(path: str, trust_remote_code: bool = False) -> tuple[PretrainedConfig, nn.Module]:
    """The config of the model directory ``path`` and its architecture on the meta device (only
    ``config.json`` is read: no weights, no memory), in the current default dtype."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_model(path: str, params: list[str] | None, trust_remote_code: bool = False, self_check: bool = True) -> None:
    """Raise ValueError (one line, naming the parameter and module type) unless per-sample scores of the
    model at ``path`` with the parameter selection ``params`` (globs, None = all trainable) are supported.

    Args:
        path: a Hugging Face model directory (only its config is read).
        params: the ``model.params`` selection.
        trust_remote_code: as for loading the model.
        self_check: also run step 2 (a checked pass on a cut-down random copy).
    """
    config, full = meta_model(path, trust_remote_code)
    layout = select_parameters(full, params)
    try:
        PerSampleGrads(full, layout, check=False)
    except ValueError as exc:
        raise ValueError(f"preflight ({path}): {exc}") from None
    if not self_check:
        return
    wanted = _selected_types(full, set(layout.names))
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(
        _reduced(config, _LAYERS), trust_remote_code=trust_remote_code, dtype=torch.float32
    ).eval()
    names = [
        f"{mn}.{pn}" if mn else pn
        for mn, m in small.named_modules()
        for pn, p in m.named_parameters(recurse=False)
        if (type(m), pn) in wanted and p.requires_grad
    ]
    small_layout = select_parameters(small, sorted(set(names) & set(dict(small.named_parameters()))))
    vocab = small.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    target = torch.zeros(2, 6)
    target[:, 3:] = 1.0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    try:
        PerSampleGrads(small, small_layout, check=True)(
            ids, mask, lambda z: score_logit_grad(z, ids, target), position_ids=pos
        )
    except ValueError as exc:
        raise ValueError(f"preflight ({path}, {_LAYERS}-layer random copy): {exc}") from None
