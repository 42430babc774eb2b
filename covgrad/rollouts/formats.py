"""Readers for the rollout dumps of RL training stacks, mapped onto covgrad's import records.

Each reader is a pure function ``reader(record, at, options) -> (covgrad_record, extras)`` over one
already-parsed JSON object (``at`` names it in messages, e.g. ``file.jsonl:3`` from
``storage.readers.read_located_records``). ``covgrad_record`` holds the fields that
:func:`covgrad.rollouts.imports.records_to_rollouts` validates (``prompt_ids``, ``response_ids``,
``reward``, ``logprobs``, optional ``top_logprobs`` and ``group``); ``extras`` holds what that
importer does not keep:

- ``policy_version`` (int or None): the training step / weight version the sampler ran;
- ``sampling_params`` (dict): temperature, top_p, ... (from the record, else ``options["sampling_params"]``);
- ``advantage`` (float or None): the stack's sequence advantage;
- ``token_advantages`` (list of float or None): the stack's per-token advantages, one per response token (TRL:
  its sequence advantage on every completion token, what ``GRPOTrainer``'s loss multiplies each token by).

Formats (field names from the stacks' sources; docs/formats.md has the tables):

- ``open_instruct``: one ``RolloutRecord`` per line as ``open_instruct/rl_utils.py`` ``_save_rollouts``
  writes it (``json.dumps(asdict(RolloutRecord(...)))``, ``--save_traces``): ``step``, ``sample_idx``,
  ``prompt_idx``, ``prompt_tokens``, ``response_tokens``, ``reward``, ``advantage``, ``finish_reason``,
  ``dataset``, ``ground_truth``, ``request_info``, ``logprobs``. The group is (``step``, ``prompt_idx``)
  (``prompt_idx = i // num_samples_per_prompt`` within a step's batch).
- ``trl``: one completion per line, the row of TRL's generation output (``prompt_ids``,
  ``completion_ids``, ``logprobs``, optional ``logprob_token_ids``: the ``rollout_func`` contract of
  ``trl/trainer/grpo_trainer.py`` and ``GenerateResponse`` of ``trl/scripts/vllm_serve.py``) joined with the
  row of the completions table ``GRPOTrainer.log`` writes (``step``, ``prompt``, ``completion``, one column
  per reward function, ``advantage``). ``logprobs`` is per token either one float (the sampled token, as
  ``GRPOTrainer`` keeps it) or a rank-sorted list with ``logprob_token_ids`` (vLLM's top-N plus the sampled
  token): the second form also gives μ on that support. The reward is ``reward`` or, with
  ``options["reward_fields"]`` (and ``reward_weights``), the weighted NaN-skipping sum TRL computes
  (:func:`convert` applies those options to every format).
  Groups are the records of one ``step`` with the same prompt tokens.
- ``verl``: one row of verl's rollout ``DataProto`` (tensor rows as lists: ``prompts`` left-padded,
  ``responses`` right-padded, ``attention_mask``, ``response_mask``, ``rollout_log_probs``, ``advantages``,
  ``token_level_scores``; non-tensor ``uid``, ``param_version_start``/``param_version_end`` of the fully
  async trainer) with the keys ``RayPPOTrainer._dump_generations`` writes (``input``, ``output``, ``gts``,
  ``score``, ``step``); see ``verl/experimental/agent_loop/agent_loop.py`` (padding, masks) and
  ``verl/trainer/ppo/ray_trainer.py``. Tool/observation tokens (``response_mask`` 0 inside the response)
  are rejected: covgrad scores every response token.
- ``covgrad``: covgrad's own record; optional ``policy_version``, ``sampling_params``, ``advantage``,
  ``token_advantages`` go to ``extras``.
- ``responses``: a plain SFT dataset, one response per line: ``prompt`` (text) or ``prompt_ids``,
  ``response`` (text) or ``response_ids``, optional ``eos`` (true: append the tokenizer's EOS), ``reward``
  and ``group``. It has no log-probs: the data distribution μ is unknown (``covgrad.choices.MU_UNKNOWN_FORMATS``;
  ``records_to_rollouts(..., mu_known=False)``).

:func:`import_records` converts a whole file, validates through ``records_to_rollouts`` (its messages
name the stack's own field) and summarises the policy versions and sampling parameters (one line when they mix, or
when a record's own sampling parameters disagree with the sampler section's: :func:`sampling_disagreement`).
:func:`check_imported_field` is the preflight's check of the per-token field a regime imports.
"""

