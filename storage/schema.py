"""Every store's schema: its name, arrays, dimensions, dtypes, chunks, coordinates and attributes.

One table per store (:data:`SCHEMAS`, keyed by the store's name) maps each array to a :class:`Var`.
Tasks create and write arrays only through :func:`create` and :func:`write`, so they pick no name,
dimension, dtype or chunk length of their own. Adding a store: a name constant, a table, an entry in
:data:`SCHEMAS`.

Names: a key is an array name, or a template such as ``trace_{mode}`` that covers every array whose
name fits it (exact names first). Chunks: one rule per dimension, :data:`WHOLE` (the whole extent),
:data:`PARAM` (:data:`PARAM_CHUNK` elements, at most the extent), :data:`ROWS` (the rows of one batch,
given by the writer) or a fixed length. Coordinates: an array that labels dimensions (``Var.labels``) is
named in the ``coordinates`` attribute of every other array of the store over one of those dimensions
(coordinates name each other, so a store with no data variable over ``tensor`` still has its tensor
table as coordinates), and ``xr.open_zarr`` opens it as a coordinate. Every array carries ``long_name``
and, where they say something, ``definition`` and ``units`` (DESIGN.md section 1; s = sequence score,
A = advantage, f_t = token Fisher at one position; means over the N samples with 1/N).

Coordinates of the flat parameter axis (DESIGN.md section 5), one row per tensor along dim ``tensor``:
``tensor_name`` (as in ``named_parameters()``), ``tensor_offset`` and ``tensor_numel`` (its run of
``param``). A per-tensor table, not a label per element: at P = 1e8 a name or an index per element is GBs
once loaded, while the table is a few kB and a tensor is a contiguous slice of ``param``, which xarray
selects lazily. Plain
xarray selects a tensor by name with no project import::

    ds = xr.open_zarr(path_of_stats_store)
    t = ds.isel(tensor=ds.tensor_name.values.tolist().index("model.layers.0.mlp.up_proj.weight"))
    F = ds.F.isel(param=slice(int(t.tensor_offset), int(t.tensor_offset + t.tensor_numel)))

Rollouts by prompt and sample, update-check cells by optimizer, precision, lr and steps::

    ro = xr.open_zarr(path_of_rollouts_store).set_index(sample=["prompt_index", "sample_index"])
    ro.reward.sel(prompt_index=3, sample_index=0)
    up = xr.open_zarr(path_of_update_store).set_index(cell=["optimizer", "precision", "lr", "steps"])
    up.frac_changed_bf16.sel(optimizer="adam", precision="bf16", steps=1)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from covgrad.layout import ParamLayout

ROLLOUTS = "rollouts.zarr"
SCORES = "scores.zarr"
STATS = "stats.zarr"
MASKS = "masks.zarr"
TOKENS = "tokens.zarr"
UPDATE = "update.zarr"
TRAJECTORY = "trajectory.zarr"
OFFPOLICY = "offpolicy.zarr"
OFFPOLICY_TABLE = "offpolicy"  # its tables: offpolicy.{json,csv,md}
REGIMES = "regimes.zarr"

PARAM_CHUNK = 65536  # elements per chunk along ``param`` (every (…, param) array of every store)
WHOLE = None  # chunk rule: the whole extent of the dimension
PARAM = "param"  # chunk rule: PARAM_CHUNK elements, at most the extent
ROWS = "rows"  # chunk rule: the rows of one batch, given by the writer (``rows=``)


@dataclass(frozen=True)
class Var:
    """One array of a store.

    Attributes:
        dims: dimension names, one per axis.
        dtype: numpy dtype name, ``"str"`` (variable-length text), or None: given by the writer (a
            stage's config, e.g. ``scores.state_dtype``, or the values written).
        chunks: the chunk rule per dimension (:data:`WHOLE`, :data:`PARAM`, :data:`ROWS` or a length).
        long_name: what the array is, in a few words.
        definition: how it is computed, where that is not obvious from ``long_name``.
        units: its units ("1" for ratios and fractions).
        fill: the fill value (None: zarr's default, the dtype's zero).
        compressed: False for data that does not compress (float noise); zarr's default codec otherwise.
        labels: the dimensions this array labels, which makes it a coordinate of the store's other arrays.
    """

    dims: tuple[str, ...]
    dtype: str | None
    chunks: tuple[int | str | None, ...]
    long_name: str
    definition: str = ""
    units: str = ""
    fill: Any = None
    compressed: bool = True
    labels: tuple[str, ...] = ()

    def attrs(self) -> dict[str, str]:
        """The array's attributes: long name, definition and units (those that are set)."""
        out = {"long_name": self.long_name, "definition": self.definition, "units": self.units}
        return {k: v for k, v in out.items() if v}


def param_chunk(P: int) -> int:
    """Chunk length along ``param`` of a store over P parameter elements."""
    return max(1, min(P, PARAM_CHUNK))


# ----- shared parts -------------------------------------------------------------------------------
TENSOR_TABLE = {
    "tensor_name": Var(
        ("tensor",), "str", (WHOLE,), "parameter tensor name (named_parameters())", labels=("param", "tensor")
    ),
    "tensor_offset": Var(("tensor",), "int64", (WHOLE,), "first param index of the tensor", labels=("param", "tensor")),
    "tensor_numel": Var(("tensor",), "int64", (WHOLE,), "elements of the tensor", labels=("param", "tensor")),
}
PROGRESS = {
    "batch_done": Var(
        ("batch",), "uint8", (1,), "batch done", "1 once the batch's data is written (one chunk per batch)"
    ),
}


def _state(long_name: str, definition: str, units: str = "") -> Var:
    """A moment-state array (row, param) of the scores store, in ``scores.state_dtype``, uncompressed:
    float noise does not compress, and the store keeps a fixed size, O(P) and independent of N."""
    return Var(("row", "param"), None, (2, PARAM), long_name, definition, units, fill=0, compressed=False)


def _cell(dtype: str | None, long_name: str, units: str = "", labels: tuple[str, ...] = ()) -> Var:
    """A column of the update-check grid, one value per (optimizer, precision, lr, steps) cell."""
    return Var(("cell",), dtype, (WHOLE,), long_name, units=units, labels=labels)


def _position(long_name: str, definition: str = "", units: str = "") -> Var:
    """A per-response-position array (sample, position) of the tokens store."""
    return Var(("sample", "position"), "float64", (ROWS, WHOLE), long_name, definition, units, fill=0)


# ----- one table per store ------------------------------------------------------------------------
# rollouts.zarr — dims: sample, token (index in the full right-padded row), position (response position),
# vocab, k (top-k entries of μ), batch.
ROLLOUTS_VARS = {
    "group": Var(
        ("sample",), "int32", (ROWS,), "prompt group", "samples of one group share a prompt", fill=0, labels=("sample",)
    ),
    "prompt_index": Var(
        ("sample",), "int32", (ROWS,), "prompt index", "row of the prompt in the task", fill=0, labels=("sample",)
    ),
    "sample_index": Var(
        ("sample",),
        "int32",
        (ROWS,),
        "sample index",
        "index of the sample within its group",
        fill=0,
        labels=("sample",),
    ),
    "tokens": Var(
        ("sample", "token"),
        "int32",
        (ROWS, WHOLE),
        "token ids",
        "prompt then response, right-padded to the longest prompt + max_new_tokens",
        "token id",
        fill=0,
    ),
    "response_mask": Var(
        ("sample", "token"),
        "bool",
        (ROWS, WHOLE),
        "response token mask",
        "True at the response tokens that are scored",
        fill=False,
    ),
    "prompt_len": Var(("sample",), "int32", (ROWS,), "prompt length", units="tokens", fill=0),
    "response_len": Var(("sample",), "int32", (ROWS,), "response length", units="tokens", fill=0),
    "reward": Var(("sample",), "float64", (ROWS,), "reward", "reward(prompt, response, answer)", fill=np.nan),
    "advantage": Var(("sample",), "float64", (ROWS,), "advantage", "A = reward minus its baseline (advantage_kind)"),
    "sampler_logp": Var(
        ("sample", "position"),
        "float32",
        (ROWS, WHOLE),
        "sampler log-probability",
        "log mu(y_t | y_<t) of each response token under the sampler",
        "nats",
        fill=0,
    ),
    "prompt": Var(("sample",), "str", (ROWS,), "prompt text", fill=""),
    "response": Var(("sample",), "str", (ROWS,), "response text", "decoded response tokens", fill=""),
    "mu_logp": Var(
        ("sample", "position", "vocab"),
        "float32",
        (ROWS, WHOLE, WHOLE),
        "sampler log-probabilities",
        "log mu(v | y_<t) over the vocabulary",
        "nats",
        fill=0,
    ),
    "mu_topk_ids": Var(
        ("sample", "position", "k"), "int32", (ROWS, WHOLE, WHOLE), "sampler top-k token ids", units="token id", fill=0
    ),
    "mu_topk_logp": Var(
        ("sample", "position", "k"),
        "float32",
        (ROWS, WHOLE, WHOLE),
        "sampler top-k log-probs",
        "log mu of the top-k tokens",
        "nats",
        fill=0,
    ),
    "mu_tail": Var(
        ("sample", "position"),
        "float32",
        (ROWS, WHOLE),
        "sampler mass outside the top k",
        "max(0, 1 - sum of exp(mu_topk_logp))",
        "1",
        fill=0,
    ),
    **PROGRESS,
}

# per-token fields of imported rollouts (covgrad.rollouts.imports.PER_TOKEN), token-aligned like ``tokens``
ROLLOUTS_VARS.update(
    {
        "token_advantage": Var(
            ("sample", "token"), "float64", (ROWS, WHOLE), "imported per-token advantage", "A_t of token t", fill=0
        ),
        "teacher_logprob": Var(
            ("sample", "token"), "float32", (ROWS, WHOLE), "imported teacher log-probability", "log q(y_t)", "nats"
        ),
    }
)

# what a stack's dump (covgrad.rollouts.formats) says about each imported record, written only when every record says it
ROLLOUTS_VARS.update(
    {
        "policy_version": Var(
            ("sample",), "int64", (ROWS,), "policy version", "training step / weight version that sampled it", fill=0
        ),
        "stack_advantage": Var(
            ("sample",), "float64", (ROWS,), "the stack's advantage", "sequence advantage from the dump", fill=0
        ),
        "sampling_params_index": Var(
            ("sample",),
            "int32",
            (ROWS,),
            "sampling parameter set",
            "entry of attrs import.sampling_params the record was sampled with (only when they mix)",
            fill=0,
        ),
        "verify_kl": Var(
            ("sample",),
            "float64",
            (ROWS,),
            "re-scored KL per token",
            "mean_t log mu_file - log p_rescored; NaN for records not re-scored",
            "nats",
            fill=np.nan,
        ),
        "verify_k3_kl": Var(
            ("sample",),
            "float64",
            (ROWS,),
            "re-scored k3-KL per token",
            "mean_t rho - log rho - 1, rho = p_rescored / mu_file; NaN for records not re-scored",
            "nats",
            fill=np.nan,
        ),
    }
)

# scores.zarr — dims: row (2 per sample shard: shard i's samples of the prompt groups with parity h at row
# 2i + h), param, sample, batch, shard, block. Checkpoint groups (ckpt/…, edges/…) hold the state arrays
# and ``batches``.
SCORES_VARS = {
    "count": Var(("row",), "float64", (2,), "samples folded into the row", "a regime fold: prompt groups", fill=0),
    "mean_a": Var(
        ("row",),
        "float64",
        (2,),
        "mean advantage of the row",
        "Chan-merged mean(A); a regime fold: mean group size",
        "advantage",
        fill=0,
    ),
    "m2_a": Var(("row",), "float64", (2,), "advantage second central moment sum", "sum((A - mean_a)^2)", fill=0),
    "mean_s": _state(
        "running mean score (moment state)",
        "Chan-merged mean(s) per row; a regime fold: mean of the groups' sums",
        "score",
    ),
    "mean_s_lo": _state("low half of mean_s", "mean(s) - mean_s, float32 state only", "score"),
    "m2_s": _state("score second central moment sum", "sum((s - mean_s)^2) per row", "score^2"),
    "c_as": _state("advantage-score co-moment sum", "sum((A - mean_a)(s - mean_s)) per row", "advantage*score"),
    "shard_batches": Var(
        ("shard", "block"),
        "int64",
        (1, 1),
        "batches in the job's final state",
        "written after job (shard, block) ends; -1 until then",
        fill=-1,
    ),
    "batches": Var(("checkpoint",), "int64", (WHOLE,), "batches in this checkpoint", "written last; -1: torn", fill=-1),
    "scores": Var(
        ("sample", "param"), "float32", (ROWS, PARAM), "per-sample score", "s_n, one row per sample", "score", fill=0
    ),
    "kl_sum": Var(
        ("batch",), "float64", (1,), "sum of KL(mu || p) over the batch's scored tokens", units="nats", fill=0
    ),
    "kl_tokens": Var(("batch",), "float64", (1,), "scored tokens of the batch", units="tokens", fill=0),
    "advantage": Var(("sample",), "float64", (WHOLE,), "advantage", "A of the rollouts", "advantage", fill=0),
    "group": Var(("sample",), "int64", (WHOLE,), "prompt group", fill=0, labels=("sample",)),
    **PROGRESS,
    **TENSOR_TABLE,
}

# a regime fold (tasks/regimes.py) is a scores store of the prompt groups' sums S_c of g_n, each folded as one row
# whose advantage is the group's size n_c (covgrad.moments.accum.GroupAccumulator: count = groups, mean_a = mean size,
# mean_s = mean S_c, c_as only for groups of several sizes) plus, dim half = the prompt-group parity, the Σ of its
# bound scalar c²_n (covgrad.regimes.cotangents) and the samples that had one
SCORES_VARS.update(
    {
        f"bound_{what}": Var(("batch", "half"), "float64", (1, WHOLE), text, definition, units, fill=0)
        for what, text, definition, units in (
            ("sum", "sum of the regime's bound scalar", "sum over the batch's samples of c2_n, per half", "c2"),
            ("count", "samples with a bound scalar", "per half; 0 for sft_sampled", "samples"),
        )
    }
)
# a full-distribution regime's fold with an untied, selected LM head in closed form (covgrad.regimes.fold)
SCORES_VARS["head_token_fisher"] = Var(
    ("half", "head_param"),
    "float64",
    (WHOLE, PARAM),
    "LM head token Fisher",
    "sum over the half's samples and scored positions of p_u(1 - p_u) h_j^2 / tau^2",
    "score^2",
    fill=0,
    compressed=False,
)

# stats.zarr — dims: param, tensor.
_PARAM_STAT = {
    "m": ("mean score", "mean(s)", "score"),
    "F": ("Fisher (uncentered)", "mean(s^2)", "score^2"),
    "Fvar": ("score variance", "Var(s) = F - m^2", "score^2"),
    "G": ("REINFORCE gradient", "mean(A*s)", "advantage*score"),
    "Cov": ("advantage-score covariance", "G - mean(A)*m", "advantage*score"),
    "rho": ("alignment", "Cov / (std(A)*sqrt(Fvar)), in [-1, 1]", "1"),
    "crossfit_ratio": (
        "cross-fit bound ratio",
        "|Cov| from one half of the prompt groups / (std(A)*sqrt(Fvar)) from the other",
        "1",
    ),
}
_TENSOR_STAT = {
    "tensor_F_sum": ("sum of F over the tensor", "score^2"),
    "tensor_F_mean": ("mean of F over the tensor", "score^2"),
    "tensor_F_share": ("the tensor's share of sum(F)", "1"),
    "tensor_Fvar_sum": ("sum of Fvar over the tensor", "score^2"),
    "tensor_Fvar_mean": ("mean of Fvar over the tensor", "score^2"),
    "tensor_absG_sum": ("sum of |G| over the tensor", "advantage*score"),
    "tensor_absG_mean": ("mean of |G| over the tensor", "advantage*score"),
    "tensor_absG_share": ("the tensor's share of sum(|G|)", "1"),
    "tensor_max_abs_rho": ("largest |rho| of the tensor (NaN when all are NaN)", "1"),
}
STATS_VARS = {
    **{n: Var(("param",), "float64", (PARAM,), *text) for n, text in _PARAM_STAT.items()},
    **{n: Var(("tensor",), "float64", (WHOLE,), name, units=units) for n, (name, units) in _TENSOR_STAT.items()},
    **TENSOR_TABLE,
}

# masks.zarr — dims: q (the top fraction), param, tensor.
_MASK_TEXT = {"F": "F", "absG": "|G|", "absrho": "|rho|"}
MASKS_VARS = {
    "q": Var(("q",), "float64", (WHOLE,), "top fraction of parameters", units="1"),
    **{
        f"{metric}_{scope}": Var(
            ("q", "param"),
            "bool",
            (1, PARAM),
            f"top-q mask by {text}" + (" within each tensor" if scope == "per_tensor" else ""),
            f"row q: the top-q fraction of parameters by {text}",
        )
        for metric, text in _MASK_TEXT.items()
        for scope in ("global", "per_tensor")
    },
    **TENSOR_TABLE,
}

# tokens.zarr — dims: sample, position (response position), param, batch, tensor.
TOKENS_VARS = {
    "entropy": _position("policy entropy at the position", "H(p(. | y_<t))", "nats"),
    "p_drawn": _position("policy probability of the drawn token", "p(y_t | y_<t)", "1"),
    "covered_mass": _position("policy mass of the candidate tokens", "1 except for mode topk", "1"),
    "trace_{mode}": _position("token Fisher trace", "sum over parameters of f_t", "score^2"),
    "score_sum_relerr": Var(
        ("sample",), "float64", (ROWS,), "token score sum check", "||sum_t s_t - s|| / ||s|| per sample", "1", fill=0
    ),
    "rows_{name}": Var(
        ("batch", "param"),
        "float64",
        (1, PARAM),
        "batch sum",
        "the batch's sum over samples (and positions) of the named quantity",
        "score^2",
        fill=0,
    ),
    "batch_count": Var(("batch",), "float64", (1,), "samples in the batch", fill=0),
    "lm_head_relerr": Var(
        ("batch",),
        "float64",
        (1,),
        "LM-head closed form against the backward",
        "relative L2 error (NaN when not checked)",
        "1",
        fill=np.nan,
    ),
    "fisher_seq": Var(("param",), "float64", (PARAM,), "sequence Fisher", "mean(s^2) over the samples", "score^2"),
    "fisher_{mode}": Var(("param",), "float64", (PARAM,), "token Fisher estimate", "sum of f_t / N", "score^2"),
    **PROGRESS,
    **TENSOR_TABLE,
}

# update.zarr — dims: cell (one per optimizer, precision, lr and steps), tensor. Columns of
# ``covgrad.updates.check.update_grid``; {metric} is bf16 (changed in bf16 / the weights' dtype) or abs (|Δ| > 1e-5).
UPDATE_VARS = {
    "regime": _cell("str", "regime whose loss the cell stepped (only with configured regimes)"),
    "optimizer": _cell("str", "optimizer", labels=("cell",)),
    "precision": _cell("str", "precision of weights and update", labels=("cell",)),
    "lr": _cell("float64", "learning rate", labels=("cell",)),
    "steps": _cell("int64", "optimizer steps taken", "steps", labels=("cell",)),
    "fresh_minibatches": _cell("bool", "each step takes the next minibatch"),
    "P": _cell("int64", "parameter elements"),
    "n_changed_{metric}": _cell("int64", "parameters changed"),
    "frac_changed_{metric}": _cell("float64", "fraction of parameters changed", "1"),
    "{metric}_{predictor}_precision": _cell("float64", "precision of the predicted set against the changed set", "1"),
    "{metric}_{predictor}_recall": _cell("float64", "recall of the predicted set against the changed set", "1"),
    "{metric}_{predictor}_jaccard": _cell("float64", "Jaccard of the predicted set and the changed set", "1"),
    # int64, or float64 when a rule does not apply to every cell (NaN there): the dtype of the values
    "{metric}_{predictor}_size": _cell(None, "size of the predicted set"),
    **TENSOR_TABLE,
}


# trajectory.zarr — dims: step (one per optimizer step, from 1), param_byte (ceil(P/8) bytes of a
# bit-packed (param,) set), threshold, tensor, decile (of |w| at step 0), count (steps changed, 0..K).
# Records of ``covgrad.updates.trajectory.run_trajectory``; {scope} is step (w_t != w_{t-1}) or cum (w_t != w_0),
# in the stored dtype; {predictor} a ranked predictor (F, absG, absrho, smallw, random, tensor_random,
# each of size k = the changed count) or a rule (absorb, bound).
def _per_step(dtype: str | None, long_name: str, definition: str = "", units: str = "", **kw: Any) -> Var:
    """A (step,) array of the trajectory store, one value per optimizer step."""
    return Var(("step",), dtype, (WHOLE,), long_name, definition, units, **kw)


TRAJECTORY_VARS = {
    "changed": Var(
        ("step", "param_byte"),
        "uint8",
        (1, PARAM),
        "changed set of the step, bit-packed",
        "np.packbits over param of w_t != w_{t-1} in the stored dtype (big-endian bit order)",
    ),
    "step": _per_step("int64", "optimizer step", "from 1", labels=("step",)),
    "lr": _per_step("float64", "learning rate of the step"),
    "loss": _per_step("float64", "the regime's loss before the step", "covgrad.updates.stepping.StepLoss"),
    "adv_rms": _per_step("float64", "the regime's bound scalar a on the step's samples", "rl: sqrt(mean A^2)"),
    "reward": _per_step("float64", "mean reward of the step's samples", "NaN on fixed data"),
    "kl": _per_step("float64", "KL to the start per token", "mean over response tokens of KL(p_t || p_0,t)", "nats"),
    "jaccard_prev": _per_step("float64", "Jaccard of this and the previous step's changed sets", "NaN at step 1", "1"),
    "n_changed_{scope}": _per_step("int64", "parameters changed"),
    "sign_flips_{scope}": _per_step("int64", "parameters whose sign changed"),
    "n_above_{scope}": Var(("step", "threshold"), "int64", (WHOLE, WHOLE), "parameters with |delta| > threshold"),
    "per_tensor_{scope}": Var(("step", "tensor"), "int64", (WHOLE, WHOLE), "parameters changed per tensor"),
    "{scope}_{predictor}_precision": _per_step("float64", "precision of the predicted set", units="1"),
    "{scope}_{predictor}_recall": _per_step("float64", "recall of the predicted set", units="1"),
    "{scope}_{predictor}_jaccard": _per_step("float64", "Jaccard of the predicted and the changed set", units="1"),
    "{scope}_{predictor}_size": _per_step(None, "size of the predicted set"),
    **{
        f"decile_{{scope}}_{{predictor}}_{stat}": Var(
            ("step", "decile"), "float64", (WHOLE, WHOLE), f"{stat} within a |w| decile", "k = the decile's count"
        )
        for stat in ("precision", "recall", "jaccard", "size")
    },
    "persist_hist": Var(
        ("step", "count"), "int64", (WHOLE, WHOLE), "parameters changed in exactly count of the first step steps"
    ),
    "grad_norm": _per_step("float64", "global L2 norm of the step's gradient before clipping"),
    "mismatch_{metric}": _per_step(
        "float64",
        "a rollout-mismatch metric the external run's trainer logged",
        "trajectory.history; the summary's history.keys names the stack's metric (storage.stores.history)",
    ),
    **PROGRESS,
    **TENSOR_TABLE,
    # k-step persistence (covgrad.updates.kstep): windows w_t -> w_{t+k}, t = 0..K-k (NaN past the end), per
    # grouping: all parameters, kind of tensor, tensor, |w_0| decile
    "k": Var(("k",), "int64", (WHOLE,), "window length in steps", labels=("k",)),
    "window": Var(("window",), "int64", (WHOLE,), "window start step t (0: the start weights)", labels=("window",)),
    "kind_name": Var(
        ("kind",), "str", (WHOLE,), "kind of tensor (embedding, attention, mlp, norm, other)", labels=("kind",)
    ),
    **{
        f"{measure}{suffix}": Var(
            ("k", "window", *dims), "float64", (WHOLE,) * (2 + len(dims)), long_name, definition, "1"
        )
        for suffix, dims in (("", ()), ("_kind", ("kind",)), ("_tensor", ("tensor",)), ("_decile", ("decile",)))
        for measure, long_name, definition in (
            ("dk", "k-step changed fraction d_k(t)", "fraction with w_{t+k} != w_t in the stored dtype"),
            ("independent", "d_k(t) of independent per-step sets", "1 - prod_{j=t}^{t+k-1} (1 - d_1(j))"),
        )
    },
    **{
        f"jaccard{suffix}": Var(
            ("step", dim),
            "float64",
            (WHOLE, WHOLE),
            "Jaccard of this and the previous step's changed sets",
            "within the group; NaN at step 1 and for empty unions",
            "1",
        )
        for suffix, dim in (("_kind", "kind"), ("_tensor", "tensor"), ("_decile", "decile"))
    },
    **{
        f"hist{suffix}": Var(
            (dim, "count"), "int64", (WHOLE, WHOLE), "parameters changed in exactly count of the steps"
        )
        for suffix, dim in (("_kind", "kind"), ("_tensor", "tensor"), ("_decile", "decile"))
    },
}


# offpolicy.zarr — dim row: one row per stats artifact, in the spec's order (the same rows are the tables
# ``offpolicy.{json,csv,md}`` beside the store); ``sampler`` and ``centering`` label the rows.
OFFPOLICY_VARS = {
    "sampler": Var(("row",), "str", (WHOLE,), "sampler (rollouts.samplers key)", labels=("row",)),
    "centering": Var(
        ("row",), "str", (WHOLE,), "score centering", "policy: grad log p; sampler: by mu", labels=("row",)
    ),
    "zero_mean_trace": Var(("row",), "float64", (WHOLE,), "zero-mean test, trace", "N*|m|^2 / tr Var(s)", "1"),
    "zero_mean_coord": Var(("row",), "float64", (WHOLE,), "zero-mean test, per coordinate", "mean N*m^2/Var", "1"),
    "rel_diff_G": Var(
        ("row",),
        "float64",
        (WHOLE,),
        "G under the two centerings",
        "|G_sampler - G_policy| / |G_sampler| (L2 over param) of the row's sampler; NaN if on-policy",
        "1",
    ),
    "rel_diff_stats": Var(
        ("row",),
        "float64",
        (WHOLE,),
        "statistics under the two centerings",
        "max over m, F, Fvar, G, Cov of |X_sampler - X_policy| / |X_sampler| (L2 over param); NaN if on-policy",
        "1",
    ),
    "kl_per_token": Var(("row",), "float64", (WHOLE,), "KL(mu || p) per response token", "0 when mu = p", "nats"),
    "max_abs_rho": Var(("row",), "float64", (WHOLE,), "max |rho|", "max |Cov| / (std(A)*sqrt(Fvar))", "1"),
    "bound_violations": Var(("row",), "int64", (WHOLE,), "bound violations", "count |Cov| > std(A)*sqrt(Fvar)"),
    "crossfit_frac_exceed": Var(
        ("row",), "float64", (WHOLE,), "cross-fit exceedances", "fraction of ratios > 1, F even groups, G odd", "1"
    ),
    "overlap_1pct": Var(("row",), "float64", (WHOLE,), "overlap at q = 0.01", "global top-1% by |G| and F", "1"),
    "sampler_weights": Var(
        ("row",),
        "str",
        (WHOLE,),
        "sampler weights",
        "policy: bitwise the scored policy's (model identities equal); other; unknown: no identity recorded",
    ),
    **{
        name: Var(("row",), "float64", (WHOLE,), long_name, definition, units)
        for name, long_name, definition, units in (
            ("rollout_probs_diff_mean", "mean probability gap", "mean_t |p(y_t) - mu(y_t)| (verl)", "1"),
            ("rollout_probs_diff_max", "max probability gap", "max_t |p(y_t) - mu(y_t)| (verl)", "1"),
            ("probs_pearson_corr", "Pearson correlation of probabilities", "corr(p(y_t), mu(y_t)) (verl)", "1"),
            ("verl_kl", "KL per token (verl kl)", "mean_t log mu(y_t) - log p(y_t)", "nats"),
            ("k3_kl", "k3-KL per token", "mean_t rho - log rho - 1, rho = p/mu (verl k3_kl)", "nats"),
            ("chi2_token", "chi-square per token", "mean_t rho^2 - 1 (verl chi2_token)", "1"),
            ("chi2_seq", "chi-square per sequence", "mean_n prod_t rho^2 - 1 (verl chi2_seq)", "1"),
            ("ppl_ratio", "perplexity ratio", "mean_n ppl_policy / ppl_sampler (verl ppl_ratio)", "1"),
        )
    },
    "finding": Var(("row",), "str", (WHOLE,), "degenerate condition", "why G has no finding, else empty"),
}

# regimes.zarr — dims: param, tensor; one array per regime and statistic (docs/regimes.md).
_REGIME_STAT = {
    "F": ("policy Fisher of the bounds", "mean(s^2) of the main scores' state", "score^2"),
    "G_{regime}": ("regime gradient", "mean(g_n)", "grad"),
    "se_{regime}": (
        "prompt-clustered standard error of G",
        "sqrt(C/(C-1) sum_c (S_c - n_c G)^2) / N over the C prompt groups c (S_c: sum of their g_n)",
        "grad",
    ),
    "bound_{regime}": (
        "regime bound",
        "a*sqrt(F), a^2 = mean c2_n, F of the main scores (an untied LM head of a full-distribution regime: its "
        "token Fisher at the regime's rows)",
        "grad",
    ),
    "rho_{regime}": ("regime alignment", "G / bound (NaN where the bound is 0)", "1"),
    "crossfit_ratio_{regime}": ("cross-fit ratio", "|G_h| / (a_h*sqrt(F_{1-h})), G from the even half", "1"),
}
REGIMES_VARS = {
    **{n: Var(("param",), "float64", (PARAM,), *text) for n, text in _REGIME_STAT.items()},
    **TENSOR_TABLE,
}

SCHEMAS: dict[str, dict[str, Var]] = {
    ROLLOUTS: ROLLOUTS_VARS,
    SCORES: SCORES_VARS,
    STATS: STATS_VARS,
    MASKS: MASKS_VARS,
    TOKENS: TOKENS_VARS,
    UPDATE: UPDATE_VARS,
    TRAJECTORY: TRAJECTORY_VARS,
    OFFPOLICY: OFFPOLICY_VARS,
    REGIMES: REGIMES_VARS,
}


# ----- access -------------------------------------------------------------------------------------
def _template(key: str) -> re.Pattern[str]:
    return re.compile(
        "".join(".+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{\w+\})", key))
    )


