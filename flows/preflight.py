"""The one preflight: every check of a run's inputs, before any stage, so that bad input fails in one
line with nothing written.

``covgrad-pipeline`` calls :func:`preflight` first, so ``covgrad run`` and ``prefect deployment run``
validate alike; ``covgrad run`` also calls it before Prefect starts (``architecture=False``), so bad
files fail in well under 2 s. The checks themselves live where their layer says: pure checks in
covgrad (``covgrad.rollouts.inputs``, ``covgrad.rollouts.imports.require_mu_source``, ``covgrad.scores.preflight``),
file reading in storage (``storage.models``, ``storage.inputs``, ``storage.readers``, ``storage.stores.prompts``,
``storage.stores.external``); the config's own validators ran when it was built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from covgrad.config import PipelineConfig
from covgrad.rollouts import (
    check_context,
    check_unrewarded,
    convert,
    no_context,
    parse_reward_fields,
    records_to_rollouts,
    rename_fields,
    require_mu_source,
)
from storage.inputs import PolicyRef, check_companion, check_input_file, check_inrun, check_pickle_free, check_series
from storage.models import check_model_dir, model_context, warn_custom_code
from storage.readers import read_located_records, unrewarded
from storage.stores.external import delta_files
from storage.stores.history import read_history
from storage.stores.prompts import load_task, prompt_lengths, prompt_places


def preflight(cfg: PipelineConfig, architecture: bool = True) -> None:
    """Validate everything ``cfg`` points at, in this order: the policy's directory (a model
    ``AutoModelForCausalLM`` builds, with a warning line for one that names custom code ``model.trust_remote_code``
    does not run: ``storage.models.warn_custom_code``; weights that need pickle refused; a context its config, its
    tokenizer or ``model.max_length`` tells: ``storage.models.model_context``), the input files
    (:func:`check_input_files`), every other model directory against the policy (:func:`check_companions`), imported
    rollouts and their μ source (none for a dataset of responses), that a dataset without rewards is not analysed
    and is folded only by sft regimes (``covgrad.rollouts.inputs.check_unrewarded``), the regimes' inputs, the task
    file and its reward (one outside ``covgrad.rewards`` only with ``task.trust_reward_code``), that the prompts fit
    the policy's context with every generating sampler's ``max_new_tokens``, an external run's checkpoints or delta
    trace and its in-run series (:func:`check_external_runs`), with ``architecture`` the in-run series' layout against
    the policy's selected parameters (:func:`check_inrun_layouts`) and (a user model) that per-sample scores support
    every selected parameter (``covgrad.scores.preflight.check_model``: seconds, imports torch).
    Raises ValueError or FileNotFoundError with a one-line message naming the bad value."""
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, "model.path")
        warn_custom_code(cfg.model.path, cfg.model.trust_remote_code)
        check_pickle_free(cfg.model.path, "model.path")
        if model_context(cfg.model.path, cfg.model.max_length) is None:
            raise ValueError(no_context(f"model.path {cfg.model.path!r}"))
    check_input_files(cfg)
    policy = PolicyRef.of(cfg.model.path, cfg.model.demo)
    check_companions(cfg, policy)
    for name, s in cfg.rollouts.samplers.items():
        if s.import_path is not None:
            first = check_first_record(s, _vocab_size(cfg))
            if s.mu_known:
                require_mu_source(f"rollouts.samplers.{name}", first, s.on_policy, s.mu_model)
    check_unrewarded(cfg, unrewarded(cfg))
    if cfg.regimes:  # storage.stores.regimes imports torch (its store layout): only when there are regimes
        from storage.stores.regimes import check_regime_inputs

        check_regime_inputs(cfg)
    problems, _ = load_task(cfg.task)
    generating = {name: s for name, s in cfg.rollouts.samplers.items() if s.import_path is None}
    counted = prompt_lengths(cfg.model.path, problems, cfg.model.max_length) if generating else None
    if counted is not None and counted[1] is not None:  # a user model's context: refused above when untold
        lengths, limit = counted
        where = prompt_places(cfg.task, len(problems))
        for name, s in generating.items():
            check_context(lengths, where, s.max_new_tokens, limit, f"rollouts.samplers.{name}")
    check_external_runs(cfg, policy)
    if architecture and cfg.model.path is None and cfg.model.params is not None:
        check_demo_selection(cfg)
    if architecture:
        check_inrun_layouts(cfg)
    if architecture and (m := cfg.model).path is not None:  # unsupported modules fail in seconds, not after rollouts
        from covgrad.scores import check_model

        check_model(m.path, m.params, m.trust_remote_code, m.self_check)


def check_input_files(cfg: PipelineConfig) -> None:
    """The task's prompt file and every sampler's ``import_path``: each exists and is a regular file, not gzip'd
    (``storage.inputs.check_input_file``)."""
    if cfg.task.kind == "jsonl" and cfg.task.path is not None:
        check_input_file(cfg.task.path, "task.path")
    for name, s in cfg.rollouts.samplers.items():
        if s.import_path is not None:
            check_input_file(s.import_path, f"rollouts.samplers.{name}.import_path")


def check_companions(cfg: PipelineConfig, policy: PolicyRef) -> None:
    """Every model directory a run loads besides the policy: a sampler's ``model`` (with the custom-code warning)
    and ``mu_model``, a regime's ``teacher`` and ``reference``; each a causal LM with the policy's vocabulary size
    and tokenizer, weights that need no pickle (``storage.inputs.check_companion``)."""
    for name, s in cfg.rollouts.samplers.items():
        if s.model not in ("policy", "stale"):
            check_companion(s.model, f"rollouts.samplers.{name}.model", policy)
            warn_custom_code(s.model, cfg.model.trust_remote_code)
        if s.mu_model is not None:
            check_companion(s.mu_model, f"rollouts.samplers.{name}.mu_model", policy)
    for name, r in cfg.regimes.items():
        for role in ("teacher", "reference"):
            path = getattr(r, role)
            if path is not None and path not in ("policy", "stale", "trained"):
                check_companion(path, f"regimes.{name}.{role}", policy)


def check_external_runs(cfg: PipelineConfig, policy: PolicyRef) -> None:
    """With the trajectory stage on, each trajectory's (``trajectory.grid`` cell's) external run: a checkpoint
    series of the policy's architecture and vocabulary (``storage.inputs.check_series``), or a delta trace's folder,
    files and start weights (``storage.stores.external.delta_files``); its logged history, read whole
    (``storage.stores.history.read_history``); its in-run series' index and npz headers
    (``storage.inputs.check_inrun``)."""
    if not cfg.trajectory.enabled:
        return
    cells = cfg.trajectory.cells().values()
    for path in dict.fromkeys(t.checkpoints for t in cells if t.checkpoints is not None):
        check_series(path, "trajectory.checkpoints", policy)
    for path in dict.fromkeys(t.deltas for t in cells if t.deltas is not None):
        delta_files(path)
    for path in dict.fromkeys(t.history for t in cells if t.history is not None):
        read_history(path)
    for path in dict.fromkeys(t.inrun for t in cells if t.inrun is not None):
        check_inrun(path)


def check_inrun_layouts(cfg: PipelineConfig) -> None:
    """With the trajectory stage on, each external run's in-run series (``trajectory.inrun``) against the policy's
    selected parameters (``model.params`` of the policy built on the meta device: its config only, no weights):
    ValueError naming the series' ``inrun.json`` when a selected tensor is missing from it or has another shape."""
    if not cfg.trajectory.enabled:
        return
    paths = list(dict.fromkeys(t.inrun for t in cfg.trajectory.cells().values() if t.inrun is not None))
    if not paths:
        return
    import torch

    from covgrad.layout import select_parameters

    if cfg.model.path is None:
        from covgrad.models import build_demo_model
        from covgrad.rollouts import build_char_tokenizer

        with torch.device("meta"):
            model = build_demo_model(cfg.model.demo, build_char_tokenizer())
    else:
        from covgrad.scores.preflight import meta_model

        model = meta_model(cfg.model.path, cfg.model.trust_remote_code)[1]
    layout = select_parameters(model, cfg.model.params)
    for path in paths:
        check_inrun(path, layout)


