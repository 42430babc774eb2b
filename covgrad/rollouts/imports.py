"""Turn rollouts recorded elsewhere (an inference engine, another RL stack) into covgrad's arrays.

A record is one sampled response:

- ``prompt_ids`` (list of int) or ``prompt`` (text; needs a tokenizer, encoded with its default
  special tokens, as an engine encodes a raw prompt);
- ``response_ids`` (list of int, non-empty; EOS included when it was sampled);
- ``reward`` (finite number);
- ``logprobs`` (list of float, one per response token): log μ of each sampled token;
- optional ``top_logprobs``: per response token either ``[[ids...], [logps...]]`` or ``{id: logp}``,
  the sampler's top-k. Engines often add the sampled token to the top-k, so k may vary by position;
  shorter positions are padded with their first id at log-prob ``-inf`` (zero mass);
- optional ``group``: an int or str group label; without it, records with identical prompt tokens form
  a group;
- optional ``advantages`` (list of finite numbers, one per response token): per-token advantages A_t, as
  TRL/verl/open-instruct dumps hold them (regime ``rl_token`` with ``advantages: imported``);
- optional ``teacher_logprobs`` (list of float, one per response token): log q of each sampled token under
  a teacher (regime ``distill_sampled`` with ``teacher_logprobs: true``).

``group``, ``top_logprobs``, ``advantages``, ``teacher_logprobs`` must be given by every record or by none.
Token ids may be integral floats (Arrow cannot type the mixed ``[[ids], [logps]]`` lists). The arrays match those of
:func:`covgrad.rollouts.sampling.generate`, with the position axis T = the longest response.

A record of a *dataset* (``mu_known=False``: SFT responses from an unknown distribution μ) differs:

- no ``logprobs`` or ``top_logprobs``: μ is unknown, and ``sampler_logp`` is NaN;
- ``response_ids`` or ``response`` (text; encoded with ``add_special_tokens=False``), optional ``eos: true``
  to append the tokenizer's EOS;
- ``reward`` is optional, in every record or in none; without it ``reward`` is NaN (no rewards).

Shape notation: N records, L = max(prompt_len + response_len), T = max response_len, k top-k entries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class TextEncoder(Protocol):
    """Anything with ``encode(text, add_special_tokens=...) -> list[int]`` (a Hugging Face tokenizer works)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def _token_ids(value: Any, at: str, field: str, vocab_size: int) -> np.ndarray:
    """Validate a list of token ids of the record at ``at``; return it as int64 (n,)."""
    try:
        arr = np.asarray(value) if isinstance(value, list | tuple | np.ndarray) else None
    except ValueError:  # ragged nesting
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf"):
        raise ValueError(f"{at}: '{field}' must be a flat list of integer token ids; got {value!r:.80}")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            raise ValueError(f"{at}: '{field}' has non-integer token id {arr[bad][0].item()!r}")
    ids = arr.astype(np.int64)
    out_of_range = (ids < 0) | (ids >= vocab_size)
    if out_of_range.any():
        raise ValueError(f"{at}: '{field}' has token id {ids[out_of_range][0]} outside [0, {vocab_size})")
    return ids


LOGP_ROUNDING = 1e-4  # largest log-probability above 0 accepted as an engine's rounding
TOPK_MASS_ROUNDING = 1e-3  # largest excess of a position's top-k mass over 1 accepted as rounding


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _log_probs(value: Any, at: str, field: str, allow_neg_inf: bool) -> np.ndarray:
    """Validate a list of log-probabilities of the record at ``at``; return it as float32 (n,)."""
    if not isinstance(value, list | tuple | np.ndarray) or not all(_is_number(x) for x in value):
        raise ValueError(f"{at}: '{field}' must be a list of numbers; got {value!r:.80}")
    lp = np.asarray(value, dtype=np.float64)
    bad = np.isnan(lp) | (lp == np.inf) | ((lp == -np.inf) & (not allow_neg_inf))
    if bad.any():
        raise ValueError(f"{at}: '{field}' has invalid log-probability {lp[bad][0]} (must be finite)")
    above = lp > LOGP_ROUNDING
    if above.any():
        raise ValueError(
            f"{at}: '{field}' has log-probability {lp[above][0]} > 0 (a probability above 1); "
            "export natural-log probabilities of the sampled tokens"
        )
    return lp.astype(np.float32)