def var(store: str, name: str) -> Var:
    """The declaration of array ``name`` of store ``store``: its exact entry, else the template it fits
    with the most literal characters; KeyError naming the store otherwise."""
    table = SCHEMAS[store]
    if name in table:
        return table[name]
    fits = [k for k in table if "{" in k and _template(k).fullmatch(name)]
    if not fits:
        raise KeyError(f"{store} declares no array {name!r} (storage/schema.py)")
    return table[max(fits, key=lambda k: len(re.sub(r"\{\w+\}", "", k)))]


def coordinates(store: str, name: str) -> list[str]:
    """The coordinates of array ``name``: the store's arrays that label one of its dimensions."""
    dims = set(var(store, name).dims)
    return [c for c, v in SCHEMAS[store].items() if c != name and set(v.labels) & dims]


def create(
    g: Any,
    store: str,
    name: str,
    shape: Sequence[int],
    *,
    dtype: Any = None,
    rows: int | None = None,
    overwrite: bool = False,
) -> Any:
    """Create array ``name`` of ``store`` in zarr group ``g`` as declared (an existing one is returned
    as it is, unless ``overwrite``).

    Args:
        g: the store's zarr group (or a checkpoint group inside it).
        store: the store's name, a key of :data:`SCHEMAS`.
        name: the array's name (declared exactly or by a template).
        shape: one extent per declared dimension.
        dtype: the dtype, for arrays declared with ``dtype=None`` only.
        rows: the chunk length along a :data:`ROWS` dimension (the rows of one batch).
        overwrite: replace an existing array.

    Returns:
        The zarr array, with its attributes and ``coordinates`` set.

    Raises:
        ValueError: the shape, dtype or rows do not fit the declaration.
    """
    if name in g and not overwrite:
        return g[name]
    v = var(store, name)
    if len(shape) != len(v.dims):
        raise ValueError(f"{store} {name}: shape {tuple(shape)} does not match its dims {v.dims}")
    if (dtype is None) == (v.dtype is None):
        raise ValueError(f"{store} {name}: give a dtype exactly when the schema leaves it open (declared {v.dtype})")
    if ROWS in v.chunks and rows is None:
        raise ValueError(f"{store} {name}: chunked by batch rows; pass rows=")
    chunks = tuple(
        n if rule is WHOLE else param_chunk(n) if rule == PARAM else rows if rule == ROWS else rule
        for rule, n in zip(v.chunks, shape, strict=True)
    )
    kind = dtype if v.dtype is None else str if v.dtype == "str" else v.dtype
    arr = g.create_array(
        name,
        shape=tuple(shape),
        chunks=tuple(max(1, c) for c in chunks),
        dtype=kind,
        fill_value=v.fill,
        dimension_names=list(v.dims),
        overwrite=overwrite,
        **({} if v.compressed else {"compressors": None}),
    )
    attrs: dict[str, Any] = v.attrs()
    coords = coordinates(store, name)
    if coords:
        attrs["coordinates"] = " ".join(coords)
    arr.attrs.update(attrs)
    return arr


def write(g: Any, store: str, name: str, values: Any, *, rows: int | None = None, overwrite: bool = False) -> Any:
    """Create array ``name`` of ``store`` in ``g`` with the shape of ``values`` and write them (in the
    declared dtype, or theirs where the schema leaves it open)."""
    values = np.asarray(values)
    v = var(store, name)
    arr = create(
        g, store, name, values.shape, dtype=values.dtype if v.dtype is None else None, rows=rows, overwrite=overwrite
    )
    arr[...] = values
    return arr


def annotate(g: Any, store: str, layout: ParamLayout) -> None:
    """Write the tensor table of the flat parameter axis into zarr group ``g`` of ``store`` as
    coordinates along dim ``tensor`` (``tensor_name`` text, ``tensor_offset`` and ``tensor_numel``)."""
    entries = layout.entries
    write(g, store, "tensor_name", np.asarray([e.name for e in entries], dtype=str), overwrite=True)
    write(g, store, "tensor_offset", np.asarray([e.offset for e in entries], dtype=np.int64), overwrite=True)
    write(g, store, "tensor_numel", np.asarray([e.numel for e in entries], dtype=np.int64), overwrite=True)
