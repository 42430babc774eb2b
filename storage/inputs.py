"""The preflight's checks of the files a config names besides the policy's own directory: input files (a task's
prompts, imported rollouts), the other model directories a run loads (a sampler's model, μ's checkpoint, a regime's
teacher and reference) against the policy (vocabulary size and tokenizer), weights that need pickle, and an external
run's checkpoint series and in-run series. Every failure is one line naming the file.

Only file names, ``config.json``, safetensors headers and tokenizer files are read; torch is imported only for a
model directory whose weights are pickle files (``pytorch_model.bin``), to ask ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.models import check_model_dir
from storage.stores.external import WEIGHT_FILES, checkpoint_series
from storage.stores.inrun import inrun_series

if TYPE_CHECKING:
    from covgrad.config import DemoModel
    from covgrad.layout import ParamLayout

GZIP_MAGIC = b"\x1f\x8b"  # the first two bytes of every gzip stream (RFC 1952)
# the files a tokenizer is loaded from: tokenizer.json with the tokenizers library, the others with transformers
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
# the config.json keys every checkpoint of a series shares with the policy: its architecture and shapes
SERIES_KEYS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_WARNED: set[tuple[str, str]] = set()


def check_input_file(path: str, what: str) -> None:
    """FileNotFoundError unless the local file ``path`` (setting ``what``) exists; ValueError, naming it, when it
    is not a regular file (a directory, FIFO, device or socket: it is never opened) or, unless it is parquet, is
    gzip-compressed (its first bytes are 1f 8b), which the JSONL readers would read as text. An fsspec URL is left to
    its reader, which names it."""
    if "://" in path:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None
    except OSError as err:
        raise ValueError(f"{what} {path!r} cannot be read: {err.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a plain file")
        raise ValueError(f"{what} {path!r} is not a regular file ({kind}); give a JSONL or parquet file")
    if path.rstrip("/").endswith(".parquet"):
        return
    try:
        with open(path, "rb") as f:
            head = f.read(len(GZIP_MAGIC))
    except OSError as err:
        raise ValueError(f"{what} {path!r} cannot be read: {err.strerror}") from None
    if head == GZIP_MAGIC:
        raise ValueError(
            f"{what} {path!r} is gzip-compressed (it starts with the bytes 1f 8b) and covgrad reads plain JSONL: "
            f"decompress it (gunzip -c {path} > plain.jsonl) and point {what} at the plain file"
        )


def read_config(path: str | Path) -> dict[str, Any]:
    """A model directory's config.json (its directory was checked by ``storage.models.check_model_dir``)."""
    return json.loads((Path(path) / "config.json").read_text())


@dataclass(frozen=True)
class Tokenizer:
    """What two tokenizers must share to read the same token ids alike, and what they may differ in.

    Attributes:
        vocab: token -> id, added and special tokens included.
        roles: bos_token, eos_token, unk_token, pad_token -> that token's text (None: unset).
        template: the chat template (text; several named templates as JSON), None when there is none.
    """

    vocab: dict[str, int]
    roles: dict[str, str | None]
    template: str | None


@dataclass
class PolicyRef:
    """The policy a config's other models are checked against.

    Attributes:
        where: how a message names it (``model.path '/m'`` or ``the demo policy``).
        path: its model directory; None for the demo, whose tokenizer is covgrad's character tokenizer.
        config: its config.json (the demo: the keys of :data:`SERIES_KEYS` of the tiny Llama it builds).
    """

    where: str
    path: str | None
    config: dict[str, Any]

    @classmethod
    def of(cls, model_path: str | None, demo: DemoModel | None) -> PolicyRef:
        """The policy of a config's ``model`` section: ``model.path`` (checked already), or the demo built from
        ``demo`` (``covgrad.models.build_demo_model``'s sizes)."""
        if model_path is not None:
            return cls(f"model.path {model_path!r}", model_path, read_config(model_path))
        if demo is None:
            raise ValueError("the demo policy needs its model.demo section")
        from covgrad.rollouts import char_tokenizer

        config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": char_tokenizer().get_vocab_size(),
            "hidden_size": demo.hidden_size,
            "num_hidden_layers": demo.num_layers,
            "intermediate_size": demo.intermediate_size,
            "num_attention_heads": demo.num_heads,
            "num_key_value_heads": demo.num_heads,
        }
        return cls("the demo policy", None, config)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The policy's tokenizer, read on first use."""
        if self.path is not None:
            return read_tokenizer(self.path, "model.path")
        from covgrad.rollouts import char_tokenizer
        from covgrad.rollouts.problems import BOS, EOS, PAD, UNK

        roles = dict(zip(SPECIAL_ROLES, (BOS, EOS, UNK, PAD), strict=True))
        return Tokenizer(char_tokenizer().get_vocab(with_added_tokens=True), roles, None)


