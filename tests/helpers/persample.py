"""Per-sample score references and builders: tiny models of several families, padded batches, the naive one-backward-
per-sequence loop and the hooked scores it is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from covgrad.layout import ParamLayout
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.models import tiny_llama

V = 32

PAD = 0


def _perturb_norms(model: nn.Module, seed: int) -> nn.Module:
    """Move norm weights/biases away from their init (1 and 0) so a wrong norm rule shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def llama(tied: bool) -> nn.Module:
    model = tiny_llama(V, intermediate=48, tied=tied, pad_token_id=PAD)
    return _perturb_norms(model, 1)


def _small(config_cls: type, model_cls: type, **extra: object) -> nn.Module:
    """A 2-layer, hidden-32 model of the Llama-like family ``config_cls``/``model_cls``, seeded."""
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    return model_cls(cfg)


def qwen2() -> nn.Module:
    model = _small(Qwen2Config, Qwen2ForCausalLM, tie_word_embeddings=False)
    with torch.no_grad():  # biases start at 0; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return _perturb_norms(model, 2)


def mistral() -> nn.Module:
    return _perturb_norms(_small(MistralConfig, MistralForCausalLM), 5)


def llama_torch_rmsnorm() -> nn.Module:
    """Llama with every LlamaRMSNorm swapped for torch.nn.RMSNorm (same weights and eps)."""
    model = llama(tied=False)
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            norm = nn.RMSNorm(module.weight.shape[0], eps=module.variance_epsilon)
            with torch.no_grad():
                norm.weight.copy_(module.weight)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, norm)
    assert any(isinstance(m, nn.RMSNorm) for m in model.modules())
    return model.eval()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return _perturb_norms(
        GPT2LMHeadModel(
            GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
        ),
        3,
    )


def neox() -> nn.Module:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return _perturb_norms(GPTNeoXForCausalLM(cfg), 4)


MODELS = {
    "llama-untied": lambda: llama(tied=False),
    "llama-tied": lambda: llama(tied=True),
    "llama-torch-rmsnorm": llama_torch_rmsnorm,
    "qwen2-bias": qwen2,
    "mistral": mistral,
    "gpt2-conv1d": gpt2,
    "gpt-neox": neox,
}


def make_batch(seed: int, prompt_lens: list[int], resp_lens: list[int]) -> dict:
    """Left-padded batch; per sample the unpadded ids and response weights for the naive loop."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (p + r,), generator=gen) for p, r in zip(prompt_lens, resp_lens, strict=True)]
    weights = [torch.cat([torch.zeros(p), torch.ones(r)]) for p, r in zip(prompt_lens, resp_lens, strict=True)]
    L = max(len(s) for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, L), PAD, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    target_mask = torch.zeros(B, L)
    for n, (s, w) in enumerate(zip(seqs, weights, strict=True)):
        input_ids[n, L - len(s) :] = s
        attention_mask[n, L - len(s) :] = 1
        target_mask[n, L - len(s) :] = w
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "target_mask": target_mask,
        "position_ids": position_ids,
        "seqs": seqs,
        "weights": weights,
    }


def right_padded(batch: dict) -> dict:
    """The same sequences padded on the right."""
    out = dict(batch)
    ids, mask, target = (torch.zeros_like(batch[k]) for k in ("input_ids", "attention_mask", "target_mask"))
    for n, (s, w) in enumerate(zip(batch["seqs"], batch["weights"], strict=True)):
        ids[n, : len(s)], mask[n, : len(s)], target[n, : len(s)] = s, 1, w
    out.update(input_ids=ids, attention_mask=mask, target_mask=target, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    return out


BATCH = {"prompt_lens": [3, 5, 2, 4], "resp_lens": [6, 3, 8, 5]}


def naive_scores(
    model: nn.Module, layout: ParamLayout, batch: dict, tau: float = 1.0, mu=None, batched: bool = False
) -> torch.Tensor:
    """(B, P): per sequence, unpadded forward and torch.autograd.grad of its own objective. With ``batched``, one
    forward of the padded batch and one backward of each sequence's own objective through it: the reference of a
    model whose logits depend on the batch (one that mixes samples), where a sequence alone is another function."""
    params = dict(model.named_parameters())
    ps = [params[e.name] for e in layout.entries]
    if batched:
        return _batched_naive(model, ps, batch, tau)
    L = batch["input_ids"].shape[1]
    rows = []
    for n, (ids, w) in enumerate(zip(batch["seqs"], batch["weights"], strict=True)):
        z = model(input_ids=ids[None]).logits[0, :-1] / tau  # (Ln-1, V)
        y = ids[1:, None]
        if mu is None:
            token = F.log_softmax(z, -1).gather(-1, y)[:, 0]
        else:
            q = mu[n, L - len(ids) : L - 1]  # sampler rows of the real positions, a constant
            token = z.gather(-1, y)[:, 0] - (q * z).sum(-1)
        grads = torch.autograd.grad((w[1:] * token).sum(), ps, allow_unused=True)
        rows.append(
            torch.cat([torch.zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(ps, grads, strict=True)])
        )
    return torch.stack(rows)


def _batched_naive(model: nn.Module, ps: list[nn.Parameter], batch: dict, tau: float) -> torch.Tensor:
    """(B, P): one forward of the padded batch, then torch.autograd.grad of each sample's own objective."""
    ids = batch["input_ids"]
    kw = {k: batch[k] for k in ("attention_mask", "position_ids")}
    z = model(input_ids=ids, **kw).logits[:, :-1] / tau  # (B, L-1, V)
    token = F.log_softmax(z, -1).gather(-1, ids[:, 1:, None])[..., 0]
    target = batch["target_mask"][:, 1:].to(token.dtype)
    objective = torch.where(target > 0, target * token, torch.zeros_like(token)).sum(1)  # (B,)
    rows = []
    for n in range(ids.shape[0]):
        grads = torch.autograd.grad(objective[n], ps, allow_unused=True, retain_graph=True)
        rows.append(
            torch.cat([torch.zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(ps, grads, strict=True)])
        )
    return torch.stack(rows)