def _top_position(entry: Any, at: str, j: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One position's top-k as (ids int64, logp float32), sorted by decreasing logp, ties by lowest id."""
    field = f"top_logprobs[{j}]"
    if isinstance(entry, dict):
        try:
            keys = [int(k) for k in entry]
        except ValueError as err:
            raise ValueError(f"{at}: '{field}' has a non-integer token id key ({err})") from None
        ids = _token_ids(keys, at, field, vocab_size)
        lp = _log_probs(list(entry.values()), at, field, allow_neg_inf=True)
    elif isinstance(entry, list | tuple) and len(entry) == 2:
        ids = _token_ids(entry[0], at, field, vocab_size)
        lp = _log_probs(entry[1], at, field, allow_neg_inf=True)
        if len(ids) != len(lp):
            raise ValueError(f"{at}: '{field}' has {len(ids)} ids but {len(lp)} log-probs")
    else:
        raise ValueError(f"{at}: '{field}' must be {{id: logp}} or [[ids...], [logps...]]; got {entry!r:.80}")
    if len(ids) == 0:
        raise ValueError(f"{at}: '{field}' is empty; give at least the top token")
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"{at}: '{field}' repeats a token id; each id may appear once per position")
    mass = float(np.exp(lp.astype(np.float64)).sum())
    if mass > 1.0 + TOPK_MASS_ROUNDING:
        raise ValueError(
            f"{at}: '{field}' holds probability mass {mass:.6g} > 1; the top-k log-probabilities must be "
            "of one normalised next-token distribution"
        )
    order = np.lexsort((ids, -lp.astype(np.float64)))
    return ids[order], lp[order]


def _prompt(rec: dict, at: str, vocab_size: int, tokenizer: TextEncoder | None) -> np.ndarray:
    if "prompt_ids" in rec:
        ids = _token_ids(rec["prompt_ids"], at, "prompt_ids", vocab_size)
    elif "prompt" in rec:
        if tokenizer is None:
            raise ValueError(f"{at}: has text 'prompt' but no tokenizer was given; pass one or use prompt_ids")
        if not isinstance(rec["prompt"], str):
            raise ValueError(f"{at}: 'prompt' must be a string; got {type(rec['prompt']).__name__}")
        ids = _token_ids(list(tokenizer.encode(rec["prompt"])), at, "prompt (tokenized)", vocab_size)
    else:
        raise ValueError(f"{at}: missing field 'prompt_ids' (or text 'prompt' with a tokenizer)")
    if len(ids) == 0:
        raise ValueError(f"{at}: the prompt is empty; every prompt needs at least one token")
    return ids


def _response(rec: dict, at: str, vocab_size: int, tokenizer: TextEncoder | None, eos_id: int | None) -> np.ndarray:
    """A dataset record's response tokens: ``response_ids`` or text ``response`` (encoded without special
    tokens), then the EOS id when ``eos`` is true; int64 (n,), n ≥ 1."""
    if "response_ids" in rec:
        ids = _token_ids(rec["response_ids"], at, "response_ids", vocab_size)
        field = "response_ids"
    elif "response" in rec:
        if tokenizer is None:
            raise ValueError(f"{at}: has text 'response' but no tokenizer was given; pass one or use response_ids")
        if not isinstance(rec["response"], str):
            raise ValueError(f"{at}: 'response' must be a string; got {type(rec['response']).__name__}")
        encoded = list(tokenizer.encode(rec["response"], add_special_tokens=False))
        ids, field = _token_ids(encoded, at, "response (tokenized)", vocab_size), "response"
    else:
        raise ValueError(f"{at}: missing field 'response_ids' (or text 'response' with a tokenizer)")
    eos = rec.get("eos", False)
    if not isinstance(eos, bool):
        raise ValueError(f"{at}: 'eos' must be true or false; got {eos!r}")
    if eos:
        if eos_id is None:
            raise ValueError(f"{at}: 'eos' is true but the tokenizer has no EOS token")
        ids = np.append(ids, np.int64(eos_id))
    if len(ids) == 0:
        raise ValueError(f"{at}: '{field}' is empty; a response needs at least one token")
    return ids


