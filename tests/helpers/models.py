"""Tiny random models shared by the tests (built from configs; nothing is downloaded)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    vocab: int,
    *,
    hidden: int = 32,
    intermediate: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 64,
    tied: bool = False,
    seed: int = 0,
    **config: object,
) -> LlamaForCausalLM:
    """A randomly initialised Llama seeded by ``seed``, in eval mode; ``config`` adds LlamaConfig fields."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        **config,
    )
    return LlamaForCausalLM(cfg).eval()