def read_tokenizer(path: str, what: str) -> Tokenizer:
    """The tokenizer saved in model directory ``path`` (setting ``what``): from tokenizer.json with the tokenizers
    library (fast), else with ``transformers.AutoTokenizer`` as the stages load it; ValueError naming the directory
    when it holds no tokenizer or one that does not load."""
    root = Path(path)
    found = [n for n in TOKENIZER_FILES if (root / n).is_file()]
    if not found:
        raise ValueError(
            f"{what} {path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); covgrad loads the tokenizer saved "
            "beside each model: save it there (tokenizer.save_pretrained)"
        )
    try:
        if found[0] == "tokenizer.json":
            from tokenizers import Tokenizer as Fast

            vocab = Fast.from_file(str(root / "tokenizer.json")).get_vocab(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            vocab = AutoTokenizer.from_pretrained(str(root), local_files_only=True).get_vocab()
    except Exception as err:  # the tokenizers and transformers loaders raise many kinds on a bad file
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"{what} {path!r}: its tokenizer does not load ({type(err).__name__}: {first})") from None
    return Tokenizer(vocab, *_roles_and_template(root))


def _roles_and_template(root: Path) -> tuple[dict[str, str | None], str | None]:
    """The special-token roles (tokenizer_config.json, then special_tokens_map.json over it, as transformers reads
    them) and the chat template (tokenizer_config.json's, or chat_template.jinja) of a tokenizer's directory."""
    settings: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (root / name).is_file():
            try:
                settings.update(json.loads((root / name).read_text()))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{root / name} is not valid JSON ({err})") from None
    roles = {}
    for role in SPECIAL_ROLES:
        value = settings.get(role)
        roles[role] = value.get("content") if isinstance(value, dict) else value
    template = settings.get("chat_template")
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    return roles, template if template is None or isinstance(template, str) else json.dumps(template, sort_keys=True)


def tokenizer_difference(policy: dict[str, int], other: dict[str, int]) -> str | None:
    """None when the two token -> id maps are equal, else the first difference in id order, in words:
    ``id 5 is '1' in the policy's tokenizer and '2' in this one, which has '1' at id 6 (2 ids differ)``."""
    if policy == other:
        return None
    by_id = {i: t for t, i in policy.items()}, {i: t for t, i in other.items()}
    ids = sorted(set(by_id[0]) | set(by_id[1]))
    differ = [i for i in ids if by_id[0].get(i) != by_id[1].get(i)]
    if not differ:  # equal id -> token maps, unequal token -> id maps: a token listed twice under one id
        token = min(set(policy) ^ set(other) or {t for t in policy if policy[t] != other.get(t)})
        return f"token {token!r} is in one tokenizer only"
    i = differ[0]
    mine, theirs = by_id[0].get(i), by_id[1].get(i)
    text = f"id {i} is {_token(mine)} in the policy's tokenizer and {_token(theirs)} in this one"
    if mine is not None and mine in other:
        text += f", which has {mine!r} at id {other[mine]}"
    return f"{text} ({len(differ)} {'id differs' if len(differ) == 1 else 'ids differ'})"


def _token(token: str | None) -> str:
    """A token as a message quotes it; ``absent`` for an id a tokenizer does not use."""
    return "absent" if token is None else repr(token)


def check_tokenizer(path: str, what: str, policy: PolicyRef) -> list[str]:
    """ValueError, naming model directory ``path`` (setting ``what``) and the first differing ids, unless its
    tokenizer maps every token to the policy's id: the stages score its logits at the policy's token ids. Returns
    the warning lines (logged to the ``covgrad`` logger once per directory) for what may differ: the special-token
    roles (an instruct model's eos is not its base model's) and the chat template (covgrad reads neither)."""
    if policy.path is not None and Path(path).resolve() == Path(policy.path).resolve():
        return []
    mine, theirs = policy.tokenizer, read_tokenizer(path, what)
    differ = tokenizer_difference(mine.vocab, theirs.vocab)
    if differ is not None:
        raise ValueError(
            f"{what} {path!r}: its tokenizer is not the policy's ({policy.where}): {differ}; a model scored at the "
            "policy's token ids must share its tokenizer"
        )
    lines = [
        f"{what} {path!r}: {role} is {theirs.roles[role]!r}, the policy's {mine.roles[role]!r}; covgrad samples, "
        f"stops and pads with the policy's tokenizer ({policy.where})"
        for role in SPECIAL_ROLES
        if theirs.roles[role] != mine.roles[role]
    ]
    if theirs.template != mine.template:
        lines.append(f"{what} {path!r}: its chat template differs from the policy's; covgrad applies neither")
    for line in lines:
        if (key := (what, line)) not in _WARNED:
            _WARNED.add(key)
            logging.getLogger("covgrad").warning(line)
    return lines