def _all_or_none(field: str, present: bool, first: bool | None, at: str, first_at: str) -> bool:
    """Whether `field` is in use; raise when the record at ``at`` disagrees with the first one."""
    if first is not None and present != first:
        have = "has" if present else "lacks"
        raise ValueError(f"{at}: {have} '{field}' unlike {first_at}; give it in every record or in none")
    return present


def records_to_rollouts(
    records: Iterable[dict],
    vocab_size: int,
    max_len: int | None,
    tokenizer: TextEncoder | None = None,
    pad_id: int = 0,
    mu_known: bool = True,
    eos_id: int | None = None,
) -> dict[str, np.ndarray]:
    """Validate imported rollout records and build the arrays of :func:`covgrad.rollouts.sampling.generate`.

    Args:
        records: one dict per sampled response (fields in the module docstring), or ``(where, dict)``
            pairs, where ``where`` names the record in messages (e.g. ``file.jsonl:3``; default
            ``record i``, 0-based).
        vocab_size: V; every token id must be in [0, V).
        max_len: largest allowed prompt + response length, or None for no limit.
        tokenizer: encodes text ``prompt`` (and, in a dataset, ``response``) fields; needed only for them.
        pad_id: fill value for token rows.
        mu_known: False for a dataset of responses (module docstring): no log-probs, optional rewards.
        eos_id: the id a dataset record's ``eos: true`` appends.

    Returns:
        ``tokens`` (N, L) int32 right-padded with ``pad_id``; ``prompt_len``, ``response_len`` (N,)
        int64; ``response_mask`` (N, L) bool; ``reward`` (N,) float64 (NaN for a dataset without rewards);
        ``group`` (N,) int64 (dense labels in order of first appearance); ``prompt_index`` (N,) int64
        (distinct prompts in order of first appearance); ``sample_index`` (N,) int64 (rank within its
        group); ``sampler_logp`` (N, T) float32, 0 after the end (NaN when ``mu_known`` is False); with
        ``top_logprobs``: ``mu_topk_ids`` (N, T, k) int32, ``mu_topk_logp`` (N, T, k) float32 and
        ``mu_tail`` (N, T) float32 = max(0, 1 − Σ exp(logp)),
        all 0 after the end; with ``advantages``: ``token_advantage`` (N, L) float64 and with
        ``teacher_logprobs``: ``teacher_logprob`` (N, L) float32, token-aligned (entry t for token t of the
        row, 0 outside the response).

    Raises:
        ValueError: one line naming the record (``where`` or its index) and the bad field or value.
    """
    read = _RecordFields()
    for i, item in enumerate(records):
        at, rec = item if isinstance(item, tuple) else (f"record {i}", item)
        read.first_at = read.first_at or at
        if not isinstance(rec, dict):
            raise ValueError(f"{at}: expected a dict; got {type(rec).__name__}")
        read.add(rec, at, vocab_size, max_len, tokenizer, mu_known, eos_id)
    if not read.prompts:
        raise ValueError("no records to import; the input is empty")
    tokens, prompt_len, response_len, response_mask, sampler_logp = _token_arrays(
        read.prompts, read.responses, read.logps, pad_id, mu_known
    )
    group, prompt_index, sample_index = _group_arrays(read.group_keys, read.prompts)
    out = {
        "tokens": tokens,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "response_mask": response_mask,
        "reward": np.array(read.rewards, dtype=np.float64),
        "group": group,
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "sampler_logp": sampler_logp,
    }
    if read.has_top:
        out.update(_topk_arrays(read.tops, sampler_logp.shape[1]))
    for key, (name, dtype) in PER_TOKEN.items():
        if read.has_token[key]:
            out[name] = _token_aligned(read.per_token[key], prompt_len, response_len, tokens.shape[1], dtype)
    return out


