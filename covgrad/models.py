"""Model construction for the demo and checks for user models (no file paths here: storage loads)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from covgrad.config import DemoModel
from covgrad.rollouts.inputs import context_of, no_context
from covgrad.rollouts.problems import DEMO_CONTEXT


def build_demo_model(
    cfg: DemoModel, tokenizer: PreTrainedTokenizerBase, max_positions: int = DEMO_CONTEXT
) -> LlamaForCausalLM:
    """A tiny Llama (RMSNorm, rotary, SwiGLU) for the demo, initialised from ``cfg.seed``.

    Sizes come from ``cfg``; the default (hidden 96, 2 layers) has about 2.2e5 parameters.
    """
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"demo hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def check_causal_lm(model: object, where: str) -> PreTrainedModel:
    """Return ``model`` if it is a causal LM with an output embedding; else ValueError naming ``where``."""
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise ValueError(f"{where} is not a causal language model (no LM head); give an AutoModelForCausalLM")
    return model


def check_finite_weights(tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """ValueError naming ``where``, the first tensor with a NaN or ±inf value and how many there are, unless
    every floating-point tensor of ``tensors`` (name, tensor of any shape) is finite; meta tensors (no values)
    are skipped. One ``torch.isfinite(t).all()`` per tensor; only a bad tensor is counted element by element.

    A single non-finite weight makes every score, and so every F, G and mask, NaN: it is refused, not served.
    """
    first, count, n_bad = "", 0, 0
    for name, t in tensors:
        if not t.is_floating_point() or t.is_meta or bool(torch.isfinite(t).all()):
            continue
        bad = int((~torch.isfinite(t)).sum())
        first = first or f"{name} ({bad} of {t.numel()})"
        count, n_bad = count + bad, n_bad + 1
    if count:
        raise ValueError(
            f"{where} has {count} non-finite weight value(s) (NaN or inf) in {n_bad} tensor(s), the first "
            f"{first}; every score would be NaN: use a checkpoint whose weights are all finite"
        )


def check_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """ValueError when the tokenizer has ids the model's embedding cannot look up."""
    n_embed = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embed:
        raise ValueError(
            f"{where}: tokenizer has {len(tokenizer)} tokens but the model embeds only {n_embed}; "
            "use the tokenizer saved with this model"
        )


def context_length(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None, setting: int | None = None
) -> int:
    """The model's maximum sequence length (positions): from its config (a multimodal model's ``text_config``
    included), else ``tokenizer``'s ``model_max_length`` unless unbounded, else ``setting`` (the run's
    ``model.max_length``): :func:`covgrad.rollouts.inputs.context_of`.

    Raises ValueError (one line naming ``model.max_length``) when none of them tells it.
    """
    limit = context_of(model.config.to_dict(), getattr(tokenizer, "model_max_length", None), setting)
    if limit is None:
        raise ValueError(no_context(type(model).__name__))
    return limit