from __future__ import annotations

import json
import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from covgrad.choices import MU_UNKNOWN_FORMATS
from covgrad.rollouts.imports import TextEncoder, records_to_rollouts

Record = dict[str, Any]
Reader = Callable[[Record, str, dict[str, Any]], tuple[Record, Record]]


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _require(rec: Record, at: str, field: str) -> Any:
    if field not in rec or rec[field] is None:
        what = "is null" if field in rec else "is missing"
        raise ValueError(f"{at}: field '{field}' {what}")
    return rec[field]


def _int_field(rec: Record, at: str, field: str) -> int | None:
    """An optional integral field (``None`` when absent)."""
    value = rec.get(field)
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{at}: '{field}' must be an integer; got {value!r:.80}")
    return int(value)


def _float_list(value: Any, at: str, field: str, n: int) -> list[float]:
    """A list of ``n`` finite numbers (per-token advantages)."""
    if not isinstance(value, list | tuple) or not all(_is_number(x) for x in value):
        raise ValueError(f"{at}: '{field}' must be a list of numbers; got {value!r:.80}")
    if len(value) < n:
        raise ValueError(f"{at}: '{field}' has {len(value)} entries for {n} response tokens")
    out = [float(x) for x in value[:n]]
    bad = [x for x in out if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{at}: '{field}' has non-finite value {bad[0]}")
    return out


def _sampling_params(rec: Record, at: str, options: dict[str, Any]) -> dict:
    """The record's ``sampling_params``, else the configured ones."""
    value = rec.get("sampling_params", options.get("sampling_params", {}))
    if not isinstance(value, dict):
        raise ValueError(f"{at}: 'sampling_params' must be an object; got {value!r:.80}")
    return dict(value)


def _extras(
    policy_version: int | None, sampling: dict, advantage: Any, token_adv: list[float] | None, at: str
) -> Record:
    if advantage is not None and (not _is_number(advantage) or not math.isfinite(advantage)):
        raise ValueError(f"{at}: 'advantage' must be a finite number; got {advantage!r}")
    return {
        "policy_version": policy_version,
        "sampling_params": sampling,
        "advantage": None if advantage is None else float(advantage),
        "token_advantages": token_adv,
    }


def covgrad(rec: Record, at: str, options: dict[str, Any]) -> tuple[Record, Record]:
    """covgrad's own record, passed through; its optional provenance fields go to ``extras``."""
    token_adv = rec.get("token_advantages")
    if token_adv is not None:
        n = len(rec["response_ids"]) if isinstance(rec.get("response_ids"), list) else 0
        if not isinstance(token_adv, list) or len(token_adv) != n:
            raise ValueError(f"{at}: 'token_advantages' must have one number per response token ({n})")
        token_adv = _float_list(token_adv, at, "token_advantages", n)
    extras = _extras(
        _int_field(rec, at, "policy_version"), _sampling_params(rec, at, options), rec.get("advantage"), token_adv, at
    )
    return rec, extras


def open_instruct(rec: Record, at: str, options: dict[str, Any]) -> tuple[Record, Record]:
    """An open-instruct ``RolloutRecord`` (``open_instruct/rl_utils.py``)."""
    logprobs = rec.get("logprobs")
    if logprobs is None:
        raise ValueError(
            f"{at}: 'logprobs' is null; open-instruct writes them only when vLLM returned log-probs, and "
            "covgrad needs the sampler's log-probability of every response token"
        )
    _require(rec, at, "step")
    _require(rec, at, "prompt_idx")
    step = _int_field(rec, at, "step")
    out: Record = {
        "prompt_ids": _require(rec, at, "prompt_tokens"),
        "response_ids": _require(rec, at, "response_tokens"),
        "reward": _require(rec, at, "reward"),
        "logprobs": logprobs,
        "group": f"{step}/{_int_field(rec, at, 'prompt_idx')}",
    }
    return out, _extras(step, _sampling_params(rec, at, options), rec.get("advantage"), None, at)


def column_reward(rec: Record, at: str, options: dict[str, Any]) -> float:
    """The weighted NaN-skipping sum of the record's columns ``options["reward_fields"]`` with weights
    ``options["reward_weights"]`` (default 1), as TRL sums its reward functions."""
    fields = options["reward_fields"]
    weights = options.get("reward_weights") or [1.0] * len(fields)
    if len(weights) != len(fields):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(fields)} reward_fields")
    total, scored = 0.0, False
    for name, w in zip(fields, weights, strict=True):
        value = rec.get(name)
        if value is None or (_is_number(value) and math.isnan(value)):
            continue  # TRL's nansum skips a reward function that returned None
        if not _is_number(value):
            raise ValueError(f"{at}: reward column '{name}' must be a number; got {value!r:.80}")
        total += float(w) * float(value)
        scored = True
    if not scored:
        raise ValueError(f"{at}: every reward column {list(fields)} is null or NaN; the completion is unscorable")
    return total