@dataclass
class _RecordFields:
    """The validated fields of the records read so far, in record order, and which optional fields they give
    (None before the first record; every record must give an optional field or none may).

    Attributes:
        prompts, responses: per record, its prompt and response token ids, int64 (n,).
        rewards: per record, its reward (NaN without rewards).
        logps: per record with known μ, the sampled tokens' log μ, float32 (response_len,).
        tops: per record with top-k, per response position (ids int64 (k_t,), logp float32 (k_t,)).
        group_keys: per record, the key its group is labelled by (its ``group`` or its prompt tokens).
        per_token: per optional per-token field, per record, its values (float64 (response_len,)).
        first_at: how messages name the first record.
    """

    prompts: list[np.ndarray] = field(default_factory=list)
    responses: list[np.ndarray] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    logps: list[np.ndarray] = field(default_factory=list)
    tops: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)
    group_keys: list[tuple] = field(default_factory=list)
    has_group: bool | None = None
    has_top: bool | None = None
    has_reward: bool | None = None
    per_token: dict[str, list[np.ndarray]] = field(default_factory=lambda: {f: [] for f in PER_TOKEN})
    has_token: dict[str, bool | None] = field(default_factory=lambda: dict.fromkeys(PER_TOKEN))
    first_at: str = ""

    def add(
        self,
        rec: dict,
        at: str,
        vocab_size: int,
        max_len: int | None,
        tokenizer: TextEncoder | None,
        mu_known: bool,
        eos_id: int | None,
    ) -> None:
        """Validate the record ``rec`` (named ``at`` in messages; arguments as in :func:`records_to_rollouts`)
        and append its fields.

        Raises:
            ValueError: one line naming the record and its bad field or value.
        """
        first_at = self.first_at
        prompt = _prompt(rec, at, vocab_size, tokenizer)
        if mu_known:
            response = _sampled_response(rec, at, vocab_size)
        else:
            response = _response(rec, at, vocab_size, tokenizer, eos_id)
        if max_len is not None and len(prompt) + len(response) > max_len:
            raise ValueError(
                f"{at}: prompt + response is {len(prompt)} + {len(response)} tokens, over max_len={max_len}"
            )
        self.has_reward = _all_or_none("reward", "reward" in rec, self.has_reward, at, first_at)
        reward = rec["reward"] if self.has_reward else math.nan
        if self.has_reward and (not _is_number(reward) or not math.isfinite(reward)):
            raise ValueError(f"{at}: 'reward' must be a finite number; got {reward!r}")
        if mu_known:
            logp = _log_probs(rec["logprobs"], at, "logprobs", allow_neg_inf=False)
            if len(logp) != len(response):
                raise ValueError(f"{at}: 'logprobs' has {len(logp)} entries for {len(response)} response tokens")
            self.logps.append(logp)
        self.has_top = _all_or_none("top_logprobs", "top_logprobs" in rec, self.has_top, at, first_at)
        if self.has_top:
            top = rec["top_logprobs"]
            if not isinstance(top, list | tuple) or len(top) != len(response):
                raise ValueError(f"{at}: 'top_logprobs' must be a list with one entry per response token")
            self.tops.append([_top_position(entry, at, j, vocab_size) for j, entry in enumerate(top)])
        for name in PER_TOKEN:
            self.has_token[name] = _all_or_none(name, name in rec, self.has_token[name], at, first_at)
            if self.has_token[name]:
                self.per_token[name].append(_per_token(rec[name], at, name, len(response)))
        self.group_keys.append(self._group_key(rec, at, prompt))
        self.prompts.append(prompt)
        self.responses.append(response)
        self.rewards.append(float(reward))

    def _group_key(self, rec: dict, at: str, prompt: np.ndarray) -> tuple:
        """The key the record's group is labelled by: ``("group", label)``, or ``("prompt", *ids)`` without
        ``group`` fields."""
        self.has_group = _all_or_none("group", "group" in rec, self.has_group, at, self.first_at)
        if not self.has_group:
            return ("prompt", *prompt.tolist())
        label = rec["group"]
        if not isinstance(label, int | str) or isinstance(label, bool):
            raise ValueError(f"{at}: 'group' must be an int or a string; got {label!r}")
        return ("group", label)


