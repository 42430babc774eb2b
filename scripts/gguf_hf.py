"""GGUF file → ordinary Hugging Face model directory, shared by scripts/smollm2.py and scripts/gemma3.py.

transformers reads a GGUF checkpoint (its quantized weights dequantized to float32: real pretrained values,
not the original bf16 ones) but refuses to ``save_pretrained`` a GGUF-loaded model. A fresh model of the
same class, built from the same config without its ``quantization_config``, takes the loaded weights and is
saved with the tokenizer (chat template included, if any) as safetensors.

transformers parses the file's metadata once per call site (the tokenizer's config, the tokenizer, the model's
config, the tensors), each parse about 15 s for Gemma 3's 262,144-token vocabulary, and converts every field
to Python values at each. The conversion parses the file once (one read-only reader for every call site, which
slices a plain array over the mapped file: numpy's memmap subclass costs more than the parse on 786k small
fields) and converts its fields once (a copy of the metadata's containers for each call that asks for no tensors;
the strings and numbers are shared). The tensor-name map, which gguf builds afresh for every module transformers
visits, is built once per architecture.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _containers_copied(value: Any) -> Any:
    """``value`` with every dict and list copied and the atoms (str, int, float) shared: what callers may mutate."""
    if isinstance(value, dict):
        return {k: _containers_copied(v) for k, v in value.items()}
    if isinstance(value, list):
        nested = any(isinstance(v, (dict, list)) for v in value)
        return [_containers_copied(v) for v in value] if nested else list(value)
    return value


@contextmanager
def _one_parse() -> Iterator[None]:
    """Within the block each GGUF file is parsed once and its metadata converted once (see the module doc)."""
    import gguf
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original_reader, original_load = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint
    original_name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}
    metadata: dict[str, dict] = {}
    name_maps: dict[tuple, object] = {}

    class PlainReader(original_reader):
        """gguf's reader over a plain ndarray view of its memmap (same bytes, same fields, cheaper slices)."""

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._mapped = mapped  # keeps the mapping open for the views
            self._plain = mapped.view(np.ndarray)

    def reader(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks: int):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = original_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    def load(path, return_tensors: bool = False, **kwargs):
        if return_tensors or kwargs:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = original_load(path, return_tensors=False)
        return _containers_copied(metadata[key])  # callers pop from what they are given

    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint, gguf.get_tensor_name_map = reader, load, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = original_reader, original_load
        gguf.get_tensor_name_map = original_name_map


def convert(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers and save an ordinary float32 HF model directory at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    with _one_parse():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():  # every weight is overwritten from the loaded state
        model = type(loaded)(config)
    model.tie_weights()  # what the skipped initialisation would have done: a tied head is saved once
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    # transformers records whether this load was offline (HF_HUB_OFFLINE) in the saved tokenizer config; the
    # directory's content, and so covgrad's fingerprint of it, must not depend on the environment it was made in
    tok.init_kwargs.pop("local_files_only", None)
    tok.save_pretrained(str(out))