def trl(rec: Record, at: str, options: dict[str, Any]) -> tuple[Record, Record]:
    """A TRL completion row (``rollout_func`` / ``vllm_serve`` output plus the completions table); its sequence
    ``advantage`` is also every completion token's (``extras["token_advantages"]``: what ``GRPOTrainer``'s loss
    multiplies each token's ratio by, and what regime ``rl_token`` with ``advantages: imported`` reads)."""
    completion = _require(rec, at, "completion_ids")
    logprobs = _require(rec, at, "logprobs")
    if not isinstance(completion, list) or not isinstance(logprobs, list) or len(logprobs) != len(completion):
        n = len(logprobs) if isinstance(logprobs, list) else "no"
        raise ValueError(f"{at}: 'logprobs' has {n} entries for {len(completion)} completion tokens")
    out: Record = {"prompt_ids": _require(rec, at, "prompt_ids"), "response_ids": completion}
    token_ids = rec.get("logprob_token_ids")
    if all(_is_number(x) or x is None for x in logprobs) and token_ids is None:
        sampled = logprobs
    else:
        if token_ids is None:
            sampled = []
            for j, lp in enumerate(logprobs):
                if not isinstance(lp, list) or len(lp) != 1:
                    raise ValueError(
                        f"{at}: 'logprobs[{j}]' lists {lp!r:.40} without 'logprob_token_ids'; give the ids of a "
                        "rank-sorted list, or one log-prob per token"
                    )
                sampled.append(lp[0])
        else:
            if not isinstance(token_ids, list) or len(token_ids) != len(completion):
                raise ValueError(f"{at}: 'logprob_token_ids' must have one list per completion token")
            sampled, top = [], []
            for j, (ids, lps, y) in enumerate(zip(token_ids, logprobs, completion, strict=True)):
                if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
                    raise ValueError(f"{at}: 'logprob_token_ids[{j}]' and 'logprobs[{j}]' must be lists of one length")
                if y not in ids:
                    raise ValueError(f"{at}: 'logprob_token_ids[{j}]' lacks the sampled token {y!r}")
                sampled.append(lps[ids.index(y)])
                top.append([ids, [float("nan") if v is None else v for v in lps]])
            out["top_logprobs"] = top
    bad = [j for j, v in enumerate(sampled) if v is None]
    if bad:
        raise ValueError(f"{at}: 'logprobs[{bad[0]}]' is null (vLLM returned NaN); the token has no sampler log-prob")
    out["logprobs"] = sampled
    out["reward"] = column_reward(rec, at, options) if options.get("reward_fields") else _require(rec, at, "reward")
    step = _int_field(rec, at, "step")
    if step is not None and isinstance(out["prompt_ids"], list):
        out["group"] = f"{step}/" + ",".join(str(t) for t in out["prompt_ids"])
    extras = _extras(step, _sampling_params(rec, at, options), rec.get("advantage"), None, at)
    if extras["advantage"] is not None:  # what GRPOTrainer trains every token of the completion on
        extras["token_advantages"] = [extras["advantage"]] * len(completion)
    return out, extras