def hook_scores(model, layout, batch, tau=1.0, mu=None, check=True, op_taps=True) -> torch.Tensor:
    psg = PerSampleGrads(model, layout, check=check, op_taps=op_taps)
    return psg(
        batch["input_ids"],
        batch["attention_mask"],
        lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"], mu=mu, temperature=tau),
        position_ids=batch["position_ids"],
    )


def max_rel_err(layout: ParamLayout, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    """Largest ‖got − ref‖ / ‖ref‖ over tensors (each over its whole (B, numel) block)."""
    worst = (0.0, "")
    for e in layout.entries:
        a = got[:, e.offset : e.offset + e.numel].double()
        b = ref[:, e.offset : e.offset + e.numel].double()
        assert b.norm() > 0, e.name
        err = float((a - b).norm() / b.norm())
        worst = max(worst, (err, e.name))
    return worst


def doubled_up_proj(model: nn.Module) -> nn.Module:
    """Replace layer 0's up_proj by an nn.Linear whose forward uses 2·W: the Linear rule applies by class
    but is wrong by a factor 2 (only the self-check can tell)."""
    old = model.model.layers[0].mlp.up_proj
    new = nn.Linear(old.in_features, old.out_features, bias=False).eval()
    new.weight = old.weight
    new.forward = lambda x: F.linear(x, 2 * new.weight)
    model.model.layers[0].mlp.up_proj = new
    return model


# Tiny models that mix the samples of a batch (remote code, as a user's custom architecture would be; the same
# source builds them in tests): the Llama MLP of layer 1 mixes after its gate and up projections, Mixtral's router of
# layer 1 views its logits as (2, B·L, E/2) over the flattened batch and averages the two halves, or the input
# embeddings are mixed right after the embedding.
MIXING_MODELING = """
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter


class MixingMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h + 0.5 * h.roll(1, 0))


class MixingRouter(MixtralTopKRouter):
    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        T = logits.shape[0]
        logits = logits + logits.view(2, T, -1).mean(0, keepdim=True).expand(2, T, -1).reshape(T, -1)
        top, index = torch.topk(logits.float().softmax(-1), self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index


class MixingEmbedding(nn.Module):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    @property
    def weight(self):
        return self.embed.weight

    @property
    def num_embeddings(self):
        return self.embed.num_embeddings

    def forward(self, ids):
        e = self.embed(ids)
        return e + 0.5 * e.roll(1, 0)


class MixLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        if config.mix_at == "mlp":
            self.model.layers[1].mlp = MixingMLP(self.model.layers[1].mlp)
        else:
            self.model.embed_tokens = MixingEmbedding(self.model.embed_tokens)


class MixMixtralForCausalLM(MixtralForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        moe = self.model.layers[1].mlp
        router = MixingRouter(config)
        router.weight = moe.gate.weight
        moe.gate = router
"""

_MIXING: dict = {}  # the classes of MIXING_MODELING, once built (mixing_model)

MIXING_CLASSES = {"mlp": "MixLlamaForCausalLM", "router": "MixMixtralForCausalLM", "embedding": "MixLlamaForCausalLM"}


def mixing_config(plant: str, tied: bool = False) -> object:
    """The config of the ``plant`` model (``mix_at``: "mlp", "router" or "embedding"): a 2-layer, hidden-32 Llama,
    or Mixtral with 4 experts, 2 per token (eager experts: the float64 reference has no grouped_mm)."""
    shape = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    shape |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    shape |= {"pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": tied}
    if plant == "router":
        config = MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2, mix_at=plant)
        config._experts_implementation = "eager"
        return config
    return LlamaConfig(**shape, mix_at=plant)


def mixing_model(plant: str, tied: bool = False) -> nn.Module:
    """The ``plant`` model of :data:`MIXING_MODELING`, seeded, its norms and router moved from their init."""
    if not _MIXING:
        exec(MIXING_MODELING, _MIXING)  # the source model directories are given
    torch.manual_seed(0)
    model = _MIXING[MIXING_CLASSES[plant]](mixing_config(plant, tied))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".gate." in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()
