"""Cost of per-sample scores on today's architectures, and of the generic rule against the fast path.

``--suite arch`` (default): a Qwen3.5-shaped hybrid (three Gated DeltaNet layers to one full-attention
layer; dt_bias, A_log, the short conv and the gated norm on the generic path) and a DeepSeek-V3-style MoE
(MLA attention, sigmoid router with group top-k and a correction bias, shared expert, first layer dense),
every parameter selected (the generic-path parameters by the op-level path of :mod:`covgrad.scores.optaps`, and
again by the module replay), and again without the generic-path parameters (what their path costs). Each
repetition times, interleaved after one warm-up, the floor (one forward and one batched backward of the
summed objective with every parameter requiring grad: the ordinary training gradient) and the fused
per-sample reduction (``PerSampleGrads.accumulate`` into a float64 :class:`covgrad.moments.accum.MomentAccumulator`,
self-check off), in process CPU time by default (``--clock wall``: wall time; on a shared machine other
jobs' load enters wall time, not the process's own CPU time); the median ratio is reported (goal ≤ 1.5 with
everything selected). ``--fold compiled`` (default): the compiled fold, which a run uses once samples × P
reaches ``covgrad.moments.accum._COMPILE_AFTER``; ``--fold eager``: the eager fold of a short run's batches.

``--suite matrix``: every family of the test matrix (:data:`tests.families.matrix.MATRIX`, the tests' own tiny
models: 2 layers, hidden 32, vocabulary 32), the floor and the fused per-sample reduction as above, timed
interleaved in one process at B 16 × L 48 and at B 16 × ``--length``; one table row per family with both
ratios and the share of its parameters on each path (fast rules, the fused or dense experts rules, the
routed-experts rule of experts recognised by structure, the op-level path, the module replay). A family refused
as a whole is timed on the selection its refusal proposes (the floor still with every parameter). ``--families``
names a few.

``--suite closed``: per family of the matrix whose op-level uses have a closed form other than the elementwise
ones, the ratio with those closed forms and without them (the vmapped vjp), interleaved in one process.

``--suite node``: per family of the matrix with fused or dense experts (and the arch MoE), the ratio with each such
experts module run as one autograd node in the pass and with the class's forward, interleaved in one process.

``--suite norms``: the same Llama with its RMSNorms on the generic rule (torch.func vmap of each norm's own
vector-Jacobian product, via a subclass whose forward is the same math written differently) against the
specialised RMSNorm rule; the median ratio generic / specialised (goal ≤ 1.1) and the score difference.

    python -m benchmarks.families --threads 1     # a few minutes on a CPU
    python -m benchmarks.families --clock wall    # wall time, torch's threads
    python -m benchmarks.families --suite norms --reps 3
    OMP_NUM_THREADS=1 python -m benchmarks.families --suite matrix --threads 1 --reps 3
    OMP_NUM_THREADS=1 python -m benchmarks.families --suite closed --threads 1 --reps 9
    OMP_NUM_THREADS=1 python -m benchmarks.families --suite node --threads 1 --reps 9
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from collections.abc import Callable

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
import transformers as T
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from benchmarks.tokens import build as perturbed_llama
from covgrad.layout import select_parameters
from covgrad.moments import MomentAccumulator
from covgrad.scores import PerSampleGrads, generic_rule, opgrads, rmsnorm_rule, rule_for, score_logit_grad
from covgrad.scores import experts as score_experts
from covgrad.scores.dense_experts import _dense_experts_rule
from covgrad.scores.mlp_experts import _mlp_experts_rule


class RewrittenRMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm's math in a different forward: not a verified norm, so it gets the generic rule."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        h = hidden_states.to(torch.float32)
        h = h * (h.square().mean(-1, keepdim=True) + self.variance_epsilon).rsqrt()
        return self.weight * h.to(hidden_states.dtype)


def build(generic_norms: bool) -> nn.Module:
    """A 4-layer, hidden-256 Llama (vocab 512), norms perturbed; optionally with rewritten norms."""
    model = perturbed_llama(512, 256, 640, 4, 4, 4, tied=False)
    if generic_norms:
        for name, m in list(model.named_modules()):
            if type(m) is LlamaRMSNorm:
                new = RewrittenRMSNorm(m.weight.shape[0], m.variance_epsilon)
                new.weight = m.weight
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
    return model.eval()


def arch_model(name: str, vocab: int = 512) -> nn.Module:
    """A 4-layer, hidden-256 random model of ``name`` ("qwen3.5-hybrid" or "deepseek-v3-moe"), every small
    parameter (norms, biases, gates, routers, A_log, dt) moved off its init, eval mode, eager attention."""
    torch.manual_seed(0)
    common = {
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if name == "qwen3.5-hybrid":
        config = T.Qwen3_5TextConfig(
            **common,
            num_key_value_heads=2,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        )
        cls = T.Qwen3_5ForCausalLM
    elif name == "deepseek-v3-moe":
        config = T.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            moe_intermediate_size=128,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=64,
            q_lora_rank=96,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
        )
        cls = T.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}")
    config._attn_implementation = "eager"
    model = cls(config)
    gen = torch.Generator().manual_seed(1)
    keys = ("norm", "bias", "gate", "A_log", "dt_")
    with torch.no_grad():
        for pn, p in model.named_parameters():
            if p.dim() <= 1 or any(k in pn for k in keys):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def batched_backward(model: nn.Module, ids: Tensor, attn: Tensor, pos: Tensor, target: Tensor) -> None:
    """The floor: one forward and one batched backward of the summed objective (every parameter's .grad)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    logits.backward(score_logit_grad(logits.detach(), ids, target).to(logits.dtype))


class _Timer:
    """Process CPU time spent in a pass's per-sample rules and fold, measured in a pass of its own (:meth:`parts`),
    so that the wrappers' own cost never enters the timed pass of the ratio."""

    def __init__(self, clock: Callable[[], float], psg: PerSampleGrads, acc: MomentAccumulator) -> None:
        self.clock, self.psg, self.acc, self.spent = clock, psg, acc, {}

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + self.clock() - t

        return timed

    def parts(self, batch: tuple) -> tuple[float, float]:
        """One more fused reduction of ``batch`` with the rules and the fold wrapped: seconds in the rules (the
        fold's excluded; folds run inside the rules' calls) and in the fold."""
        _, attn, pos, _, fn, adv, half = batch
        blocks, self.spent = self.psg._blocks, {}
        self.acc.fold = self.wrap("fold", self.acc.fold)
        blocks.run_rule = self.wrap("rules", blocks.run_rule)
        try:
            self.psg.accumulate(batch[0], attn, fn, self.acc, adv, half, pos)
        finally:
            del self.acc.fold, blocks.run_rule  # the class's methods again
        fold = self.spent.get("fold", 0.0)
        return self.spent.get("rules", 0.0) - fold, fold


def _side_by_side(
    clock: Callable[[], float], timer: _Timer, model: nn.Module, batch: tuple
) -> tuple[float, float, tuple[float, float]]:
    """One repetition: the floor (a batched backward), then the fused per-sample reduction, unwrapped; seconds of
    each, and the (rules, fold) seconds of one more, wrapped reduction (:meth:`_Timer.parts`)."""
    ids, attn, pos, target, fn, adv, half = batch
    psg, acc = timer.psg, timer.acc
    t = clock()
    batched_backward(model, ids, attn, pos, target)
    floor = clock() - t
    model.zero_grad(set_to_none=True)
    t = clock()
    psg.accumulate(ids, attn, fn, acc, adv, half, pos)
    ours = clock() - t
    return floor, ours, timer.parts(batch)


def run_arch(args: argparse.Namespace) -> None:
    B, L = args.batch, args.length
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (B, L), generator=gen)
    attn = torch.ones(B, L, dtype=torch.long)
    attn[1::2, : L // 4] = 0  # every other sample left-padded by a quarter
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    target = torch.zeros(B, L)
    target[:, L // 2 :] = 1.0
    fn = lambda z: score_logit_grad(z, ids, target)  # noqa: E731
    adv, half = np.linspace(-1.0, 1.0, B), np.arange(B) % 2
    compiled = args.fold == "compiled"
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"B={B}, L={L}, reps={args.reps}, threads={torch.get_num_threads()}, torch {torch.__version__}, "
        f"clock={args.clock}, fold={args.fold}"
    )
    # per model: every parameter with the op-level path (covgrad.scores.optaps), with the module replay, and without
    # the generic-path parameters; all of one model's rows timed interleaved, repetition by repetition
    variants = (("", True, True), (" replay", True, False), (" -generic", False, True))
    print(
        f"{'model':26s} {'P':>10s} {'generic P':>10s} {'floor s':>8s} {'scores s':>9s} {'ratio':>6s} "
        f"{'rules s':>8s} {'fold s':>7s} {'rest s':>7s}"
    )
    for name in ("qwen3.5-hybrid", "deepseek-v3-moe"):
        model = arch_model(name)
        runs = []
        for suffix, with_generic, taps in variants:
            layout = select_parameters(model)
            psg = PerSampleGrads(model, layout, check=True, op_taps=taps)
            acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=compiled)
            psg.accumulate(ids, attn, fn, acc, adv, half, pos)  # warm-up, with the self-check
            generic = set(psg.generic_paths())
            n_generic = sum(layout.entry(n).numel for n in generic)
            if not with_generic:  # the generic-path parameters deselected: what their per-sample path costs
                layout = select_parameters(model, [n for n in layout.names if n not in generic])
                psg = PerSampleGrads(model, layout, check=True, op_taps=taps)
                acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=compiled)
                psg.accumulate(ids, attn, fn, acc, adv, half, pos)
                n_generic = 0
            paths = sorted(set(psg.generic_paths().values()))
            label = f"{name}{suffix}" + (f" ({'/'.join(paths)})" if paths and with_generic else "")
            if compiled and acc.fold_path != "compiled":
                print(f"  fold: {acc.fold_path}")
            runs.append((label, layout.P, n_generic, psg, acc, _Timer(clock, psg, acc), [], [], []))
        batched_backward(model, ids, attn, pos, target)
        for _ in range(args.reps):
            for *_, timer, floor, ours, parts in runs:
                f, o, part = _side_by_side(clock, timer, model, (ids, attn, pos, target, fn, adv, half))
                floor.append(f)
                ours.append(o)
                parts.append(part)
        for label, P, n_generic, _, _, _, floor, ours, parts in runs:
            ratio = statistics.median([o / f for o, f in zip(ours, floor, strict=True)])
            rules = statistics.median(r for r, _ in parts)
            fold = statistics.median(f for _, f in parts)
            rest = statistics.median(o - r - f for o, (r, f) in zip(ours, parts, strict=True))
            print(
                f"{label:26s} {P:10,d} {n_generic:10,d} {statistics.median(floor):8.3f} "
                f"{statistics.median(ours):9.3f} {ratio:6.2f} {rules:8.3f} {fold:7.3f} {rest:7.3f}"
            )
    print(
        "ratio: median per-repetition scores / floor (goal <= 1.5); replay: generic-path parameters by the module "
        "replay; -generic: generic-path parameters deselected; rules / fold / rest: median CPU s per step in the "
        "per-sample rules (op taps included), in the accumulator's fold, and in the rest (forward, backward)"
    )


