"""The spec machinery: the typed instance names, the :class:`StageSpec` base that computes an artifact's key from
its spec, and the :class:`Later` mark of fields that arrived after keys existed.

Key = sha256(stage name, stage code version, hashed spec, upstream keys) (``storage.artifacts.stage_key``). Fields
listed in a spec's ``PLACEMENT`` say where or how the work runs and never change a byte (device, checkpoint
cadence, parameter blocks, ranks, the dask scheduler): the task reads them, the completion marker records them,
the key leaves them out. A field marked :class:`Later` arrived after keys existed: while it holds what earlier
specs meant, the key (and with ``recorded`` the recorded spec) leaves it out, so every earlier key stays what it
was.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from covgrad.config import Dtype
from storage.artifacts import stage_key

if TYPE_CHECKING:
    from covgrad.distributed import Placement as LaunchPlacement

Centering = Literal["policy", "sampler"]


class Instance(NamedTuple):
    """The typed name of one planned artifact: a stage, and for per-sampler stages the sampler (and the
    score centering). ``str()`` gives the dotted name of run indexes: ``scores.stale.sampler``."""

    stage: str
    sampler: str | None = None
    centering: Centering | None = None

    def __str__(self) -> str:
        return ".".join(p for p in self if p is not None)


@dataclass(frozen=True, init=False)
class Later:
    """The mark of a spec field (``Annotated[T, Later(...)]``), or of its member ``at`` (a dotted path inside it),
    that arrived after artifact keys existed: the key leaves it out while the field ``when`` (a dotted path from the
    spec; default: the marked one) holds one of ``values``, so that every key computed before it arrived stays
    what it was. ``recorded``: the spec that claims and completion markers record leaves it out too (it stays what
    earlier runs recorded)."""

    values: tuple[Any, ...]
    at: str | None
    when: str | None
    recorded: bool

    def __init__(self, *values: Any, at: str | None = None, when: str | None = None, recorded: bool = False) -> None:
        for name, value in (("values", values), ("at", at), ("when", when), ("recorded", recorded)):
            object.__setattr__(self, name, value)


_ABSENT = object()


def _lookup(data: dict[str, Any], path: str) -> Any:
    """The value at dotted ``path`` in the JSON object ``data`` (``_ABSENT`` where there is none)."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _remove(data: dict[str, Any], path: str) -> None:
    """Remove dotted ``path`` from the JSON object ``data`` in place (nothing when ``data`` lacks it)."""
    *parents, name = path.split(".")
    node = _lookup(data, ".".join(parents)) if parents else data
    if isinstance(node, dict):
        node.pop(name, None)


def leave_out_later(data: dict[str, Any], marks: Iterable[tuple[str, Later]]) -> dict[str, Any]:
    """Remove from the dumped object ``data``, in place, the dotted path of each (path, mark) of ``marks`` whose
    :class:`Later` condition holds in ``data`` (every condition is read before anything is removed; paths that
    ``data`` lacks are skipped); returns ``data``."""
    for path in [path for path, mark in marks if _lookup(data, mark.when or path) in mark.values]:
        _remove(data, path)
    return data


Inputs = Annotated[dict[str, str], Later({})]
"""Content digests of the user files a stage reads, by role; arrived after keys existed: left out while empty."""
PLACED_AS_BEFORE = (
    Later("in-process", at="launcher", recorded=True),
    Later("in-process", at="ranks", when="placement.launcher", recorded=True),
)
"""The marks of a ``placement``'s launcher and ranks, which arrived after keys existed: the recorded spec leaves them
out while the stage runs in-process."""


def machines_recorded(*values: Any, when: str) -> tuple[Later, ...]:
    """The marks of a ``placement``'s machine fields (``nnodes``, ``node_rank``, ``rdzv_endpoint``), which arrived
    after keys existed: the recorded spec leaves them out while the spec field ``when`` holds one of ``values``."""
    return tuple(Later(*values, at=name, when=when, recorded=True) for name in ("nnodes", "node_rank", "rdzv_endpoint"))


