"""The family matrix: every tiny causal-LM family the tests build from transformers' own configs, by name, in one
place (the dense families of :mod:`tests.helpers.families`, the hybrid, state-space and MoE families of
:mod:`tests.helpers.families_hybrid`, and the families below), with the families whose padded batch is another
function than its sequences alone and the families refused as a whole. ``benchmarks.families --suite matrix`` times
every one of them."""

from __future__ import annotations

from collections.abc import Callable

import transformers as T
from torch import nn

from tests.helpers.families import FAMILIES as DENSE
from tests.helpers.families_hybrid import FAMILIES as HYBRID
from tests.helpers.families_hybrid import MAMBA, MLA, MOE, build

# Families of the same kinds that the issue did not list.
EXTRA = {
    "afmoe": lambda: build(
        T.AfmoeConfig,
        T.AfmoeForCausalLM,
        **MOE,
        num_experts=4,
        num_shared_experts=1,
        num_dense_layers=1,
        head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "dots1": lambda: build(
        T.Dots1Config,
        T.Dots1ForCausalLM,
        **MOE,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        head_dim=8,
    ),
    "granitemoe-hybrid": lambda: build(
        T.GraniteMoeHybridConfig,
        T.GraniteMoeHybridForCausalLM,
        **MAMBA,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=16,
        layer_types=["mamba", "attention"],
        mamba_expand=2,
        mamba_chunk_size=8,
    ),
    "granitemoe-shared": lambda: build(
        T.GraniteMoeSharedConfig,
        T.GraniteMoeSharedForCausalLM,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=16,
    ),
    "glm4-moe-lite": lambda: build(
        T.Glm4MoeLiteConfig,
        T.Glm4MoeLiteForCausalLM,
        **MOE,
        **MLA,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "exaone-moe": lambda: build(
        T.ExaoneMoeConfig,
        T.ExaoneMoeForCausalLM,
        **MOE,
        num_experts=4,
        num_shared_experts=1,
        head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "zamba2": lambda: build(
        T.Zamba2Config,
        T.Zamba2ForCausalLM,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        mamba_headdim=8,
        n_mamba_heads=8,
        layers_block_type=["mamba", "hybrid"],
        num_mem_blocks=1,
        attention_head_dim=8,
    ),
    "falcon-mamba": lambda: build(
        T.FalconMambaConfig, T.FalconMambaForCausalLM, state_size=8, expand=2, conv_kernel=4, time_step_rank=4
    ),
    "cohere2-moe": lambda: build(
        T.Cohere2MoeConfig, T.Cohere2MoeForCausalLM, **MOE, num_experts=4, num_local_experts=4, head_dim=8
    ),
    # Nemotron-3-Nano's pattern: Mamba2, sigmoid-routed non-gated (relu²) experts with a shared expert, attention
}

# Families whose output depends on left padding (the padded batch is not the unpadded sequences): compared
# against one backward per padded row instead.
PADDING_SENSITIVE = {
    "deepseek-v3.2",  # the indexer's top-k keys count the padding positions
    "recurrent-gemma",  # the RG-LRU's recurrence and its short conv run over the left padding
}

# Every family of the matrix is exact on the default paths. Families that the module replay alone (op_taps=False)
# cannot take whole, with the refusal each gets there (the parameters it names; the selection it proposes runs and
# is exact on that path too).
REPLAY_REFUSED = {
    # AltUp's correct_output_scale is applied by the decoder layer to (altup inputs, B, L, H) stacks: only the op
    # taps check its rows per op
    "gemma3n": r"altup\.correct_output_scale'.*a Gemma3nTextDecoderLayer\) runs on inputs whose batch is dimension 1",
}


# Every family of the matrix: the dense ones, then the hybrid, state-space and MoE ones.
MATRIX: dict[str, Callable[[], nn.Module]] = {**DENSE, **HYBRID, **EXTRA}