def run_norms(args: argparse.Namespace) -> None:
    B, L = args.batch, args.length
    fast, slow = build(False), build(True)
    norms = [m for m in slow.modules() if isinstance(m, LlamaRMSNorm)]
    assert all(rule_for(m)[0] is generic_rule for m in norms)
    assert all(rule_for(m)[0] is rmsnorm_rule for m in fast.modules() if isinstance(m, LlamaRMSNorm))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (B, L), generator=gen)
    attn = torch.ones(B, L, dtype=torch.long)
    target = torch.zeros(B, L)
    target[:, L // 2 :] = 1.0
    pos = torch.arange(L).expand(B, L)
    fn = lambda z: score_logit_grad(z, ids, target)  # noqa: E731
    runs = {}
    for name, model in (("specialised", fast), ("generic", slow)):
        layout = select_parameters(model)
        psg = PerSampleGrads(model, layout, check=False)
        out = torch.empty(B, layout.P)
        runs[name] = (psg, out)
        psg(ids, attn, fn, pos, out=out)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, (psg, out) in runs.items():
            t = time.perf_counter()
            psg(ids, attn, fn, pos, out=out)
            times[name].append(time.perf_counter() - t)
    a, b = runs["specialised"][1], runs["generic"][1]
    rel = float((a.double() - b.double()).norm() / a.double().norm())
    P, n_norm = a.shape[1], sum(m.weight.numel() for m in norms)
    print(f"Llama 4x256, vocab 512, B={B}, L={L}, P={P:,} ({n_norm:,} in {len(norms)} RMSNorms), reps={args.reps}")
    print(f"{'rule for the norms':20s} {'median s':>9s} {'ratio':>6s}")
    base = statistics.median(times["specialised"])
    for name in runs:
        med = statistics.median(times[name])
        print(f"{name:20s} {med:9.3f} {med / base:6.2f}")
    ratios = [g / s for g, s in zip(times["generic"], times["specialised"], strict=True)]
    print(f"median per-repetition ratio generic/specialised: {statistics.median(ratios):.3f} (goal <= 1.1)")
    print(f"scores agree: relative difference {rel:.2e}")


def padded_batch(B: int, L: int, vocab: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ids (B, L) in [1, vocab), a mask (B, L) with every other sample left-padded by a quarter, position ids
    (B, L) and a target mask (B, L) on the second half: the batch every suite times."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, L), generator=gen)
    attn = torch.ones(B, L, dtype=torch.long)
    attn[1::2, : L // 4] = 0
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    target = torch.zeros(B, L)
    target[:, L // 2 :] = 1.0
    return ids, attn, pos, target


def paths_of(psg: PerSampleGrads) -> dict[str, int]:
    """Selected parameter elements per path after a call: "fast" (a per-module rule: Linear, embedding, norm),
    "experts" (the fused-experts rule, Llama 4's dense experts rule or the plain-MLP experts rule), "routed"
    (experts recognised by structure, one widened backward), "op" (the op-level path), "replay" (the module
    replay, also routed experts that failed the probe)."""
    ops = psg.generic_paths()
    taken: dict[str, tuple[str, int]] = {}  # a tensor with two bindings (a tied embedding): its other path
    for module, rule, local in psg.bindings():
        for e in local.values():
            if rule is generic_rule:
                path = ops[e.name]
            elif rule in (score_experts._experts_rule, _dense_experts_rule, _mlp_experts_rule):
                path = "experts"
            elif rule is score_experts._routed_experts_rule:
                path = score_experts.experts_path(module) or "routed"
            else:
                path = "fast"
            if e.name not in taken or path != "fast":
                taken[e.name] = (path, e.numel)
    out: dict[str, int] = {}
    for path, numel in taken.values():
        out[path] = out.get(path, 0) + numel
    return out


def run_matrix(args: argparse.Namespace) -> None:
    """One row per family of the test matrix: floor and fused per-sample reduction at B × 48 and B × length."""
    from tests.families.matrix import MATRIX
    from tests.helpers.persample import V

    names = args.families.split(",") if args.families else list(MATRIX)
    shapes = ((args.batch, 48), (args.batch, args.length))
    compiled = args.fold == "compiled"
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"B={args.batch}, L=48 and {args.length}, reps={args.reps}, threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}, clock={args.clock}, fold={args.fold}"
    )
    head = " | ".join(f"floor ms L{L} | scores ms L{L} | ratio L{L}" for _, L in shapes)
    print(f"| family | P | {head} | rules / fold ms L{shapes[-1][1]} | paths (% of P) |")
    print("|---|---:|" + "---:|---:|---:|" * len(shapes) + "---:|---|")
    worst: list[tuple[float, str]] = []
    for name in names:
        model = MATRIX[name]()
        layout = select_parameters(model)
        note, cells, paths = "", [], {}
        for B, L in shapes:
            ids, attn, pos, target = padded_batch(B, L, V)
            fn = lambda z, ids=ids, target=target: score_logit_grad(z, ids, target)  # noqa: E731
            adv, half = np.linspace(-1.0, 1.0, B), np.arange(B) % 2
            psg = PerSampleGrads(model, layout, check=True)
            acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=compiled)
            try:
                psg.accumulate(ids, attn, fn, acc, adv, half, pos)  # warm-up, with the self-check
            except ValueError as exc:  # refused as a whole: the selection its refusal proposes
                if "model.params = " not in str(exc):
                    raise
                print(f"{name} L{L}: {str(exc).split('; model.params = ')[0]}", file=sys.stderr)
                layout = select_parameters(model, ast.literal_eval(str(exc).split("model.params = ")[1]))
                note = f"; refused: {len(select_parameters(model).names) - len(layout.names)} tensors"
                psg = PerSampleGrads(model, layout, check=True)
                acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=compiled)
                psg.accumulate(ids, attn, fn, acc, adv, half, pos)
            paths = paths_of(psg)
            timer = _Timer(clock, psg, acc)
            batched_backward(model, ids, attn, pos, target)
            floor, ours, parts = [], [], []
            for _ in range(args.reps):
                f, o, part = _side_by_side(clock, timer, model, (ids, attn, pos, target, fn, adv, half))
                floor.append(f)
                ours.append(o)
                parts.append(part)
            ratio = statistics.median([o / f for o, f in zip(ours, floor, strict=True)])
            worst.append((ratio, f"{name} L{L}"))
            cells.append(f"{1e3 * statistics.median(floor):.0f} | {1e3 * statistics.median(ours):.0f} | {ratio:.2f}")
        rules_ms, fold_ms = (1e3 * statistics.median(part) for part in zip(*parts, strict=True))
        cells.append(f"{rules_ms:.0f} / {fold_ms:.0f}")
        share = ", ".join(f"{k} {100 * v / layout.P:.0f}" for k, v in sorted(paths.items(), key=lambda kv: -kv[1]))
        print(f"| {name} | {layout.P:,} | {' | '.join(cells)} | {share}{note} |", flush=True)
    above = sorted((r, n) for r, n in worst if r > 1.5)[::-1]
    worst10 = ", ".join(f"{n} {r:.2f}" for r, n in above[:10])
    print(f"above 1.5: {len(above)} of {len(worst)} (family, length) cells" + (f"; worst: {worst10}" if above else ""))
    print(
        "ratio: median per-repetition scores / floor (goal <= 1.5); rules / fold: median CPU ms per step in the "
        "per-sample rules (op taps included) and in the accumulator's fold (the rest: forward and backward)"
    )


def run_closed(args: argparse.Namespace) -> None:
    """Per family of the test matrix with op-level uses: the floor and the fused per-sample reduction with the
    op-level closed forms (:data:`covgrad.scores.opgrads._CLOSED_FORMS`) and without them (every use's
    per-sample product by the vmapped vjp but the elementwise ones), interleaved repetition by repetition."""
    from tests.families.matrix import MATRIX
    from tests.helpers.persample import V

    names = args.families.split(",") if args.families else list(MATRIX)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    every, elementwise = opgrads._CLOSED_FORMS, (opgrads._elementwise_cots,)
    ids, attn, pos, target = padded_batch(args.batch, args.length, V)
    fn = lambda z: score_logit_grad(z, ids, target)  # noqa: E731
    adv, half = np.linspace(-1.0, 1.0, args.batch), np.arange(args.batch) % 2
    print(f"B={args.batch}, L={args.length}, reps={args.reps}, threads={torch.get_num_threads()}, clock={args.clock}")
    print("| family | op-level % of P | ops now in closed form | ratio, vmapped vjp | ratio, closed forms |")
    print("|---|---:|---|---:|---:|")
    for name in names:
        model = MATRIX[name]()
        layout = select_parameters(model)
        psg = PerSampleGrads(model, layout, check=True)
        acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=args.fold == "compiled")
        taken: set[str] = set()

        def noting(form: Callable, taken: set[str] = taken) -> Callable:
            def run(use: opgrads._Use, g: Tensor, B: int) -> opgrads.Cots | None:
                cots = form(use, g, B)
                if cots is not None:
                    taken.add(use.func.__name__)
                return cots

            return run

        opgrads._CLOSED_FORMS = tuple(noting(f) for f in every)
        try:
            psg.accumulate(ids, attn, fn, acc, adv, half, pos)  # warm-up, with the self-check
        finally:
            opgrads._CLOSED_FORMS = every
        op = paths_of(psg).get("op", 0)
        taken -= {"add", "__add__", "__radd__", "mul", "__mul__", "__rmul__"}
        if not taken:
            continue
        ratios: dict[tuple, list[float]] = {elementwise: [], every: []}
        for _ in range(args.reps):
            for closed in ratios:
                opgrads._CLOSED_FORMS = closed
                try:
                    t = clock()
                    batched_backward(model, ids, attn, pos, target)
                    floor = clock() - t
                    model.zero_grad(set_to_none=True)
                    t = clock()
                    psg.accumulate(ids, attn, fn, acc, adv, half, pos)
                    ratios[closed].append((clock() - t) / floor)
                finally:
                    opgrads._CLOSED_FORMS = every
        off, on = (statistics.median(r) for r in ratios.values())
        print(f"| {name} | {100 * op / layout.P:.1f} | {', '.join(sorted(taken))} | {off:.2f} | {on:.2f} |", flush=True)