class Spec(BaseModel):
    """Base of specs and their parts: frozen, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PlacementSpec(Spec):
    """Where a stage's ranks run, which changes no byte of its artifacts: ``launcher`` in-process (the task's own
    process), local (``ranks`` gloo processes of this machine) or torchrun (``ranks`` over ``nnodes`` machines,
    ``ranks`` // ``nnodes`` on each, this one ``node_rank``, node 0's rendezvous at ``rdzv_endpoint``; None on one
    machine). A stage spec embeds it as its ``placement`` field; the recorded spec holds its fields at the top
    level, where they stood before the placement was one model."""

    launcher: Literal["in-process", "local", "torchrun"] = "in-process"
    ranks: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    def launched(self, run_id: str = "covgrad", backend: str = "gloo") -> LaunchPlacement:
        """This machine's ranks as :func:`covgrad.distributed.launch_ranks` starts them: a torchrun group meeting
        under ``run_id`` and joining with ``backend``, or else ``ranks`` local gloo processes."""
        from covgrad.distributed import Placement  # torch: imported where ranks start, not where specs are planned

        if self.launcher != "torchrun":
            return Placement("local", self.ranks)
        return Placement("torchrun", self.ranks, self.nnodes, self.node_rank, self.rdzv_endpoint, run_id, backend)


def _placed_flat(data: dict[str, Any]) -> dict[str, Any]:
    """The dumped spec ``data`` with the members of its ``placement`` (if any) at the top level; returns ``data``."""
    data.update(data.pop("placement", None) or {})
    return data


_WHOLE = "whole"  # serialization context of the dump before any Later field is left out


class StageSpec(Spec):
    """Base of the stage specs: ``STAGE`` and ``VERSION`` name the stage and its code version (bump it
    when the stage's code changes what it writes); ``PLACEMENT`` lists the fields the key leaves out; fields
    marked :class:`Later` arrived after keys existed and are left out while they hold what earlier specs meant."""

    STAGE: ClassVar[str]
    VERSION: ClassVar[str]
    PLACEMENT: ClassVar[frozenset[str]] = frozenset()  # fields, or dotted paths into them

    @model_validator(mode="before")
    @classmethod
    def _placed_nested(cls, data: Any) -> Any:
        """A recorded spec (placement members at the top level) with its placement members back in ``placement``."""
        if "placement" not in cls.model_fields or not isinstance(data, dict):
            return data
        members = {k: v for k, v in data.items() if k in PlacementSpec.model_fields}
        if not members:
            return data
        rest = {k: v for k, v in data.items() if k not in members}
        return {**rest, "placement": {**dict(rest.get("placement") or {}), **members}}

    @classmethod
    def later(cls, recorded_only: bool = False) -> list[tuple[str, Later]]:
        """The :class:`Later` marks of the spec's fields, each with the dotted path it marks (``field`` or
        ``field.member``); with ``recorded_only``, those that the recorded spec leaves out too."""
        return [
            (name if mark.at is None else f"{name}.{mark.at}", mark)
            for name, field in cls.model_fields.items()
            for mark in field.metadata
            if isinstance(mark, Later) and (mark.recorded or not recorded_only)
        ]

    @model_serializer(mode="wrap")
    def _recorded(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """The dump (what claims and completion markers record): without the recorded :class:`Later` fields whose
        conditions hold, the ``placement`` members at the top level; with the context ``_WHOLE``, every field as
        the model holds it."""
        out = handler(self)
        if info.context == _WHOLE:
            return out
        return _placed_flat(leave_out_later(out, self.later(recorded_only=True)))

    def hashed(self) -> dict[str, Any]:
        """The spec as the key hashes it: every field, as JSON values, except the placement fields and the
        :class:`Later` fields whose conditions hold (placement members that remain at the top level)."""
        out = leave_out_later(self.model_dump(mode="json", context=_WHOLE), self.later())
        for path in self.PLACEMENT:
            _remove(out, path)
        return _placed_flat(out)

    def key(self, upstream: list[str]) -> str:
        """The artifact key of this spec computed from upstream artifacts with keys ``upstream``."""
        return stage_key(self.STAGE, self.VERSION, self.hashed(), upstream)


class PolicySpec(Spec):
    """How a stage loads the policy (and other model directories): a user model directory (resolved) or
    the demo model that the base_model artifact holds, in ``dtype``; ``max_length``: the run's ``model.max_length``,
    the context of a policy whose config and tokenizer tell none."""

    path: str | None
    dtype: Dtype
    trust_remote_code: bool
    max_length: int | None = None

    @model_serializer(mode="wrap")
    def _without_unset_length(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``max_length`` is left out while unset, so a spec dumps (and keys its artifact) as before it existed."""
        out = handler(self)
        if out.get("max_length") is None:
            out.pop("max_length", None)
        return out
