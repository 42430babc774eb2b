"""covgrad.updates.diff on synthetic pairs with known changed sets (float64 numpy references), and
storage.checkpoints on every checkpoint format it reads."""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from covgrad.layout import select_parameters
from covgrad.updates.diff import diff_state_dicts
from storage.checkpoints import checkpoint_dtype, load_state_dict


def fp32_pair():
    """Before/after with known changes: in "a" 6 big moves (both metrics) and 4 one-ulp moves (exact only);
    "c" changes shape, "d" exists only before, "e" only after; "b", "f", "g", "h" are untouched."""
    g = torch.Generator().manual_seed(0)
    before = {n: torch.randn(shape, generator=g) for n, shape in [("a", (5, 7)), ("b", (11,)), ("c", (3, 3))]}
    before |= {n: torch.randn(4, generator=g) for n in ("d", "f", "g", "h")}
    after = {n: t.clone() for n, t in before.items() if n != "d"}
    flat = after["a"].view(-1)
    big, tiny = [0, 3, 8, 17, 20, 34], [1, 5, 9, 30]
    flat[big] += 0.1
    flat[tiny] = torch.nextafter(flat[tiny], torch.full((4,), torch.inf))
    after["c"] = before["c"].reshape(9)
    after["e"] = torch.zeros(2)
    return before, after, big, tiny


def test_fp32_pair_known_changed_sets():
    before, after, big, tiny = fp32_pair()
    out = diff_state_dicts(before, after)
    rows = {r["name"]: r for r in out["tensors"]}
    assert list(rows) == ["a", "b", "f", "g", "h"]
    assert (rows["a"]["changed_exact"], rows["a"]["changed_abs"]) == (len(big) + len(tiny), len(big))
    assert all(rows[n]["changed_exact"] == rows[n]["changed_abs"] == 0 for n in "bfgh")
    assert rows["a"]["frac_exact"] == 10 / 35
    assert out["numel"] == 35 + 11 + 3 * 4
    assert (out["changed_exact"], out["changed_abs"]) == (10, 6)
    assert out["frac_abs"] == 6 / out["numel"]
    assert out["mismatched"] == [
        {
            "name": "c",
            "before_shape": (3, 3),
            "after_shape": (9,),
            "before_dtype": "float32",
            "after_dtype": "float32",
        },
        {
            "name": "d",
            "before_shape": (4,),
            "after_shape": None,
            "before_dtype": "float32",
            "after_dtype": None,
        },
        {
            "name": "e",
            "before_shape": None,
            "after_shape": (2,),
            "before_dtype": None,
            "after_dtype": "float32",
        },
    ]


def test_bf16_pair_against_float64_reference():
    g = torch.Generator().manual_seed(1)
    # magnitudes from 1e-4 to 10: one bf16 ulp is below 1e-5 for the small ones and above it for the rest
    values = torch.randn(4000, generator=g) * 10.0 ** torch.randint(-4, 2, (4000,), generator=g)
    before = {"w": values.to(torch.bfloat16).reshape(40, 100)}
    bits = before["w"].view(torch.int16).clone().reshape(-1)
    moved = torch.randperm(4000, generator=g)[:700]
    bits[moved] += torch.randint(1, 3, (700,), generator=g, dtype=torch.int16)  # one or two ulps
    after = {"w": bits.view(torch.bfloat16).reshape(40, 100)}
    out = diff_state_dicts(before, after)
    b = before["w"].double().numpy()
    a = after["w"].double().numpy()
    assert out["changed_exact"] == int((a != b).sum()) == 700
    want_abs = int((np.abs(a - b) > 1e-5).sum())
    assert 0 < want_abs < 700
    assert out["changed_abs"] == want_abs
    assert out["tensors"][0]["dtype"] == "bfloat16"


def test_architecture_mismatch_names_the_first_mismatched_tensor():
    before = {"x": torch.zeros(2, 2), "y": torch.zeros(3)}
    after = {"y": torch.zeros(4), "z": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"different architectures.*0 of 3.*first mismatch 'x'"):
        diff_state_dicts(before, after)
    mostly_integer = {"x": torch.zeros(2, 2, dtype=torch.int64), "y": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"'x': before \(2, 2\) float32, after \(2, 2\) int64"):
        diff_state_dicts(before, mostly_integer)
    one_of_three = {"x": torch.zeros(2, 2), "y": torch.zeros(4), "w": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"only 1 of 3 tensors.*first mismatch 'y'"):
        diff_state_dicts(before, one_of_three)
    with pytest.raises(ValueError, match="empty"):
        diff_state_dicts({}, {})
    with pytest.raises(ValueError, match="atol"):
        diff_state_dicts(before, before, atol=-1.0)


def test_a_float32_start_against_a_bf16_checkpoint_is_compared_in_bf16():
    """Checkpoints of different dtypes are one model: changed means bf16(before) != after, |Δ| from bf16(before);
    the rows say both dtypes."""
    g = torch.Generator().manual_seed(2)
    before = {"w": torch.randn(50, 20, generator=g), "b": torch.randn(20, generator=g)}
    after = {n: t.to(torch.bfloat16) for n, t in before.items()}
    moved = torch.randperm(1000, generator=g)[:37]
    bits = after["w"].view(torch.int16).reshape(-1).clone()
    bits[moved] += 1  # one bf16 ulp each
    after["w"] = bits.view(torch.bfloat16).reshape(50, 20)
    out = diff_state_dicts(before, after, atol=0.0)
    rows = {r["name"]: r for r in out["tensors"]}
    assert out["mismatched"] == [] and out["changed_exact"] == out["changed_abs"] == 37
    assert rows["w"]["dtype"] == "bfloat16" and rows["w"]["before_dtype"] == "float32"
    assert (rows["w"]["changed_exact"], rows["b"]["changed_exact"]) == (37, 0)
    back = diff_state_dicts(after, before)  # compared in float32: the bf16 values are exact there
    assert back["changed_exact"] == int(
        (before["w"] != after["w"].float()).sum() + (before["b"] != after["b"].float()).sum()
    )