def run_node(args: argparse.Namespace) -> None:
    """Per family of the test matrix with fused or dense experts (and the arch suite's DeepSeek-V3-style MoE, hidden
    256, at B 8): the fused per-sample reduction with every such experts module run as one autograd node
    (:func:`covgrad.scores.experts.fused_forward`, :func:`covgrad.scores.dense_experts.dense_forward`, the default)
    and with the class's forward and autograd's backward through it (the rule then recomputes the gate's input and
    ∂a), interleaved repetition by repetition."""
    from tests.families.matrix import MATRIX
    from tests.helpers.persample import V

    names = args.families.split(",") if args.families else [*MATRIX, "deepseek-v3-moe (arch)"]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"B={args.batch} (arch: 8), L={args.length}, reps={args.reps}, threads={torch.get_num_threads()}")
    print("| family | experts % of P | ratio, class forward | ratio, one node | rules ms, class → node |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        arch = name.endswith("(arch)")
        model = arch_model(name.split()[0]) if arch else MATRIX[name]()
        B, vocab = (8, 512) if arch else (args.batch, V)
        ids, attn, pos, target = padded_batch(B, args.length, vocab)
        fn = lambda z, ids=ids, target=target: score_logit_grad(z, ids, target)  # noqa: E731
        adv, half = np.linspace(-1.0, 1.0, B), np.arange(B) % 2
        layout = select_parameters(model)
        runs = []
        for node in (False, True):
            psg = PerSampleGrads(model, layout, check=True)
            if not psg._nodes:
                break
            if not node:
                psg._nodes = []  # the class's forward: autograd's backward through it, the rule's recompute
            acc = MomentAccumulator(layout.P, "cpu", "float64", compiled=args.fold == "compiled")
            psg.accumulate(ids, attn, fn, acc, adv, half, pos)  # warm-up, with the self-check
            runs.append((psg, acc, _Timer(clock, psg, acc), [], []))
        if not runs:
            continue
        share = paths_of(runs[-1][0]).get("experts", 0) / layout.P
        for _ in range(args.reps):
            for _, _, timer, ratios, rules in runs:
                f, o, (r, fold) = _side_by_side(clock, timer, model, (ids, attn, pos, target, fn, adv, half))
                ratios.append(o / f)
                rules.append(r + fold)
        (r0, m0), (r1, m1) = ((statistics.median(r), 1e3 * statistics.median(m)) for *_, r, m in runs)
        print(f"| {name} | {100 * share:.0f} | {r0:.2f} | {r1:.2f} | {m0:.1f} → {m1:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("arch", "norms", "matrix", "closed", "node"), default="arch")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="default: 8 (arch, norms), 16 (matrix)")
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="arch and matrix suites: process CPU time (steady on a shared machine; both threads counted) or wall time",
    )
    parser.add_argument(
        "--fold",
        choices=("compiled", "eager"),
        default="compiled",
        help="arch and matrix suites: the accumulator's fold (compiled: a long run's; eager: a short run's)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--families", default="", help="matrix suite: comma-separated family names (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch is None:
        args.batch = 16 if args.suite in ("matrix", "closed", "node") else 8
    suites = {"arch": run_arch, "norms": run_norms, "matrix": run_matrix, "closed": run_closed, "node": run_node}
    suites[args.suite](args)


if __name__ == "__main__":
    main()
