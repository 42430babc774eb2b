"""The weight-delta trace formats besides grail's, on files written here from their documented layouts
(docs/formats.md, "Weight-delta traces"; builders: tests/helpers/deltas.py): TRL's async-GRPO anchors and deltas (raw
and gap-encoded indices) and slime's version folders (zstd xor and overwrite byte deltas, the earlier flush files in
indices, deltas and deltas_zstd, whole checkpoints). Each replays to the written weights bit for bit; each malformed
trace is refused in one line naming the file. ``tests/stages/test_external_runs.py`` runs the trajectory stage on
traces written with the same builders from the tiny pipeline's own run."""

from pathlib import Path

import safetensors.torch
import torch

from covgrad.layout import ParamLayout
from storage.stores.external import delta_files, delta_trace, replay_deltas
from tests.helpers.deltas import (
    Weights,
    byte_version,
    flush_version,
    one_line_error,
    slime_trace,
    tiny_net,
    trl_trace,
)


def tiny_run(steps: int) -> tuple[Weights, dict, ParamLayout]:
    """The tiny net's bf16 weights after steps 0..steps, about a third of each tensor's elements moved per step (no
    tensor of step 2 moves); its shapes and layout."""
    net, layout = tiny_net()
    g = torch.Generator().manual_seed(1)
    weights = [{n: p.detach().to(torch.bfloat16) for n, p in net.named_parameters()}]
    for s in range(1, steps + 1):
        moved = {}
        for name, w in weights[-1].items():
            step = torch.randn(w.shape, generator=g) * (torch.rand(w.shape, generator=g) < 0.35) * (s != 2)
            moved[name] = (w.float() + step).to(torch.bfloat16)
        weights.append(moved)
    return weights, {n: tuple(p.shape) for n, p in net.named_parameters()}, layout


def flat(state: dict, layout: ParamLayout) -> torch.Tensor:
    """(P,) the layout's tensors of ``state``."""
    return torch.cat([state[e.name].reshape(-1) for e in layout.entries])


def replayed(folder: Path, shapes: dict, layout: ParamLayout, start: torch.Tensor) -> list[torch.Tensor]:
    """The weights after every step of the trace at ``folder``, as int16 bits."""
    return [w.view(torch.int16).clone() for _, w in replay_deltas(delta_trace(str(folder)), shapes, layout, start)]


def test_a_trl_trace_replays_its_weights_and_malformed_ones_are_refused(tmp_path):
    weights, shapes, layout = tiny_run(5)
    start = flat(weights[0], layout)
    trl = tmp_path / "trl"
    trl_trace(trl, weights, ["raw", "gap_delta", "anchor", "gap_delta", "raw"])
    trace = delta_trace(str(trl))
    assert trace.layout == "trl deltas (raw)" and trace.start.endswith("anchors/step_000001.safetensors")
    assert trace.dtype == torch.bfloat16 and [t + 1 for t, _ in trace.files] == [1, 2, 3, 4, 5]
    assert (trl / "deltas" / "step_000003.safetensors").stat().st_size < 200  # step 2 moved nothing: an empty delta
    got = replayed(trl, shapes, layout, start)
    assert all(torch.equal(w, flat(x, layout).view(torch.int16)) for w, x in zip(got, weights[1:], strict=True))

    def refused(file: str, tensors: dict, **meta: str) -> str:
        path = trl / file
        kept = path.read_bytes()
        version = str(int(Path(file).stem.removeprefix("step_")))
        base = {"format": "sparse_weight_patch", "sparse": str(file.startswith("deltas")), "model_version": version}
        safetensors.torch.save_file(tensors, path, {**base, "encoding": "raw", **meta})
        msg = one_line_error(lambda: replayed(trl, shapes, layout, start))
        path.write_bytes(kept)
        assert str(path) in msg, msg
        return msg

    one = torch.ones(1, dtype=torch.bfloat16)
    assert "flat index 12 is out of range for its shape (4, 3) (12 elements)" in refused(
        "deltas/step_000002.safetensors", {"0.weight.idx": torch.tensor([12], dtype=torch.int32), "0.weight.val": one}
    )
    assert "flat index 4 is out of range for its shape (4,)" in refused(
        "deltas/step_000002.safetensors",
        {"0.bias.idx": torch.tensor([1, 2], dtype=torch.uint16), "0.bias.val": one.repeat(2)},
        encoding="gap_delta",
    )
    anchor = {**weights[3], "0.weight": weights[3]["0.weight"].reshape(3, 4).contiguous()}
    msg = refused("anchors/step_000004.safetensors", anchor)
    assert "tensor '0.weight' has shape (3, 4) in the anchor, (4, 3) in the start model" in msg
    assert "lacks 1 tensors of the start model, first '1.bias'" in refused(
        "anchors/step_000004.safetensors", {k: v for k, v in weights[3].items() if k != "1.bias"}
    )
    assert "tensor 0.bias.val has no 0.bias.idx beside it" in refused(
        "deltas/step_000002.safetensors", {"0.bias.val": one}
    )
    assert "index encoding 'nvcomp_cascaded'" in refused(
        "deltas/step_000002.safetensors",
        {"0.bias.idx": torch.zeros(4, dtype=torch.uint8), "0.bias.val": one},
        encoding="nvcomp_cascaded",
    )
    assert "its model_version is '7', its name says 2" in refused(
        "deltas/step_000002.safetensors", {"0.bias.val": one}, model_version="7"
    )
    assert "values must be torch.bfloat16" in refused(
        "deltas/step_000002.safetensors",
        {"0.bias.idx": torch.tensor([0], dtype=torch.int32), "0.bias.val": torch.ones(1)},
    )

    dup = trl / "deltas" / "step_000004.safetensors"
    dup.write_bytes(b"")  # beside anchors/step_000004.safetensors
    assert "anchors/step_000004.safetensors and" in one_line_error(delta_files, str(trl))
    assert "are both version 4" in one_line_error(delta_files, str(trl))
    dup.unlink()
    (trl / "deltas" / "step_000003.safetensors").unlink()
    msg = one_line_error(delta_files, str(trl))
    assert f"{trl / 'deltas' / 'step_000003.safetensors'} is missing (the trace holds 2...6)" in msg
    (trl / "anchors" / "step_000001.safetensors").unlink()
    msg = one_line_error(delta_files, str(trl))
    assert f"has no start weights: {trl / 'anchors' / 'step_000001.safetensors'} is missing" in msg