def verl(rec: Record, at: str, options: dict[str, Any]) -> tuple[Record, Record]:
    """A verl rollout ``DataProto`` row with the ``_dump_generations`` keys."""
    prompts = _require(rec, at, "prompts")
    responses = _require(rec, at, "responses")
    attention = _require(rec, at, "attention_mask")
    if not all(isinstance(x, list) for x in (prompts, responses, attention)):
        raise ValueError(f"{at}: 'prompts', 'responses' and 'attention_mask' must be lists")
    P, R = len(prompts), len(responses)
    if len(attention) != P + R:
        raise ValueError(f"{at}: 'attention_mask' has {len(attention)} entries for {P} prompt + {R} response slots")
    prompt_ids = [t for t, m in zip(prompts, attention[:P], strict=True) if m]
    live = [bool(m) for m in attention[P:]]
    n = sum(live)
    if live != [True] * n + [False] * (R - n):
        raise ValueError(f"{at}: 'attention_mask' over the response must be 1s then 0s (right padding)")
    response_mask = rec.get("response_mask")
    if response_mask is not None and (not isinstance(response_mask, list) or len(response_mask) != R):
        raise ValueError(f"{at}: 'response_mask' must be a list of {R} entries, one per 'responses' slot")
    if response_mask is not None and [bool(m) for m in response_mask[:n]] != [True] * n:
        j = next(j for j, m in enumerate(response_mask[:n]) if not m)
        raise ValueError(
            f"{at}: 'response_mask[{j}]' is 0 inside the response (a tool/observation token); covgrad scores "
            "every response token and cannot import masked ones"
        )
    logprobs = _require(rec, at, "rollout_log_probs")
    if not isinstance(logprobs, list) or len(logprobs) < n:
        raise ValueError(f"{at}: 'rollout_log_probs' has fewer entries than the {n} response tokens")
    if "score" in rec:
        reward = rec["score"]
    else:
        scores = _require(rec, at, "token_level_scores")
        reward = float(sum(_float_list(scores, at, "token_level_scores", n)))
    out: Record = {
        "prompt_ids": prompt_ids,
        "response_ids": responses[:n],
        "reward": reward,
        "logprobs": logprobs[:n],
    }
    if rec.get("uid") is not None:
        out["group"] = rec["uid"]
    start, end = _int_field(rec, at, "param_version_start"), _int_field(rec, at, "param_version_end")
    if start is not None and end is not None and start != end:
        raise ValueError(
            f"{at}: 'param_version_start' {start} != 'param_version_end' {end}: the response was sampled across a "
            "weight update (a partial rollout), so no single sampler produced it"
        )
    version = start if start is not None else _int_field(rec, at, "step")
    adv = rec.get("advantages")
    token_adv = None if adv is None else _float_list(adv, at, "advantages", n)
    return out, _extras(version, _sampling_params(rec, at, options), None, token_adv, at)


DATASET_FIELDS = ("prompt", "prompt_ids", "response", "response_ids", "eos", "reward", "group")
"""The fields of a ``responses`` record that the importer reads; any other field is ignored."""


