"""The family matrix's tiny models: configs of the causal-LM families, with norms, biases and routers moved away from
their init."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from tests.helpers.models import tiny_llama
from tests.helpers.persample import PAD, V

LLAMA_LIKE = {
    "vocab_size": V,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": PAD,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move norms, biases and routers away from their init (1, 0 or 0) so a wrong rule shows; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("norm", ".ln_", "layernorm", "bias", "gate.weight")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def build(config_cls: type, model_cls: type, *, llama_like: bool = True, **extra: object) -> nn.Module:
    torch.manual_seed(0)
    kw = {**LLAMA_LIKE, **extra} if llama_like else {"pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2, **extra}
    return perturb(model_cls(config_cls(**kw)))


def lora_llama() -> nn.Module:
    peft = pytest.importorskip("peft")
    base = tiny_llama(V, intermediate=48, pad_token_id=PAD)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # lora_B starts at 0, which would hide lora_A's gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


FAMILIES = {
    "llama-untied": lambda: perturb(tiny_llama(V, intermediate=48, pad_token_id=PAD)),
    "llama-tied": lambda: perturb(tiny_llama(V, intermediate=48, tied=True, pad_token_id=PAD)),
    "qwen2": lambda: build(T.Qwen2Config, T.Qwen2ForCausalLM, tie_word_embeddings=False),
    "qwen3": lambda: build(T.Qwen3Config, T.Qwen3ForCausalLM, head_dim=8, tie_word_embeddings=True),
    "mistral": lambda: build(T.MistralConfig, T.MistralForCausalLM),
    "gemma": lambda: build(T.GemmaConfig, T.GemmaForCausalLM, head_dim=8),
    "gemma2": lambda: build(T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=8),
    "gemma3": lambda: build(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8, sliding_window=4),
    "phi3": lambda: build(T.Phi3Config, T.Phi3ForCausalLM),
    "olmo2": lambda: build(T.Olmo2Config, T.Olmo2ForCausalLM),
    "granite": lambda: build(T.GraniteConfig, T.GraniteForCausalLM, embedding_multiplier=2.0, logits_scaling=3.0),
    "smollm3": lambda: build(T.SmolLM3Config, T.SmolLM3ForCausalLM, no_rope_layer_interval=2),
    "gpt2": lambda: build(
        T.GPT2Config, T.GPT2LMHeadModel, llama_like=False, vocab_size=V, n_embd=32, n_layer=2, n_head=4
    ),
    "gpt-neox": lambda: build(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, tie_word_embeddings=False),
    "opt": lambda: build(
        T.OPTConfig,
        T.OPTForCausalLM,
        llama_like=False,
        vocab_size=V,
        hidden_size=32,
        ffn_dim=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        init_std=0.2,  # the default 0.02 gives near-uniform attention and q/k gradients near rounding noise
    ),
    "falcon": lambda: build(
        T.FalconConfig,
        T.FalconForCausalLM,
        llama_like=False,
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=True,
        num_kv_heads=2,
        bias=True,
    ),
    "phi": lambda: build(T.PhiConfig, T.PhiForCausalLM, qk_layernorm=True, initializer_range=0.1),
    "stablelm": lambda: build(T.StableLmConfig, T.StableLmForCausalLM, use_qkv_bias=True),
    "qwen3-moe": lambda: build(
        T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ),
    "mixtral": lambda: build(T.MixtralConfig, T.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": lambda: build(T.OlmoeConfig, T.OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2),
    "qwen2-moe-shared-expert": lambda: build(
        T.Qwen2MoeConfig,
        T.Qwen2MoeForCausalLM,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "lora-llama": lora_llama,
}
