"""storage/schema.py: names resolve to their declaration, arrays are created as declared, and plain xarray
opens the declared coordinates as coordinates."""

import numpy as np
import pytest
import xarray as xr
import zarr

from storage.schema import PARAM_CHUNK, ROLLOUTS, SCHEMAS, SCORES, TOKENS, UPDATE, create, var, write


def test_names_resolve_exact_first_then_the_most_specific_template():
    assert var(TOKENS, "fisher_seq").long_name == "sequence Fisher"
    assert var(TOKENS, "fisher_probe").long_name == "token Fisher estimate"
    assert var(TOKENS, "trace_exact").dims == ("sample", "position")
    assert var(UPDATE, "n_changed_bf16").dtype == "int64"
    assert var(UPDATE, "bf16_absorb_recall").dtype == "float64"
    assert var(UPDATE, "abs_smallw_size").dtype is None
    with pytest.raises(KeyError, match="rollouts.zarr declares no array 'nope'"):
        var(ROLLOUTS, "nope")


def test_every_declaration_is_consistent():
    for store, table in SCHEMAS.items():
        for name, v in table.items():
            assert len(v.chunks) == len(v.dims), (store, name)
            assert v.long_name, (store, name)
            assert not v.labels or set(v.labels) & {d for w in table.values() for d in w.dims}, (store, name)


def test_created_arrays_follow_the_schema_and_open_with_coordinates(tmp_path):
    g = zarr.open_group(str(tmp_path / "r.zarr"), mode="w")
    N, width = 6, 5
    for name in ("group", "prompt_index", "sample_index"):
        write(g, ROLLOUTS, name, np.repeat(np.arange(3), 2) if name != "sample_index" else np.tile([0, 1], 3), rows=4)
    create(g, ROLLOUTS, "tokens", (N, width), rows=4)[:] = np.arange(N * width).reshape(N, width)
    write(g, ROLLOUTS, "reward", np.linspace(0, 1, N), rows=4)
    assert g["tokens"].chunks == (4, width) and g["tokens"].dtype == np.int32
    assert np.isnan(g["reward"].fill_value)
    assert create(g, ROLLOUTS, "tokens", (N, width), rows=4) is not None  # an existing array is kept

    ds = xr.open_zarr(str(tmp_path / "r.zarr"), consolidated=False)
    assert set(ds.coords) == {"group", "prompt_index", "sample_index"}
    row = ds.set_index(sample=["prompt_index", "sample_index"]).sel(prompt_index=2, sample_index=1).load()
    assert row.reward.item() == 1.0 and row.tokens.values.tolist() == list(range(25, 30))
    assert ds.reward.attrs["long_name"] == "reward"


def test_open_dtypes_and_param_chunks(tmp_path):
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    state = create(g, SCORES, "mean_s", (2, 3 * PARAM_CHUNK), dtype="float32")
    assert state.dtype == np.float32 and state.chunks == (2, PARAM_CHUNK) and state.compressors == ()
    assert state.attrs["coordinates"] == "tensor_name tensor_offset tensor_numel"
    with pytest.raises(ValueError, match="give a dtype"):
        create(g, SCORES, "m2_s", (2, 10))
    with pytest.raises(ValueError, match="pass rows="):
        create(g, SCORES, "scores", (4, 10))