def test_a_slime_trace_in_every_encoding_replays_its_weights_and_malformed_ones_are_refused(tmp_path):
    kinds = ["xor", "overwrite", "indices", "deltas", "deltas_zstd", "full"]
    weights, shapes, layout = tiny_run(len(kinds))
    start = flat(weights[0], layout)
    slime = tmp_path / "slime"
    slime_trace(slime, weights, kinds)
    trace = delta_trace(str(slime))
    assert trace.layout == "slime deltas (xor)" and trace.start == str(slime / "weight_v000000")
    assert [t + 1 for t, _ in trace.files] == list(range(1, 7)) and trace.stored["0.bias"] == ("bfloat16", 8)
    assert sorted(p.name for p in (slime / "weight_v000004").iterdir()) == [
        "rank0000_flush000000.safetensors",
        "rank0000_flush000001.safetensors",
    ]
    got = replayed(slime, shapes, layout, start)
    assert all(torch.equal(w, flat(x, layout).view(torch.int16)) for w, x in zip(got, weights[1:], strict=True))

    def refused(version: int, kind: str, before: dict, after: dict) -> str:
        d = slime / f"weight_v{version:06d}"
        kept = {f.name: f.read_bytes() for f in d.iterdir()}
        for f in d.iterdir():
            f.unlink()
        (byte_version if kind in ("xor", "overwrite") else flush_version)(d, version, before, after, kind)
        msg = one_line_error(lambda: replayed(slime, shapes, layout, start))
        for f in d.iterdir():
            f.unlink()
        for name, data in kept.items():
            (d / name).write_bytes(data)
        return msg

    # 0.bias of 5 elements (10 bytes) where the start has 4 (8 bytes)
    longer = [{**w, "0.bias": torch.full((5,), v, dtype=torch.bfloat16)} for w, v in zip(weights, (0, 1), strict=False)]
    msg = refused(1, "xor", *longer)
    assert str(slime / "weight_v000001" / "model-00000-of-00001.safetensors") in msg
    assert "tensor '0.bias': its xor delta has 10 bytes, the tensor 8 (bfloat16) in the start checkpoint" in msg
    msg = refused(2, "overwrite", *longer)
    assert "tensor '0.bias': byte position 8 is out of range for its shape (4,) (8 bytes)" in msg
    msg = refused(3, "indices", weights[2], {**weights[3], "0.weight": weights[3]["0.weight"].reshape(3, 4)})
    assert str(slime / "weight_v000003" / "rank0000_flush0000") in msg
    assert ".safetensors: tensor '0.weight' has shape (3, 4) in the delta, (4, 3) in the start model" in msg
    msg = refused(5, "deltas_zstd", *longer)
    assert str(slime / "weight_v000005" / "rank0000_flush0000") in msg
    assert "tensor '0.bias' has shape (5,) in the delta, (4,) in the start model" in msg
    index = slime / "weight_v000002" / "model.safetensors.index.json"
    kept = index.read_text()
    index.write_text(kept.replace('"base_version": "000001"', '"base_version": "000000"'))
    assert f"{index}: version '000002' on base '000000'" in one_line_error(
        lambda: replayed(slime, shapes, layout, start)
    )
    index.write_text(kept)

    (slime / "weight_v1").mkdir()
    assert "weight_v000001 and" in one_line_error(delta_files, str(slime))
    (slime / "weight_v1").rename(slime / "delta_000000.pt")
    assert "mixes delta formats: delta_000000.pt (grail), weight_v000000/ (slime)" in one_line_error(
        delta_files, str(slime)
    )
    (slime / "delta_000000.pt").rmdir()
    (slime / "weight_v000004").rename(slime / "weight_v000009")
    assert f"{slime / 'weight_v000004'} is missing (the trace holds 1...9)" in one_line_error(delta_files, str(slime))
    (slime / "weight_v000000" / "model.safetensors").unlink()
    msg = one_line_error(delta_files, str(slime))
    assert f"has no start weights: {slime / 'weight_v000000'} is missing or holds no model.safetensors" in msg


def test_a_slime_byte_delta_of_a_tensor_stored_in_another_dtype_is_refused_only_when_selected(tmp_path):
    """Byte deltas apply to a tensor's stored bytes: a float32 tensor of a bf16 checkpoint replays only outside
    model.params."""
    weights, shapes, layout = tiny_run(1)
    weights[0]["1.bias"] = weights[0]["1.bias"].float()
    weights[1]["1.bias"] = weights[0]["1.bias"] + 1
    slime = tmp_path / "slime"
    slime_trace(slime, weights, ["xor"])
    start = torch.cat([weights[0][e.name].reshape(-1).to(torch.bfloat16) for e in layout.entries])
    msg = one_line_error(lambda: replayed(slime, shapes, layout, start))
    assert "tensor '1.bias' holds float32 values, the trace replays torch.bfloat16" in msg
    selected = ParamLayout(layout.entries[:3])
    got = replayed(slime, shapes, selected, flat(weights[0], selected))
    assert torch.equal(got[0], flat(weights[1], selected).view(torch.int16))
