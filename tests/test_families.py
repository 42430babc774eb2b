"""Family matrix: every selected tensor of every per-sample score of tiny models of the causal-LM families
people post-train today matches a naive one-backward-per-sequence loop (left padding, prompt masks, norms,
biases and routers moved away from their init)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from covgrad.layout import ParamLayout, select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad
from covgrad.rules import _rmsnorm_rule, generic_rule, rule_for
from tests.models import tiny_llama
from tests.test_persample import BATCH, PAD, V, hook_scores, make_batch, max_rel_err, naive_scores

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


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_naive_loop(name):
    model = FAMILIES[name]()
    layout = select_parameters(model)
    if name == "lora-llama":
        assert layout.names and all("lora_" in n for n in layout.names)  # only the adapters are trainable
    batch = make_batch(30, **BATCH)
    got = hook_scores(model, layout, batch, tau=0.8)  # with the self-check
    ref = naive_scores(model, layout, batch, tau=0.8)
    # A tensor whose exact gradient is 0 (OPT's key bias: the softmax ignores a shift shared by all keys;
    # with rotary positions it is not shared) holds rounding noise: compared in absolute terms.
    block = lambda S, e: S[:, e.offset : e.offset + e.numel]  # noqa: E731
    zero = [e for e in layout.entries if float(block(ref, e).norm()) < 1e-6 * float(ref.norm())]
    assert [e.name for e in zero if "k_proj.bias" not in e.name] == []
    for e in zero:
        assert float(block(got, e).norm()) < 1e-6 * float(ref.norm()), e.name
    err, where = max_rel_err(ParamLayout(tuple(e for e in layout.entries if e not in zero)), got, ref)
    assert err < 1e-5, (name, err, where)


def test_norms_use_the_fast_rule_and_subclasses_the_generic_one():
    for name in ("qwen3", "gemma3", "olmo2", "phi3", "granite", "smollm3", "mixtral"):
        model = FAMILIES[name]()
        norms = [m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(rule_for(m)[0] is _rmsnorm_rule for m in norms), name
    gemma = FAMILIES["gemma3"]()
    assert type(gemma.model.embed_tokens).__name__ == "Gemma3TextScaledWordEmbedding"
    assert rule_for(gemma.model.embed_tokens)[0] is generic_rule


class Flattener(nn.Module):
    """Runs a Linear on a (B·L, H) view, like OPT's layers: row n·L + t is sample n's position t, or with
    ``by_position`` row t·B + n (a correct computation whose rows are not sample by sample)."""

    def __init__(self, inner: nn.Linear, by_position: bool = False) -> None:
        super().__init__()
        self.inner, self.by_position = inner, by_position

    def forward(self, x):
        if self.by_position:
            B, L, H = x.shape
            y = self.inner(x.transpose(0, 1).reshape(-1, H))
            return y.reshape(L, B, -1).transpose(0, 1)
        return self.inner(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def test_flattened_batch_verified_by_a_check_and_exact():
    model = perturb(tiny_llama(V, intermediate=48, pad_token_id=PAD))
    mlp = model.model.layers[0].mlp
    mlp.up_proj = Flattener(mlp.up_proj).eval()
    layout = select_parameters(model)
    batch = make_batch(31, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_flattened_rows_not_sample_by_sample_refused():
    model = perturb(tiny_llama(V, intermediate=48, pad_token_id=PAD))
    mlp = model.model.layers[0].mlp
    mlp.up_proj = Flattener(mlp.up_proj, by_position=True).eval()
    batch = make_batch(31, **BATCH)
    psg = PerSampleGrads(model, select_parameters(model))
    with pytest.raises(ValueError, match=r"up_proj\.inner \(a Linear\) runs on inputs whose leading dimension is not"):
        psg(
            batch["input_ids"],
            batch["attention_mask"],
            lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"]),
            position_ids=batch["position_ids"],
        )


def test_moe_router_alone_selected():
    """Only the routers: their outputs are graph roots (nothing upstream is hooked)."""
    model = FAMILIES["qwen3-moe"]()
    layout = select_parameters(model, ["*.mlp.gate.weight"])
    assert len(layout.names) == 2
    batch = make_batch(32, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
