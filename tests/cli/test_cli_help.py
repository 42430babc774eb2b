"""``covgrad run --help`` lists every config key with its default and description, from the schema."""

import typing

import pytest
from pydantic import BaseModel

from covgrad.config import PipelineConfig
from flows.cli import main


def leaf_keys(model: type[BaseModel], prefix: str = "") -> dict[str, typing.Any]:
    """Every leaf field of ``model`` by dotted key (dict-of-section values under ``<name>``)."""
    out = {}
    for name, field in model.model_fields.items():
        ann, key = field.annotation, f"{prefix}{name}"
        args = typing.get_args(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= leaf_keys(ann, f"{key}.")
        elif typing.get_origin(ann) is dict and issubclass(args[1], BaseModel):
            out |= leaf_keys(args[1], f"{key}.<name>.")
        else:
            out[key] = field
    return out


def test_run_help_lists_every_config_key_with_default_and_description(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    lines = {line.split(" = ", 1)[0]: line for line in text.splitlines() if " = " in line}
    keys = leaf_keys(PipelineConfig)
    assert len(keys) > 60
    for key, field in keys.items():
        assert key in lines, key
        assert field.description and field.description in lines[key], key
    assert 'scores.state_dtype = "float64"' in text and "masks.qs = [0.001, 0.01, 0.05, 0.1]" in text