def _sampled_response(rec: dict, at: str, vocab_size: int) -> np.ndarray:
    """A sampled record's response tokens (``response_ids``, after checking that the fields every sampled record
    needs are there); int64 (n,), n ≥ 1."""
    for field_name in ("response_ids", "reward", "logprobs"):
        if field_name not in rec:
            raise ValueError(f"{at}: missing field '{field_name}'")
    response = _token_ids(rec["response_ids"], at, "response_ids", vocab_size)
    if len(response) == 0:
        raise ValueError(f"{at}: 'response_ids' is empty; a response needs at least one token")
    return response


def _token_arrays(
    prompts: list[np.ndarray], responses: list[np.ndarray], logps: list[np.ndarray], pad_id: int, mu_known: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The token rows of N records: ``tokens`` (N, L) int32 right-padded with ``pad_id``, ``prompt_len`` and
    ``response_len`` (N,) int64, ``response_mask`` (N, L) bool and ``sampler_logp`` (N, T) float32 (``logps``, 0
    after the end; NaN when not ``mu_known``), in that order."""
    N = len(prompts)
    prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
    response_len = np.array([len(r) for r in responses], dtype=np.int64)
    L, T = int((prompt_len + response_len).max()), int(response_len.max())
    tokens = np.full((N, L), pad_id, dtype=np.int32)
    response_mask = np.zeros((N, L), dtype=bool)
    sampler_logp = np.zeros((N, T), dtype=np.float32) if mu_known else np.full((N, T), np.nan, dtype=np.float32)
    for n in range(N):
        lp, lr = prompt_len[n], response_len[n]
        tokens[n, :lp] = prompts[n]
        tokens[n, lp : lp + lr] = responses[n]
        response_mask[n, lp : lp + lr] = True
        if mu_known:
            sampler_logp[n, :lr] = logps[n]
    return tokens, prompt_len, response_len, response_mask, sampler_logp


def _group_arrays(group_keys: list[tuple], prompts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``group`` (N,) int64 (dense labels of ``group_keys`` in order of first appearance), ``prompt_index`` (N,)
    int64 (distinct prompts in order of first appearance) and ``sample_index`` (N,) int64 (rank within its
    group), in that order."""
    group_ids: dict[tuple, int] = {}
    prompt_ids: dict[tuple, int] = {}
    group = np.array([group_ids.setdefault(key, len(group_ids)) for key in group_keys], dtype=np.int64)
    prompt_index = np.array(
        [prompt_ids.setdefault(tuple(p.tolist()), len(prompt_ids)) for p in prompts], dtype=np.int64
    )
    sample_index = np.zeros(len(prompts), dtype=np.int64)
    seen = np.zeros(len(group_ids), dtype=np.int64)
    for n, g in enumerate(group):
        sample_index[n] = seen[g]
        seen[g] += 1
    return group, prompt_index, sample_index


def _token_aligned(
    values: list[np.ndarray], prompt_len: np.ndarray, response_len: np.ndarray, L: int, dtype: type
) -> np.ndarray:
    """Per-response-token ``values`` of N records placed at their tokens: (N, L) of ``dtype``, 0 outside the
    response."""
    arr = np.zeros((len(values), L), dtype=dtype)
    for n, row in enumerate(values):
        arr[n, prompt_len[n] : prompt_len[n] + response_len[n]] = row
    return arr


PER_TOKEN = {"advantages": ("token_advantage", np.float64), "teacher_logprobs": ("teacher_logprob", np.float32)}
"""Optional per-token record fields and the token-aligned (N, L) arrays they become."""


def _per_token(value: Any, at: str, field: str, n: int) -> np.ndarray:
    """Validate a per-token field of the record at ``at`` with one entry per response token (n)."""
    if field == "teacher_logprobs":
        values = _log_probs(value, at, field, allow_neg_inf=False).astype(np.float64)
    else:
        if not isinstance(value, list | tuple | np.ndarray) or not all(_is_number(x) for x in value):
            raise ValueError(f"{at}: '{field}' must be a list of numbers; got {value!r:.80}")
        values = np.asarray(value, dtype=np.float64)
        if not np.isfinite(values).all():
            raise ValueError(f"{at}: '{field}' has a non-finite value {values[~np.isfinite(values)][0]}")
    if len(values) != n:
        raise ValueError(f"{at}: '{field}' has {len(values)} entries for {n} response tokens")
    return values


def _topk_arrays(tops: list[list[tuple[np.ndarray, np.ndarray]]], T: int) -> dict[str, np.ndarray]:
    """Pack per-position top-k lists into (N, T, k) arrays and the tail mass (N, T)."""
    N = len(tops)
    k = max(len(ids) for row in tops for ids, _ in row)
    ids_arr = np.zeros((N, T, k), dtype=np.int32)
    logp_arr = np.zeros((N, T, k), dtype=np.float32)
    for n, row in enumerate(tops):
        for j, (ids, lp) in enumerate(row):
            ids_arr[n, j, :] = ids[0]  # padding repeats the first id with zero mass
            logp_arr[n, j, len(ids) :] = -np.inf
            ids_arr[n, j, : len(ids)] = ids
            logp_arr[n, j, : len(ids)] = lp
    lengths = np.array([len(row) for row in tops])
    live = np.arange(T)[None, :] < lengths[:, None]  # (N, T)
    tail = np.clip(1.0 - np.exp(logp_arr.astype(np.float64)).sum(-1), 0.0, None)
    return {
        "mu_topk_ids": ids_arr,
        "mu_topk_logp": logp_arr,
        "mu_tail": np.where(live, tail, 0.0).astype(np.float32),
    }


def require_mu_source(what: str, first_record: dict, on_policy: bool, mu_model: str | None) -> None:
    """ValueError naming ``what`` (the sampler's config section) when sampler-centred scores of imported
    rollouts would have no μ: not ``on_policy``, no ``mu_model`` and no ``top_logprobs`` in the records
    (every record has them or none, so the first record tells)."""
    if on_policy or mu_model is not None or "top_logprobs" in first_record:
        return
    raise ValueError(
        f"{what}: imported rollouts without top_logprobs give no sampler μ for sampler centering; set "
        f"{what}.on_policy: true if they were sampled from the policy (temperature 1, untruncated), or name "
        f"the sampler's checkpoint in {what}.mu_model"
    )


def record_mismatch(
    file_logp: np.ndarray, rescored_logp: np.ndarray, response_len: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-record mismatch between the log-probs a file holds and the ones a model recomputes.

    Args:
        file_logp: (n, T) log μ(y_t) from the file (``sampler_logp``), nats, 0 after each response's end.
        rescored_logp: (n, T) log-probs of the same tokens recomputed by a model, nats.
        response_len: (n,) int ≥ 1.

    Returns:
        ``kl`` (n,) = mean over the record's tokens of file − rescored (verl's ``kl`` estimator, per record),
        ``k3_kl`` (n,) = mean of ρ − log ρ − 1 with log ρ = rescored − file (non-negative, 0 iff equal),
        ``max_abs_diff`` (n,) = max |file − rescored|; all float64, nats per token.
    """
    f, r = np.asarray(file_logp, dtype=np.float64), np.asarray(rescored_logp, dtype=np.float64)
    live = np.arange(f.shape[1])[None, :] < np.asarray(response_len)[:, None]
    log_rho = np.where(live, r - f, 0.0)
    n = live.sum(1)
    return {
        "kl": (-log_rho).sum(1) / n,
        "k3_kl": np.where(live, np.expm1(log_rho) - log_rho, 0.0).sum(1) / n,
        "max_abs_diff": np.abs(log_rho).max(1),
    }


def verification_warning(what: str, where: list[str], k3_kl: np.ndarray, max_kl: float, model: str) -> str | None:
    """One warning line when some verified records' per-token k3-KL exceeds ``max_kl`` (else None).

    ``where`` names the verified records (``file:line``), ``k3_kl`` their values, ``model`` what re-scored them.
    """
    bad = np.flatnonzero(k3_kl > max_kl)
    if not bad.size:
        return None
    worst = int(bad[np.argmax(k3_kl[bad])])
    return (
        f"{what}: {bad.size} of {len(where)} verified records have per-token k3-KL above {max_kl:g} nats between "
        f"the file's log-probs and {model}'s (worst {where[worst]}: {k3_kl[worst]:.4g}); the dump's log-probs may "
        "come from another checkpoint, other sampling settings or an unsynced engine"
    )