def responses(rec: Record, at: str, options: dict[str, Any]) -> tuple[Record, Record]:
    """A plain SFT dataset record (prompt, response, optional eos, reward and group); ValueError for
    sampler log-probs, which a dataset of unknown μ cannot have."""
    for field in ("logprobs", "top_logprobs"):
        if field in rec:
            raise ValueError(
                f"{at}: format responses has no sampler '{field}' (its μ is unknown); import sampled rollouts "
                "with their log-probs as format covgrad"
            )
    out = {k: rec[k] for k in DATASET_FIELDS if k in rec}
    return out, _extras(None, {}, None, None, at)  # a dataset has no sampler, so no sampling parameters


READERS: dict[str, Reader] = {
    "covgrad": covgrad,
    "open_instruct": open_instruct,
    "trl": trl,
    "verl": verl,
    "responses": responses,
}

# covgrad field -> the stack's field, for messages from records_to_rollouts
FIELD_NAMES: dict[str, dict[str, str]] = {
    "covgrad": {},
    "responses": {},
    "open_instruct": {"prompt_ids": "prompt_tokens", "response_ids": "response_tokens", "group": "prompt_idx"},
    "trl": {"response_ids": "completion_ids", "top_logprobs": "logprob_token_ids/logprobs", "group": "step"},
    "verl": {
        "prompt_ids": "prompts",
        "response_ids": "responses",
        "logprobs": "rollout_log_probs",
        "reward": "score",
        "group": "uid",
    },
}


IMPORTED_SOURCES: dict[str, dict[str, str]] = {"trl": {"advantages": "advantage"}}
"""Per format, the stack's record field that gives an imported per-token field (``advantages``,
``teacher_logprobs``) where it is not the field of the same name: TRL's per-completion ``advantage``."""


def check_imported_field(fmt: str, rec: Any, at: str, field: str) -> None:
    """ValueError naming the record ``at`` and the stack's field unless record ``rec`` of format ``fmt`` gives the
    imported per-token ``field`` that a regime reads (``advantages: imported``, ``teacher_logprobs: true``): a list
    with one number per response token, or for ``trl`` advantages the completion's ``advantage`` (one number, which
    every completion token trains on)."""
    source = IMPORTED_SOURCES.get(fmt, {}).get(field, field)
    got = rec.get(source) if isinstance(rec, dict) else None
    if got is None and source == field:
        raise ValueError(f"{at} has no '{field}' field (the regime reads it)")
    if got is None:
        raise ValueError(
            f"{at} has no '{source}' field (format {fmt}: the advantage column of its completions table), which the "
            f"regime reads as its imported {field}"
        )
    if source != field:
        if not _is_number(got) or not math.isfinite(got):
            raise ValueError(f"{at}: '{source}' must be a finite number; got {got!r:.80}")
        return
    response = rec.get(FIELD_NAMES.get(fmt, {}).get("response_ids", "response_ids"), [])
    n = len(response) if isinstance(response, list) else 0
    if not isinstance(got, list) or len(got) != n:
        size = len(got) if isinstance(got, list) else type(got).__name__
        raise ValueError(f"{at}: '{field}' has {size} entries for {n} response tokens")


def without_rewards(fmt: str, record: Record, options: dict[str, Any]) -> bool:
    """Whether a dump of format ``fmt`` whose first record is ``record`` has no rewards: a dataset of
    responses (``covgrad.choices.MU_UNKNOWN_FORMATS``) whose records carry no ``reward`` and no reward
    columns ``options["reward_fields"]`` (every record has a reward or none, so the first one tells)."""
    return fmt in MU_UNKNOWN_FORMATS and "reward" not in record and not options.get("reward_fields")


