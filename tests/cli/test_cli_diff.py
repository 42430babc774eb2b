"""``covgrad diff`` on real saved checkpoints: known changed sets in fp32 and bf16, bad input."""

import json

import pytest
import torch

from flows.cli import main
from tests.helpers.models import tiny_llama


def _save(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diff_counts_known_changes(tmp_path, capsys, dtype):
    before = tiny_llama(16, hidden=16, intermediate=32, heads=2, kv_heads=1).to(dtype)
    after = tiny_llama(16, hidden=16, intermediate=32, heads=2, kv_heads=1).to(dtype)
    with torch.no_grad():
        w = after.model.layers[0].mlp.up_proj.weight
        w.view(-1)[:10] += 1.0  # 10 clearly changed entries
        after.lm_head.weight.view(-1)[3] += 1.0
    a, b = _save(before, tmp_path / "a"), _save(after, tmp_path / "b")
    assert main(["diff", a, b, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["changed_exact"] == 11 and result["changed_abs"] == 11
    rows = {r["name"]: r for r in result["tensors"]}
    assert rows["model.layers.0.mlp.up_proj.weight"]["changed_exact"] == 10
    assert rows["lm_head.weight"]["changed_exact"] == 1
    assert result["numel"] == sum(p.numel() for p in before.parameters())
    assert main(["diff", a, b]) == 0
    assert "global (numel-weighted)" in capsys.readouterr().out


def test_diff_bad_input(tmp_path, capsys):
    small = _save(tiny_llama(16, hidden=16, intermediate=32, heads=2, kv_heads=1), tmp_path / "small")
    other = _save(tiny_llama(16, hidden=32, intermediate=48, heads=2, kv_heads=1), tmp_path / "other")
    capsys.readouterr()
    assert main(["diff", small, other]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "first mismatch" in err[0] and "(16, 16)" in err[0]
    assert main(["diff", small, str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.slow
def test_diff_with_the_masks_a_pipeline_wrote(tiny_run, capsys):
    """``covgrad diff --masks`` on the tiny pipeline's own masks artifact: the policy (whose statistics the
    masks are) against its stale checkpoint, every mask's precision and recall against a brute-force numpy
    count over the flat axis."""
    import numpy as np
    import zarr

    from covgrad.layout import ParamLayout
    from storage.artifacts import ArtifactStore
    from storage.checkpoints import load_state_dict

    root, p = tiny_run
    store = ArtifactStore(str(root))
    masks_dir = store.path(p["masks"].ref)
    base = store.path(p["base_model"].ref)
    before, after = f"{base}/policy", f"{base}/stale"  # the masks' statistics are the policy's: it is BEFORE
    capsys.readouterr()
    assert main(["diff", before, after, "--masks", masks_dir, "--q", "0.1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    g = zarr.open_group(f"{masks_dir}/masks.zarr", mode="r")
    layout = ParamLayout.from_records(g.attrs["tensors"])
    a, b = load_state_dict(before), load_state_dict(after)
    changed = np.concatenate([(a[e.name] != b[e.name]).numpy().ravel() for e in layout.entries])
    row = int(np.flatnonzero(np.isclose(g["q"][:], 0.1))[0])
    names = [n for n, arr in g.arrays() if arr.ndim == 2 and arr.dtype == bool]
    assert names and set(result["overlap"]) == set(names)
    for name in names:
        mask = g[name][row]
        both = int((mask & changed).sum())
        assert result["overlap"][name]["exact"]["precision"] == pytest.approx(both / mask.sum(), abs=0)
        assert result["overlap"][name]["exact"]["recall"] == pytest.approx(both / changed.sum(), abs=0)
