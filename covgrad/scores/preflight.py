"""Per-sample machinery checked against a model before any stage runs.

Two steps, seconds in all, so that an unsupported module or a rule that does not match its module's
forward is reported before rollouts are sampled:

1. the full architecture on the meta device (no memory, no weights): every selected parameter must have a
   per-sample path (:class:`covgrad.scores.engine.PerSampleGrads` names every parameter without one at once,
   with a ``model.params`` selection that runs);
2. the same architecture cut to at most two layers and a vocabulary of at most 512 tokens (the embedding and
   LM-head rules do not depend on the row count; a cut copy that fails or refuses is run again at the full
   vocabulary, whose result stands), randomly initialised on the CPU in float32, runs
   one checked per-sample pass on a two-sample, left-padded batch: the parameters of every module type
   selected in step 1 go through their rules, the trace of where each parameter is used and whether the
   modules keep the samples apart, and the self-check (Σ_n s_n against the batched gradient, every
   selected tensor; a sample's rows against its own gradient, and the whole model's separation of the two
   samples, whose failure refuses every tensor upstream of where they mix). This step always runs, whatever
   ``model.self_check`` says: a parameter that no rule reaches would otherwise be served as rows of zeros.

A parameter refused in step 1 does not stop step 2, which runs the other ones: one refusal names every
parameter either step refuses, with a ``model.params`` selection of the full model without them.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from covgrad.layout import ParamLayout, select_parameters
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import generic_rule
from covgrad.scores.tracing import RefusalError

_LAYERS = 2
_VOCAB = 512


def _reduced(config: PretrainedConfig, layers: int, vocab: int | None = None) -> PretrainedConfig:
    """A copy of ``config`` with at most ``layers`` decoder layers (per-layer lists cut to match) and, given
    ``vocab``, at most that many tokens (a pad id beyond it moved to the last one)."""
    config = config.__class__.from_dict(config.to_dict())
    text = config.get_text_config()
    size = getattr(text, "vocab_size", None)
    if vocab is not None and isinstance(size, int) and size > vocab:
        text.vocab_size = vocab
        if isinstance(getattr(text, "pad_token_id", None), int) and text.pad_token_id >= vocab:
            text.pad_token_id = vocab - 1
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


def check_model(
    path: str,
    params: list[str] | None,
    trust_remote_code: bool = False,
    self_check: bool = True,
    vocab: int | None = _VOCAB,
) -> str:
    """Raise ValueError (one line, naming every unsupported parameter and module type) unless per-sample
    scores of the model at ``path`` with the parameter selection ``params`` (globs, None = all trainable)
    are supported; return a one-line summary of the parameters that take the generic path.

    The refusals of both steps are named together, with one ``model.params`` selection of the full model
    without them: a parameter refused in the random copy refuses every parameter of the full model with its name
    up to the layer index (every layer of that kind).

    Args:
        path: a Hugging Face model directory (only its config is read).
        params: the ``model.params`` selection.
        trust_remote_code: as for loading the model.
        self_check: the run's ``model.self_check``; step 2 runs either way (see the module docstring).
        vocab: the random copy's vocabulary at most (step 2); None: the model's own.

    Returns:
        e.g. "generic path: 6 of 20 tensors, 0.4% of P (…); each replays its module's forward per sample".
    """
    del self_check  # the checked pass on the random copy runs whatever the run's own self-check is
    config, full = meta_model(path, trust_remote_code)
    layout = select_parameters(full, params)
    refused: dict[str, str] = {}
    try:
        PerSampleGrads(full, layout, check=False)
    except RefusalError as exc:
        refused.update(exc.reasons)
    except ValueError as exc:
        raise ValueError(f"preflight ({path}): {exc}") from None
    wanted = _selected_types(full, set(layout.names) - set(refused))
    cut = (getattr(config.get_text_config(), "num_hidden_layers", None) or 0) > _LAYERS
    psg = None
    if wanted:
        try:
            psg = _checked_copy(config, wanted, trust_remote_code, set(layout.names) - set(refused), cut, vocab)
        except RefusalError as exc:
            refused.update(_across_layers(exc.reasons, layout, cut))
        except ValueError as exc:
            raise ValueError(f"preflight ({path}, {_LAYERS}-layer random copy): {exc}") from None
    if refused or psg is None:
        raise ValueError(f"preflight ({path}): {RefusalError(layout, list(refused.items()))}")
    return generic_summary(psg, layout)


def _checked_copy(
    config: PretrainedConfig,
    wanted: set[tuple[type, str]],
    trust_remote_code: bool,
    selected: set[str],
    cut: bool,
    vocab: int | None = _VOCAB,
) -> PerSampleGrads:
    """Step 2: the architecture cut to ``_LAYERS`` layers and ``vocab`` tokens (run again at the full vocabulary,
    whose result stands, when that copy fails or refuses), randomly initialised in float32, with the parameters
    of the ``wanted`` (module type, local name) kinds selected, through one checked per-sample pass of a
    two-sample, left-padded batch; returns the engine.

    Of each kind, the copy selects the full model's ``selected`` names: the same ones when it is the whole
    architecture (not ``cut``), else those with the same name up to the layer index, and every one of a kind none
    of whose names match: a tensor upstream of a place where the samples mix is refused for itself, not its kind.

    Raises:
        RefusalError: naming the copy's parameters without an exact per-sample gradient.
        ValueError: the self-check's mismatch, or a crash in a module's forward or a rule, in one line.
    """
    cut_vocab = _reduced(config, _LAYERS, vocab)
    if cut_vocab.get_text_config().vocab_size != config.get_text_config().vocab_size:
        try:
            return _copy_pass(cut_vocab, wanted, trust_remote_code, selected, cut)
        except Exception:  # a refusal, or e.g. a second table sized by the vocabulary: the full one decides
            pass
    return _copy_pass(_reduced(config, _LAYERS), wanted, trust_remote_code, selected, cut)


def _copy_pass(
    config: PretrainedConfig, wanted: set[tuple[type, str]], trust_remote_code: bool, selected: set[str], cut: bool
) -> PerSampleGrads:
    """:func:`_checked_copy` on the reduced ``config``."""
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32).eval()
    kinds = {
        f"{mn}.{pn}" if mn else pn: (type(m), pn)
        for mn, m in small.named_modules()
        for pn, p in m.named_parameters(recurse=False)
        if (type(m), pn) in wanted and p.requires_grad
    }
    index = re.compile(r"\.\d+\.")
    same = {index.sub(".N.", n) for n in selected} if cut else selected
    matched = [n for n in kinds if (index.sub(".N.", n) if cut else n) in same]
    covered = {kinds[n] for n in matched}
    names = matched + [n for n, kind in kinds.items() if kind not in covered]
    small_layout = select_parameters(small, sorted(set(names) & set(dict(small.named_parameters()))))
    vocab = small.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    target = torch.zeros(2, 6)
    target[:, 3:] = 1.0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    psg = PerSampleGrads(small, small_layout, check=True)
    try:
        psg(ids, mask, lambda z: score_logit_grad(z, ids, target), position_ids=pos)
    except ValueError:  # a refusal or the self-check's mismatch: already one line
        raise
    except Exception as exc:  # a crash inside a module's forward or a rule: one line naming what failed
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"the checked per-sample pass failed ({type(exc).__name__}: {first})") from None
    return psg


def _across_layers(reasons: dict[str, str], layout: ParamLayout, cut: bool = True) -> dict[str, str]:
    """The random copy's refusals (its parameter name → reason) for every parameter of the full selection
    ``layout`` with the same name up to the layer index (the copy's own name when none matches); when the copy was
    not ``cut`` (the full model has at most ``_LAYERS`` layers) for the same name only: the copy is the full
    architecture, and a refusal of the tensors upstream of a layer that mixes samples holds for those alone."""
    index = re.compile(r"\.\d+\.")
    kinds: dict[str, list[str]] = {}
    for name in layout.names:
        kinds.setdefault(index.sub(".N.", name) if cut else name, []).append(name)
    out: dict[str, str] = {}
    for name, reason in reasons.items():
        prefix = f"{name!r}: "
        why = reason[len(prefix) :] if reason.startswith(prefix) else reason
        for full in kinds.get(index.sub(".N.", name) if cut else name, [name]):
            copy = f"the {_LAYERS}-layer random copy" + (f", as {name}" if full != name else "")
            out.setdefault(full, f"{full!r}: {why} (in {copy})")
    return out


def generic_summary(psg: PerSampleGrads, layout: ParamLayout) -> str:
    """One line: the parameters of ``layout`` (the full model's selection) that take the generic path in the
    checked copy ``psg`` (a per-sample replay of their module's forward, about one forward and backward of
    that module per sample, vectorised where torch.func can), matched across layers by name, and their
    share of the tensors and of P."""
    index = re.compile(r"\.\d+\.")
    kinds = {
        index.sub(".N.", e.name) for _, rule, local in psg.bindings() if rule is generic_rule for e in local.values()
    }
    generic = [n for n in layout.names if index.sub(".N.", n) in kinds]
    numel = sum(layout.entry(n).numel for n in generic)
    share = 100.0 * numel / max(layout.P, 1)
    listed = ", ".join(sorted(kinds))
    paths = {index.sub(".N.", n): path for n, path in psg.generic_paths().items()}
    replayed = sorted(k for k, path in paths.items() if path == "replay")
    how = (
        "each at the ops that use it (no module replay)"
        if not replayed
        else f"{len(replayed)} of them by a per-sample replay of their module's forward ({', '.join(replayed)}), "
        "the others at the ops that use them"
    )
    return f"generic path: {len(generic)} of {len(layout.names)} tensors, {share:.2g}% of P ({listed or 'none'}); {how}"