def test_mask_overlap_against_numpy_sets():
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    layout = select_parameters(model)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    after = {n: t + (torch.rand(t.shape, generator=g) < 0.3) * 0.5 for n, t in before.items()}
    changed = np.concatenate([(after[e.name] != before[e.name]).reshape(-1).numpy() for e in layout.entries])
    rng = np.random.default_rng(3)
    masks = {"half": rng.random(layout.P) < 0.5, "none": np.zeros(layout.P, dtype=bool)}
    out = diff_state_dicts(before, after, masks=masks, layout=layout)
    both = int((masks["half"] & changed).sum())
    assert out["overlap"]["half"]["exact"] == {
        "precision": both / masks["half"].sum(),
        "recall": both / changed.sum(),
        "jaccard": both / (masks["half"] | changed).sum(),
        "size": int(masks["half"].sum()),
    }
    assert out["overlap"]["half"]["abs"] == out["overlap"]["half"]["exact"]  # every move is 0.5
    assert out["overlap"]["none"]["exact"]["size"] == 0
    with pytest.raises(ValueError, match="must be bool"):
        diff_state_dicts(before, after, masks={"bad": np.zeros(layout.P)}, layout=layout)
    with pytest.raises(ValueError, match="layout="):
        diff_state_dicts(before, after, masks=masks)
    reshaped = dict(after) | {"1.bias": after["1.bias"].reshape(1, 3)}
    with pytest.raises(ValueError, match=r"'1\.bias' is not comparable"):
        diff_state_dicts(before, reshaped, masks=masks, layout=layout)


def tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config).to(dtype)


def assert_same_state(loaded: dict[str, torch.Tensor], model: nn.Module) -> None:
    want = model.state_dict()
    assert sorted(loaded) == sorted(want)
    for name, tensor in want.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name


def test_load_safetensors_directory_keeps_bf16(tmp_path):
    model = tiny_llama(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert_same_state(load_state_dict(tmp_path), model)
    assert_same_state(load_state_dict(str(tmp_path / "model.safetensors")), model)


def test_load_sharded_safetensors(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="4KB")
    index = tmp_path / "model.safetensors.index.json"
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1
    assert_same_state(load_state_dict(tmp_path), model)
    (tmp_path / sorted(shards)[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(sorted(shards)[-1])):
        load_state_dict(tmp_path)


def test_the_stored_dtype_of_every_format(tmp_path):
    """checkpoint_dtype reads safetensors headers (single and sharded) and .bin state dicts; a mix of floating
    dtypes is refused naming the file unless the tensors asked about share one."""
    tiny_llama(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tiny_llama().save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    torch.save(tiny_llama().state_dict(), tmp_path / "pytorch_model.bin")
    assert checkpoint_dtype(tmp_path / "bf16") == torch.bfloat16
    assert checkpoint_dtype(tmp_path / "sharded") == torch.float32
    assert checkpoint_dtype(tmp_path / "pytorch_model.bin") == torch.float32
    mixed = tmp_path / "mixed.safetensors"
    save_file(
        {"w": torch.zeros(2, dtype=torch.bfloat16), "norm": torch.zeros(2), "n": torch.zeros(1, dtype=torch.int64)},
        mixed,
    )
    with pytest.raises(ValueError, match=r"mixed\.safetensors.*\['bfloat16', 'float32'\]"):
        checkpoint_dtype(mixed)
    assert checkpoint_dtype(mixed, ["w", "absent"]) == torch.bfloat16
    assert checkpoint_dtype(mixed, ["norm"]) == torch.float32


def test_load_pytorch_bin(tmp_path):
    model = tiny_llama()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert_same_state(load_state_dict(tmp_path), model)
    assert_same_state(load_state_dict(tmp_path / "pytorch_model.bin"), model)


def test_load_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_state_dict(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="holds none of"):
        load_state_dict(tmp_path)
    (tmp_path / "weights.txt").write_text("")
    with pytest.raises(ValueError, match=r"weights\.txt"):
        load_state_dict(tmp_path / "weights.txt")


def test_saved_checkpoints_diff_like_in_memory(tmp_path):
    model = tiny_llama(torch.bfloat16)
    model.save_pretrained(tmp_path / "before")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[:3] *= 1.5
    model.save_pretrained(tmp_path / "after")
    out = diff_state_dicts(load_state_dict(tmp_path / "before"), load_state_dict(tmp_path / "after"))
    rows = {r["name"]: r for r in out["tensors"]}
    assert rows["model.layers.0.mlp.up_proj.weight"]["changed_exact"] == out["changed_exact"]
    nonzero = int((model.model.layers[0].mlp.up_proj.weight[:3] != 0).sum())
    assert out["changed_exact"] == nonzero > 0
    assert out["mismatched"] == []
