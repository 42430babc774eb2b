"""Loading and saving Hugging Face models and tokenizers (storage owns every path)."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from storage.weights import check_weights

if TYPE_CHECKING:  # torch and transformers load lazily: checking a directory must not wait for them
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from storage.artifacts import ArtifactRef, ArtifactStore

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_dir(path: str, what: str) -> None:
    """FileNotFoundError / ValueError naming ``path`` (as ``what``) unless it is a Hugging Face causal-LM
    directory (:func:`is_causal_lm`) with complete weights; reads only config.json, the file listing and
    safetensors headers."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{what} {path!r} does not exist; give a Hugging Face model directory")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{what} {path!r} has no config.json; it is not a Hugging Face model directory")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path!r}: config.json is not valid JSON ({exc.msg})") from None
    if not is_causal_lm(config):
        raise ValueError(
            f"{what} {path!r} is not a causal LM (model_type={config.get('model_type')!r}, "
            f"architectures={config.get('architectures') or []}): transformers' AutoModelForCausalLM does not "
            "build it, or its weights are another head's"
        )
    if not any((root / w).is_file() for w in _WEIGHT_FILES):
        raise ValueError(f"{what} {path!r} has no weights ({', '.join(_WEIGHT_FILES)})")
    check_weights(root)


def is_causal_lm(config: dict[str, Any]) -> bool:
    """Whether ``AutoModelForCausalLM`` loads the model of config.json ``config`` with its own weights: its
    ``auto_map`` names an ``AutoModelForCausalLM`` (custom code), or its ``model_type`` is in transformers'
    mapping (:func:`causal_lm_classes`) and its ``architectures``, when listed, hold a class with an LM head: one of
    that mapping (``LlamaForCausalLM``, ``Gemma3ForConditionalGeneration``) or a name an older transformers gave
    one (``…ForCausalLM``, ``…LMHeadModel``); not ``LlamaForSequenceClassification``, whose checkpoint has no LM
    head."""
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        return True
    mapping = causal_lm_classes()
    archs = config.get("architectures") or []
    classes = set(mapping.values())
    headed = not archs or any(a in classes or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    return config.get("model_type") in mapping and headed


# transformers' causal-LM mapping as a literal in models/auto/modeling_auto.py: its entries, ("model_type", "Class").
_CAUSAL_LM_MAPPING = re.compile(r"^MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict\(\s*\[(.*?)^\s*\]\s*\)", re.S | re.M)
_PAIR = re.compile(r'\(\s*"([^"]+)"\s*,\s*"([^"]+)"\s*,?\s*\)')


@functools.cache
def causal_lm_classes() -> dict[str, str]:
    """transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model_type -> the class ``AutoModelForCausalLM``
    builds), read from the installed transformers' ``models/auto/modeling_auto.py`` without importing it (importing
    transformers' auto classes imports torch: seconds, where a directory check takes milliseconds); imported when
    that file does not hold it as a list of string pairs. Read as text, not with ``ast.parse``: CPython 3.11's AST
    construction can fail spuriously in a threaded process ("AST constructor recursion depth mismatch", CPython
    gh-106905), which a Prefect worker's flow run hit here."""
    spec = importlib.util.find_spec("transformers")
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py" if spec and spec.origin else None
    if source is not None and source.is_file() and (found := _CAUSAL_LM_MAPPING.search(source.read_text())):
        body = re.sub(r"#[^\n]*", "", found[1])
        pairs = _PAIR.findall(body)
        if pairs and not _PAIR.sub("", body).replace(",", "").strip():  # nothing but the pairs
            return dict(pairs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_context(path: str, setting: int | None = None) -> int | None:
    """The context (positions) of the model directory ``path``: its config.json's, else its
    tokenizer_config.json's ``model_max_length`` unless unbounded, else ``setting`` (the run's
    ``model.max_length``): :func:`covgrad.rollouts.inputs.context_of`, as the stages tell it from the loaded
    model and tokenizer (:func:`covgrad.models.context_length`); None when none of them does."""
    from covgrad.rollouts.inputs import context_of

    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    tok_file = root / "tokenizer_config.json"
    try:
        tok = json.loads(tok_file.read_text()) if tok_file.is_file() else {}
    except json.JSONDecodeError:
        tok = {}
    return context_of(config, tok.get("model_max_length") if isinstance(tok, dict) else None, setting)


_WARNED: set[str] = set()


def warn_custom_code(path: str, trust_remote_code: bool) -> str | None:
    """When the model directory ``path`` names custom code (``auto_map`` in its config.json) and
    ``trust_remote_code`` is off, the one warning line saying that transformers' built-in class of its
    ``model_type`` is used instead, logged to the ``covgrad`` logger once per directory and process and returned
    (None otherwise)."""
    config = json.loads((Path(path) / "config.json").read_text())
    auto_map = config.get("auto_map")
    if trust_remote_code or not auto_map:
        return None
    classes = ", ".join(sorted(str(v) for v in auto_map.values())) if isinstance(auto_map, dict) else str(auto_map)
    line = (
        f"model path {path!r} names custom code (auto_map: {classes}) but model.trust_remote_code is off: "
        f"transformers' built-in {config.get('model_type')!r} class runs instead, which may not be this model; set "
        "model.trust_remote_code: true to run the directory's code"
    )
    if (where := str(Path(path).resolve())) not in _WARNED:
        _WARNED.add(where)
        logging.getLogger("covgrad").warning(line)
    return line


def load_model(
    path: str | Path, dtype: str = "float32", trust_remote_code: bool = False, meta: bool = False
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` in eval mode; with ``meta`` the
    same model built from its config on the meta device (shapes, names and ties, no storage and no weights
    read: a rank that receives its shard of the weights from rank 0, :func:`covgrad.distributed.fsdp.shard_from_rank0`).

    FileNotFoundError naming the path when it is missing; ValueError when it is not a causal LM, or (checked once
    per load of the weights, :func:`covgrad.models.check_finite_weights`) when a weight is NaN or ±inf.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from covgrad.models import check_causal_lm, check_finite_weights

    check_model_dir(str(path), "model path")
    warn_custom_code(str(path), trust_remote_code)
    transformers_logging.disable_progress_bar()  # no "Loading weights" bar in a worker's log
    root = Path(path)
    options = {"trust_remote_code": trust_remote_code, "dtype": getattr(torch, dtype), "attn_implementation": "eager"}
    try:
        if meta:
            config = AutoConfig.from_pretrained(str(root), local_files_only=True, trust_remote_code=trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, **options)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(root), local_files_only=True, **options)
    except ValueError as exc:
        arch = json.loads((root / "config.json").read_text()).get("architectures")
        raise ValueError(f"model path {str(path)!r} ({arch}) is not a causal LM: {str(exc).splitlines()[0]}") from None
    check_causal_lm(model, f"model path {str(path)!r}")
    if not meta:
        check_finite_weights(model.named_parameters(), f"model path {str(path)!r}")
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved next to a model (``AutoTokenizer.from_pretrained(path)``)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer found in {str(path)!r}: {str(exc).splitlines()[0]}") from None


def load_model_and_tokenizer(
    path: str | Path, dtype: str = "float32", trust_remote_code: bool = False, meta: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from covgrad.models import check_vocab

    model = load_model(path, dtype, trust_remote_code, meta)
    tok = load_tokenizer(path)
    check_vocab(model, tok, f"model path {str(path)!r}")
    return model, tok


class ModelSource(Protocol):
    """How a stage loads the policy (``tasks.specs.PolicySpec``): a user model directory or None (the
    demo model of the base_model artifact), in ``dtype``."""

    path: str | None
    dtype: str
    trust_remote_code: bool


def load_models(
    store: ArtifactStore, base: ArtifactRef, which: str, policy: ModelSource, meta: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy (``which='policy'``), the demo's stale checkpoint (``'stale'``) or another model
    directory given by path, with the tokenizer saved beside it, in eval mode, as ``policy`` says (on the
    meta device with ``meta``: :func:`load_model`)."""
    dtype, trust = policy.dtype, policy.trust_remote_code
    if which == "policy" and policy.path is not None:
        return load_model_and_tokenizer(policy.path, dtype, trust, meta)
    if which in ("policy", "stale"):
        with store.local_dir(base, which, write=False) as d:
            return load_model_and_tokenizer(d, dtype, trust, meta)
    return load_model_and_tokenizer(which, dtype, trust, meta)


def vocab_size(model: PreTrainedModel) -> int:
    """The rows of a model's output embedding: the vocabulary its logits cover."""
    return int(model.get_output_embeddings().weight.shape[0])


def load_fixed_model(
    store: ArtifactStore,
    base: ArtifactRef,
    which: str,
    policy: ModelSource,
    *,
    regime: str,
    role: str,
    policy_vocab: int,
    trained: ArtifactRef | None = None,
    meta: bool = False,
) -> PreTrainedModel:
    """A regime's teacher or reference ``which``, loaded as ``policy`` says (:func:`load_models`: ``policy``,
    ``stale`` or a model directory; ``trained``: the teacher stage's artifact ``trained``), in eval mode, on the
    meta device with ``meta``.

    Raises:
        ValueError: naming regime ``regime`` and the ``role`` (teacher or reference), when ``which`` is
            ``trained`` with no teacher artifact, or the model's vocabulary is not ``policy_vocab``.
    """
    if which == "trained":
        if trained is None:
            raise ValueError(f"regime {regime}: teacher trained needs the teacher stage's artifact upstream")
        with store.local_dir(trained, "teacher", write=False) as d:
            model = load_model_and_tokenizer(d, policy.dtype, policy.trust_remote_code, meta)[0]
    else:
        model = load_models(store, base, which, policy, meta)[0]
    if vocab_size(model) != policy_vocab:
        raise ValueError(
            f"regime {regime}: the {role} {which!r} has vocabulary {vocab_size(model)}, the policy {policy_vocab}"
        )
    return model


def load_rank_policy(
    store: ArtifactStore, base: ArtifactRef, policy: ModelSource, device: torch.device, meta: bool = False
) -> PreTrainedModel:
    """The policy of one process of a stage: with no process group, loaded with its weights onto ``device``; in
    a group (a sharded stage), rank 0 loads the weights into host memory, where the group traces and shards it
    (:func:`covgrad.distributed.fsdp.shard_from_rank0`: FSDP2 moves each module's shard to the rank's device as it
    shards
    it, so no device ever holds the whole model), and the other ranks build it on the meta device, as does every
    process with ``meta`` (one that needs only the model's modules and shapes: the task's process of a sharded
    stage)."""
    import torch.distributed as dist

    from covgrad.distributed import loads_weights

    weights = loads_weights() and not meta
    model = load_models(store, base, "policy", policy, meta=not weights)[0]
    return model.to(device) if weights and not dist.is_initialized() else model