def convert(fmt: str, rec: Any, at: str, options: dict[str, Any] | None = None) -> tuple[Record, Record]:
    """One record of format ``fmt`` as ``(covgrad_record, extras)`` (module docstring).

    Raises:
        ValueError: an unknown format, or one line naming ``at`` and the record's bad field.
    """
    if fmt not in READERS:
        raise ValueError(f"unknown rollout format {fmt!r}; choose one of {sorted(READERS)}")
    if not isinstance(rec, dict):
        raise ValueError(f"{at}: expected a JSON object; got {type(rec).__name__}")
    options = options or {}
    out, extras = READERS[fmt](rec, at, options)
    if options.get("reward_fields") and fmt != "trl":
        out = {**out, "reward": column_reward(rec, at, options)}
    return out, extras


def parse_reward_fields(entries: list[str]) -> dict[str, list]:
    """Reader options ``reward_fields`` and ``reward_weights`` from entries ``'column'`` or ``'column:weight'``."""
    fields, weights = [], []
    for entry in entries:
        name, _, weight = entry.partition(":")
        fields.append(name)
        weights.append(float(weight) if weight else 1.0)
    return {"reward_fields": fields, "reward_weights": weights}


def rename_fields(message: str, fmt: str) -> str:
    """A records_to_rollouts message with covgrad's field names replaced by the stack's."""
    for ours, theirs in FIELD_NAMES[fmt].items():
        message = message.replace(f"'{ours}", f"'{theirs}")
    return message


SAMPLING_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
"""The sampling parameters a sampler section sets, at the values that mean "unchanged" (a record's None)."""


def sampling_disagreement(records: list[dict], configured: dict | None) -> str | None:
    """One clause when a record's own sampling parameters (``records``: the distinct dicts) disagree with the
    sampler section's ``configured`` ones on temperature, top_p or top_k (None: nothing to compare), else None."""
    if not configured:
        return None

    def value(params: dict, key: str) -> float:
        v = params.get(key)
        if v is None or (key == "top_k" and v < 0):  # vLLM's top_k -1 is covgrad's 0: no truncation
            return SAMPLING_DEFAULTS[key]
        return float(v)

    for params in records:
        keys = [k for k in SAMPLING_DEFAULTS if k in params and (params[k] is None or _is_number(params[k]))]
        if any(value(params, k) != value(configured, k) for k in keys):
            theirs = {k: params[k] for k in keys}
            ours = {k: configured.get(k, SAMPLING_DEFAULTS[k]) for k in keys}
            return (
                f"records were sampled with {json.dumps(theirs)} but the sampler section says {json.dumps(ours)}; "
                "the sampler's μ (mu_model, on_policy) follows the section and a regime's policy temperature is "
                "its own temperature (TRL's loss uses the generation temperature): set both to the records'"
            )
    return None


