"""Per-sample scores from hooks against a naive loop: one unpadded forward + backward per sequence."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from covgrad.layout import ParamLayout, select_parameters
from covgrad.persample import PerSampleGrads, score_logit_grad
from tests.models import tiny_llama

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


BATCH = {"prompt_lens": [3, 5, 2, 4], "resp_lens": [6, 3, 8, 5]}


def naive_scores(model: nn.Module, layout: ParamLayout, batch: dict, tau: float = 1.0, mu=None) -> torch.Tensor:
    """(B, P): per sequence, unpadded forward and torch.autograd.grad of its own objective."""
    params = dict(model.named_parameters())
    ps = [params[e.name] for e in layout.entries]
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


def hook_scores(model, layout, batch, tau=1.0, mu=None, check=True) -> torch.Tensor:
    psg = PerSampleGrads(model, layout, check=check)
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


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_naive_loop(name):
    model = MODELS[name]()
    layout = select_parameters(model)
    batch = make_batch(10, **BATCH)
    got = hook_scores(model, layout, batch, tau=0.7)
    assert got.shape == (4, layout.P) and got.dtype == torch.float32
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch, tau=0.7))
    assert err < 1e-5, (err, where)


def test_tied_weight_is_the_sum_of_both_uses():
    tied = llama(tied=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = llama(tied=False)
    untied.load_state_dict(tied.state_dict())
    batch = make_batch(11, **BATCH)
    lt, lu = select_parameters(tied), select_parameters(untied)
    assert "lm_head.weight" not in lt.names
    st, su = hook_scores(tied, lt, batch), hook_scores(untied, lu, batch)

    def block(layout, S, name):
        e = layout.entry(name)
        return S[:, e.offset : e.offset + e.numel]

    both = block(lt, st, "model.embed_tokens.weight")
    emb, head = block(lu, su, "model.embed_tokens.weight"), block(lu, su, "lm_head.weight")
    torch.testing.assert_close(both, emb + head, rtol=0, atol=1e-6)
    assert float((both - head).norm()) > 0.1 * float(both.norm())


def test_glob_selection_without_embeddings():
    model = llama(tied=False)
    layout = select_parameters(model, ["model.layers.1.*", "lm_head.weight"])
    assert all(n.startswith("model.layers.1.") or n == "lm_head.weight" for n in layout.names)
    batch = make_batch(12, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_only_lm_head_selected():
    model = llama(tied=False)
    layout = select_parameters(model, ["lm_head.weight"])
    batch = make_batch(13, **BATCH)
    err, _ = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5


def test_sampler_centering_with_policy_mu_equals_policy():
    model = llama(tied=False)
    layout = select_parameters(model)
    batch = make_batch(14, **BATCH)
    tau = 1.3
    with torch.no_grad():
        z = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    mu = torch.softmax(z / tau, -1)
    policy = hook_scores(model, layout, batch, tau=tau)
    sampler = hook_scores(model, layout, batch, tau=tau, mu=mu)
    err, where = max_rel_err(layout, sampler, policy)
    assert err < 1e-5, (err, where)


def test_sampler_centering_arbitrary_mu_matches_stop_gradient_autograd():
    model = gpt2()
    layout = select_parameters(model)
    batch = make_batch(15, **BATCH)
    mu = torch.distributions.Dirichlet(torch.ones(V)).sample(batch["input_ids"].shape)  # (B, L, V)
    got = hook_scores(model, layout, batch, mu=mu)
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch, mu=mu))
    assert err < 1e-5, (err, where)
    # and it is not the policy score (the test can tell the two centerings apart)
    err_policy, _ = max_rel_err(layout, got, naive_scores(model, layout, batch))
    assert err_policy > 1e-2


def test_score_logit_grad_is_logit_gradient_of_objective():
    gen = torch.Generator().manual_seed(5)
    B, L, tau = 3, 7, 0.8
    z = torch.randn(B, L, V, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, L), generator=gen)
    w = (torch.rand(B, L, generator=gen) > 0.4).double()
    w[:, 0] = 0
    w[1, 3] = 0.5
    lp = F.log_softmax(z[:, :-1] / tau, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref,) = torch.autograd.grad((w[:, 1:] * lp).sum(), z)
    got = score_logit_grad(z.detach(), ids, w, temperature=tau)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-6)
    mu = torch.softmax(torch.randn(B, L, V, generator=gen, dtype=torch.float64), -1)
    zs = z[:, :-1] / tau
    obj = (w[:, 1:] * (zs.gather(-1, ids[:, 1:, None])[..., 0] - (mu[:, :-1] * zs).sum(-1))).sum()
    (ref_mu,) = torch.autograd.grad(obj, z)
    got_mu = score_logit_grad(z.detach(), ids, w, mu=mu, temperature=tau)
    np.testing.assert_allclose(got_mu.numpy(), ref_mu.numpy(), atol=1e-6)


def test_score_logit_grad_rejects_bad_input():
    z = torch.randn(2, 4, V)
    ids = torch.randint(0, V, (2, 4))
    w = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"target_mask\[:, 0\]"):
        score_logit_grad(z, ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match="temperature"):
        score_logit_grad(z, ids, w, temperature=0.0)
    with pytest.raises(ValueError, match="mu"):
        score_logit_grad(z, ids, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1.0]]), mu=torch.ones(2, 4, V))
    with pytest.raises(ValueError, match="input_ids"):
        score_logit_grad(z, ids + V, w)


class ScaleNorm(nn.Module):
    """A norm-like module that owns a parameter and wraps a parametrised submodule: its own parameter takes
    the generic path (its forward replayed per sample), the submodule's keeps the Linear rule."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.inner = nn.Linear(weight.numel(), weight.numel(), bias=False)

    def forward(self, x):
        return self.inner(x) * self.weight


