"""Tiny models of the hybrid linear-attention, state-space and MoE families of 2026, with norms, biases and routers
perturbed."""

from __future__ import annotations

import torch
import transformers as T
from torch import nn

from tests.helpers.families import LLAMA_LIKE
from tests.helpers.persample import PAD, V

COMMON = LLAMA_LIKE  # the sizes of the dense family matrix

LINEAR_ATTN = {
    "head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"],
}

MOE = {"moe_intermediate_size": 16, "num_experts_per_tok": 2}

MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}

MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4}


def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move every small parameter (norms, biases, gates, routers, A_log, dt, D, sinks, scales: anything with
    at most one dimension, or a bias, gate or router matrix) away from its init; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    keys = ("norm", "bias", "gate", "router", "sinks", "scale", "altup", "laurel", "A_log", "dt_", "conv")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() <= 1 or any(k in name for k in keys):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


_OVERRIDES: dict[str, object] = {}  # config fields every build takes (family_model)


def build(config_cls: type, model_cls: type, common: bool = True, **extra: object) -> nn.Module:
    torch.manual_seed(0)
    kw = {**COMMON, **extra} if common else {"pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2, **extra}
    kw.update(_OVERRIDES)
    config = config_cls(**kw)
    config._attn_implementation = "eager"
    return perturb(model_cls(config))


FAMILIES = {
    "qwen3.5": lambda: build(T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, **LINEAR_ATTN),
    "qwen3.5-moe": lambda: build(
        T.Qwen3_5MoeTextConfig,
        T.Qwen3_5MoeForCausalLM,
        **LINEAR_ATTN,
        **MOE,
        num_experts=4,
        shared_expert_intermediate_size=16,
    ),
    "qwen3-next": lambda: build(
        T.Qwen3NextConfig,
        T.Qwen3NextForCausalLM,
        **LINEAR_ATTN,
        **MOE,
        num_experts=4,
        shared_expert_intermediate_size=16,
    ),
    "kimi-linear": lambda: build(
        T.KimiLinearConfig,
        T.KimiLinearForCausalLM,
        **MOE,
        **MLA,
        num_local_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "olmo-hybrid": lambda: build(T.OlmoHybridConfig, T.OlmoHybridForCausalLM, **LINEAR_ATTN),
    "mamba2": lambda: build(
        T.Mamba2Config,
        T.Mamba2ForCausalLM,
        common=False,
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=8,
        state_size=8,
        n_groups=1,
        expand=2,
        conv_kernel=4,
        chunk_size=8,
    ),
    "jamba": lambda: build(
        T.JambaConfig,
        T.JambaForCausalLM,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        use_mamba_kernels=False,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    "falcon-h1": lambda: build(
        T.FalconH1Config, T.FalconH1ForCausalLM, **MAMBA, mamba_d_ssm=64, mamba_expand=2, mamba_chunk_size=8, head_dim=8
    ),
    "nemotron-h": lambda: build(
        T.NemotronHConfig,
        T.NemotronHForCausalLM,
        layers_block_type=["mamba", "attention"],
        head_dim=8,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        chunk_size=8,
        use_mamba_kernels=False,
    ),
    "bamba": lambda: build(
        T.BambaConfig, T.BambaForCausalLM, **MAMBA, attn_layer_indices=[1], mamba_expand=2, mamba_chunk_size=8
    ),
    "lfm2": lambda: build(
        T.Lfm2Config, T.Lfm2ForCausalLM, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False
    ),
    "lfm2-moe": lambda: build(
        T.Lfm2MoeConfig,
        T.Lfm2MoeForCausalLM,
        **MOE,
        num_experts=4,
        num_dense_layers=1,
        layer_types=["conv", "full_attention"],
    ),
    "gpt-oss": lambda: build(
        T.GptOssConfig,
        T.GptOssForCausalLM,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "deepseek-v2": lambda: build(
        T.DeepseekV2Config,
        T.DeepseekV2ForCausalLM,
        **MOE,
        **MLA,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
    ),
    "deepseek-v3": lambda: build(
        T.DeepseekV3Config,
        T.DeepseekV3ForCausalLM,
        **MOE,
        **MLA,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
    ),
    "deepseek-v3.2": lambda: build(
        T.DeepseekV32Config,
        T.DeepseekV32ForCausalLM,
        **MOE,
        **MLA,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        index_topk=4,
        index_head_dim=8,
        index_n_heads=2,
    ),
    "glm4-moe": lambda: build(
        T.Glm4MoeConfig,
        T.Glm4MoeForCausalLM,
        **MOE,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "llama4": lambda: build(
        T.Llama4TextConfig,
        T.Llama4ForCausalLM,
        intermediate_size=16,
        intermediate_size_mlp=48,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
    ),
    "minimax": lambda: build(
        T.MiniMaxConfig,
        T.MiniMaxForCausalLM,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        block_size=4,
    ),
    "phimoe": lambda: build(T.PhimoeConfig, T.PhimoeForCausalLM, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": lambda: build(
        T.GraniteMoeConfig, T.GraniteMoeForCausalLM, num_local_experts=4, num_experts_per_tok=2
    ),
    "ernie4.5-moe": lambda: build(
        T.Ernie4_5_MoeConfig,
        T.Ernie4_5_MoeForCausalLM,
        moe_intermediate_size=16,
        moe_k=2,
        moe_num_experts=4,
        moe_num_shared_experts=1,
        moe_layer_start_index=0,
    ),
    "gemma4-moe": lambda: build(
        T.Gemma4TextConfig,
        T.Gemma4ForCausalLM,
        head_dim=8,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
    ),
    "hunyuan-moe": lambda: build(
        T.HunYuanMoEV1Config, T.HunYuanMoEV1ForCausalLM, num_experts=4, moe_topk=2, head_dim=8
    ),
    "gemma3n": lambda: build(
        T.Gemma3nTextConfig,
        T.Gemma3nForCausalLM,
        head_dim=8,
        vocab_size_per_layer_input=V,
        hidden_size_per_layer_input=8,
        laurel_rank=4,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0, 0.0],
    ),
    "recurrent-gemma": lambda: build(
        T.RecurrentGemmaConfig,
        T.RecurrentGemmaForCausalLM,
        common=False,
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=32,
        attention_window_size=8,
        conv1d_width=4,
        block_types=["recurrent", "attention"],
    ),
    "nemotron-h-moe": lambda: build(
        T.NemotronHConfig,
        T.NemotronHForCausalLM,
        layers_block_type=["mamba", "moe", "attention"],
        head_dim=8,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        chunk_size=8,
        use_mamba_kernels=False,
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    ),
}


def family_model(name: str, **overrides: object) -> nn.Module:
    """The tiny ``name`` model of :data:`FAMILIES` with config fields overridden (e.g. ``vocab_size``)."""
    _OVERRIDES.update(overrides)
    try:
        return FAMILIES[name]()
    finally:
        _OVERRIDES.clear()