def version_summary(
    versions: list[int | None], sampling: list[dict], fmt: str, source: str, configured: dict | None = None
) -> dict[str, Any]:
    """Counts of policy versions and distinct sampling parameters; ``message`` is one line when they mix, or when
    the records' own sampling parameters disagree with ``configured`` (the sampler section's, see
    :func:`sampling_disagreement`).

    Returns:
        ``format``, ``records``, ``policy_versions`` ({version: count}, None for records without one),
        ``mixed_versions``, ``sampling_params`` (distinct dicts in order of first appearance),
        ``mixed_sampling_params``, ``message`` (str or None).
    """
    counts = Counter(versions)
    distinct: list[dict] = []
    for params in sampling:
        if params not in distinct:
            distinct.append(params)
    mixed_versions = len(counts) > 1
    parts = []
    if mixed_versions:
        listed = ", ".join(f"{v}: {c}" for v, c in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
        parts.append(
            f"{len(counts)} policy versions in {len(versions)} records ({listed}); the rollouts come from "
            "several samplers, so one sampler μ fits only some of them"
        )
    if len(distinct) > 1:
        parts.append(f"{len(distinct)} different sampling parameter sets: {json.dumps(distinct)}")
    disagreement = sampling_disagreement(distinct, configured)
    if disagreement:
        parts.append(disagreement)
    return {
        "format": fmt,
        "records": len(versions),
        "policy_versions": dict(counts),
        "mixed_versions": mixed_versions,
        "sampling_params": distinct,
        "mixed_sampling_params": len(distinct) > 1,
        "message": f"{source} ({fmt}): " + "; ".join(parts) if parts else None,
    }


def import_records(
    located: Iterable[tuple[str, Any]],
    fmt: str,
    vocab_size: int,
    max_len: int | None,
    tokenizer: TextEncoder | None = None,
    pad_id: int = 0,
    options: dict[str, Any] | None = None,
    source: str = "rollouts",
    eos_id: int | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """Convert and validate a stack's dump: the arrays of ``records_to_rollouts``, the extras, a summary.

    Args:
        located: ``(where, object)`` pairs, e.g. ``storage.readers.read_located_records(path)``.
        fmt: a key of :data:`READERS`.
        vocab_size, max_len, tokenizer, pad_id, eos_id: as for ``records_to_rollouts`` (which gets
            ``mu_known=False`` for a format of ``MU_UNKNOWN_FORMATS``).
        options: reader options (``sampling_params``; ``reward_fields``, ``reward_weights``).
        source: names the input in the summary message (e.g. the file path).

    Returns:
        ``(arrays, extras, summary)``: ``arrays`` as ``records_to_rollouts`` returns them (N records, T the
        longest response); ``extras`` holds, when every record has them, ``policy_version`` (N,) int64,
        ``advantage`` (N,) float64 and ``token_advantages`` (N, T) float64 (0 after each response's end);
        ``summary`` from :func:`version_summary`, with ``where``: each record's location (``at``), and
        ``sampling_index`` (N,) int: each record's entry of ``summary["sampling_params"]``.

    Raises:
        ValueError: one line naming the record (``where``) and the stack's field; also when only some
            records carry per-token advantages, a sequence advantage or a policy version.
    """
    converted: list[tuple[str, Record]] = []
    extras: list[Record] = []
    for at, rec in located:
        out, extra = convert(fmt, rec, at, options)
        converted.append((at, out))
        extras.append(extra)
    try:
        arrays = records_to_rollouts(
            converted,
            vocab_size,
            max_len,
            tokenizer=tokenizer,
            pad_id=pad_id,
            mu_known=fmt not in MU_UNKNOWN_FORMATS,
            eos_id=eos_id,
        )
    except ValueError as err:
        raise ValueError(rename_fields(str(err), fmt)) from None
    N, T = arrays["sampler_logp"].shape
    out_extras: dict[str, np.ndarray] = {}
    for key in ("policy_version", "advantage", "token_advantages"):
        present = [e[key] is not None for e in extras]
        if any(present) and not all(present):
            i = present.index(not present[0])
            have = "has" if present[i] else "lacks"
            raise ValueError(
                f"{converted[i][0]}: {have} '{key}' unlike {converted[0][0]}; give it in every record or in none"
            )
        if not all(present):
            continue
        if key == "policy_version":
            out_extras[key] = np.array([e[key] for e in extras], dtype=np.int64)
        elif key == "advantage":
            out_extras[key] = np.array([e[key] for e in extras], dtype=np.float64)
        else:
            adv = np.zeros((N, T), dtype=np.float64)
            for n, e in enumerate(extras):
                adv[n, : len(e[key])] = e[key]
            out_extras[key] = adv
    versions = [e["policy_version"] for e in extras]
    sampling = [e["sampling_params"] for e in extras]
    summary = version_summary(versions, sampling, fmt, source, options.get("sampling_params") if options else None)
    summary["where"] = [at for at, _ in converted]
    summary["sampling_index"] = [summary["sampling_params"].index(p) for p in sampling]
    return arrays, out_extras, summary