def check_demo_selection(cfg: PipelineConfig) -> None:
    """ValueError naming ``model.params`` when a pattern matches no parameter of the demo model (built on the meta
    device, so before its training, not after it)."""
    import torch

    from covgrad.layout import select_parameters
    from covgrad.models import build_demo_model
    from covgrad.rollouts import build_char_tokenizer

    with torch.device("meta"):
        model = build_demo_model(cfg.model.demo, build_char_tokenizer())
    try:
        select_parameters(model, cfg.model.params)
    except ValueError as err:
        raise ValueError(f"model.params: {err}") from None


def _vocab_size(cfg: PipelineConfig) -> int:
    """The policy's vocabulary size from its config.json (a multimodal model's ``text_config``'s); unbounded (the
    stage checks ids) when it does not say or for the demo, whose tokenizer is not built here (the preflight stays
    fast)."""
    if cfg.model.path is not None:
        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
        for section in (config, config.get("text_config") or {}):
            if isinstance(v := section.get("vocab_size"), int):
                return v
    return 2**62


class _TextProbe:
    """Stands in for the tokenizer in :func:`check_first_record`: one token (id 0) per character, so that an
    empty response text fails here as it will in the stage."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens
        return [0] * len(text)


def check_first_record(s: Any, vocab_size: int) -> dict:
    """The first record of a sampler's ``import_path`` converted from its ``format`` and validated as the
    rollouts stage will (without the tokenizer: a text prompt is checked to be text, a text response to be
    non-empty text), as covgrad's record.
    Raises ValueError: one line naming ``file:line`` and the stack's field."""
    at, rec = next(iter(read_located_records(s.import_path)))
    options = parse_reward_fields(s.reward_fields) if s.reward_fields else {}
    out, _ = convert(s.format, rec, at, options)
    probe = dict(out)
    if "prompt_ids" not in probe and isinstance(probe.get("prompt"), str):
        probe["prompt_ids"] = [0]
    try:
        records_to_rollouts([(at, probe)], vocab_size, None, _TextProbe(), mu_known=s.mu_known, eos_id=0)
    except ValueError as err:
        raise ValueError(rename_fields(str(err), s.format)) from None
    return out