def check_companion(path: str, what: str, policy: PolicyRef) -> list[str]:
    """A model directory a run loads besides the policy (a sampler's model, μ's checkpoint, a regime's teacher or
    reference): a causal LM with complete weights (``storage.models.check_model_dir``) that need no pickle, the
    policy's vocabulary size (config.json) and tokenizer (:func:`check_tokenizer`, whose warnings it returns);
    FileNotFoundError or ValueError in one line naming ``what`` and ``path``."""
    check_model_dir(path, what)
    v, pv = read_config(path).get("vocab_size"), policy.config.get("vocab_size")
    if isinstance(v, int) and isinstance(pv, int) and v != pv:
        raise ValueError(
            f"{what} {path!r} has vocabulary {v}, the policy {pv} ({policy.where}): a model scored at the policy's "
            "token ids must share its vocabulary"
        )
    check_pickle_free(path, what)
    return check_tokenizer(path, what, policy)


def pickle_files(path: str | Path) -> list[Path]:
    """The pickle weight files (``.bin``) a model directory is loaded from: none when it has safetensors (which
    transformers prefers), else ``pytorch_model.bin`` or the shards of ``pytorch_model.bin.index.json``."""
    root = Path(path)
    if any((root / n).is_file() for n in WEIGHT_FILES if "safetensors" in n):
        return []
    if (root / "pytorch_model.bin").is_file():
        return [root / "pytorch_model.bin"]
    index = root / "pytorch_model.bin.index.json"
    if not index.is_file():
        return []
    try:
        shards = json.loads(index.read_text())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"weights index {index} is not valid JSON with a weight_map") from None
    return [root / s for s in dict.fromkeys(shards)]


def pickle_message(file: str | Path | None, err: BaseException) -> str:
    """The one line for a weights file that ``torch.load(weights_only=True)`` refuses (``err``): which file, why
    (the global it names) and how to proceed."""
    said = re.search(r"WeightsUnpickler error: ([^\n]*?)(?:\.\s|\.?$)", str(err), re.MULTILINE)
    why = said[1] if said else (str(err).strip().splitlines() or [type(err).__name__])[0]
    where = f"weights file {file}" if file is not None else "a weights file"
    return (
        f"{where} needs pickle to load (torch.load(weights_only=True) refuses it: {why}); convert it to "
        "safetensors where you trust its source (torch.load(weights_only=False), then safetensors.torch.save_file "
        "or save_pretrained) and point covgrad at the converted directory"
    )


def check_pickle_free(path: str | Path, what: str) -> None:
    """ValueError naming the file (:func:`pickle_message`) when a ``.bin`` weights file of model directory ``path``
    needs more than ``torch.load(weights_only=True)`` allows, or does not load at all. Memory-mapped where the file
    is a zip archive (torch's format since 1.6), so only its pickle is read."""
    files = pickle_files(path)
    if not files:
        return
    import pickle

    import torch

    for f in files:
        try:
            torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
        except pickle.UnpicklingError as err:
            raise ValueError(f"{what} {str(path)!r}: {pickle_message(f, err)}") from None
        except Exception as err:  # torch.load raises many kinds on a truncated or foreign file
            first = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(
                f"{what} {str(path)!r}: weights file {f} does not load ({type(err).__name__}: {first})"
            ) from None


def check_series(path: str, what: str, policy: PolicyRef) -> None:
    """An external run's checkpoint series (``storage.stores.external.checkpoint_series``: its layout, one folder per
    step, each with config.json and weights, manifest paths inside the series folder), each checkpoint a causal LM
    with complete weights that need no pickle, of the policy's architecture, shapes and vocabulary
    (:data:`SERIES_KEYS` that both config.json files state). ValueError in one line naming the checkpoint."""
    for t, d in checkpoint_series(path).checkpoints:
        where = f"{what} step {t}"
        check_model_dir(d, where)
        config = read_config(d)
        for key in SERIES_KEYS:
            if key in config and key in policy.config and config[key] != policy.config[key]:
                raise ValueError(
                    f"{where} {d!r}: config.json has {key} {config[key]!r}, the policy's ({policy.where}) "
                    f"{policy.config[key]!r}; every checkpoint of the series must be a step of the policy's run"
                )
        check_pickle_free(d, where)


def check_inrun(path: str, layout: ParamLayout | None = None) -> None:
    """An external run's in-run series (``trajectory.inrun``; ``storage.stores.inrun.inrun_series``: its index and
    every folded step's npz, headers only) and, with ``layout`` (the policy's selected parameters), that it holds
    every tensor of ``layout`` with its shape. ValueError (FileNotFoundError for a missing folder) in one line naming
    the file."""
    series = inrun_series(path)
    if layout is not None:
        series.columns(layout)