def test_parameter_of_a_module_with_parametrised_submodules_is_exact():
    model = llama(tied=False)
    model.model.norm = ScaleNorm(model.model.norm.weight.detach()).eval()
    layout = select_parameters(model)
    batch = make_batch(15, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_every_unsupported_parameter_named_in_one_refusal():
    model = llama(tied=False)
    model.logit_scale = nn.Parameter(torch.ones(()))  # owned by the top-level module
    model.model.embed_tokens.max_norm = 1.0  # renormalises rows in place: no per-sample rule
    with pytest.raises(ValueError) as info:
        PerSampleGrads(model, select_parameters(model))
    msg = str(info.value)
    assert "\n" not in msg and "2 selected parameters" in msg
    assert "'logit_scale'" in msg and "'model.embed_tokens.weight'" in msg and "max_norm" in msg
    selection = ast.literal_eval(msg.split("model.params = ")[1])
    layout = select_parameters(model, selection)
    assert set(layout.names) == set(select_parameters(model).names) - {"logit_scale", "model.embed_tokens.weight"}
    assert "model.layers.*.mlp.up_proj.weight" in selection
    PerSampleGrads(model, layout)


def doubled_up_proj(model: nn.Module) -> nn.Module:
    """Replace layer 0's up_proj by an nn.Linear whose forward uses 2·W: the Linear rule applies by class
    but is wrong by a factor 2 (only the self-check can tell)."""
    old = model.model.layers[0].mlp.up_proj
    new = nn.Linear(old.in_features, old.out_features, bias=False).eval()
    new.weight = old.weight
    new.forward = lambda x: F.linear(x, 2 * new.weight)
    model.model.layers[0].mlp.up_proj = new
    return model


def test_self_check_catches_rule_mismatch():
    model = doubled_up_proj(llama(tied=False))
    layout = select_parameters(model)
    batch = make_batch(16, **BATCH)
    with pytest.raises(ValueError, match=r"self-check failed for parameter 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        hook_scores(model, layout, batch)
    hook_scores(model, layout, batch, check=False)  # unchecked runs, silently wrong by design


def test_leaves_no_grad_restores_flags_and_repeats():
    model = llama(tied=True)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    layout = select_parameters(model)
    batch = make_batch(17, **BATCH)
    psg = PerSampleGrads(model, layout)
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    first = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"])
    second = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"])
    assert torch.equal(first, second)
    assert all(p.grad is None for p in model.parameters())
    assert not model.model.layers[0].mlp.down_proj.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "down_proj" not in n or "layers.1" in n)


def test_training_mode_rejected():
    model = llama(tied=False).train()
    batch = make_batch(18, **BATCH)
    with pytest.raises(ValueError, match="eval"):
        hook_scores(model, select_parameters(model), batch)


def test_bf16_model_close_to_fp32():
    model = llama(tied=False)
    layout = select_parameters(model)
    batch = make_batch(19, **BATCH)
    ref = hook_scores(model, layout, batch)
    got = hook_scores(model.to(torch.bfloat16), layout, batch)
    assert got.dtype == torch.float32
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-2, rel


def test_broadcast_position_ids_rejected_with_a_hint():
    model = gpt2()
    batch = make_batch(20, **BATCH)
    with pytest.raises(ValueError, match="position_ids"):
        PerSampleGrads(model, select_parameters(model))(
            batch["input_ids"],
            batch["attention_mask"],
            lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"]),
        )


def test_out_buffer_is_filled_and_checked():
    model = llama(tied=True)
    layout = select_parameters(model)
    batch = make_batch(21, **BATCH)
    psg = PerSampleGrads(model, layout)
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    fresh = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"])
    out = torch.full((4, layout.P), float("nan"))
    got = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"], out=out)
    assert got is out and torch.equal(out, fresh)
    with pytest.raises(ValueError, match="out must be"):
        psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"], out=torch.empty(4, layout.P + 1))
