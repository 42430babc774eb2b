"""GGUF file → ordinary Hugging Face model directory, shared by scripts/smollm2.py and scripts/gemma3.py.

transformers reads a GGUF checkpoint (its quantized weights dequantized to float32: real pretrained values,
not the original bf16 ones) but refuses to ``save_pretrained`` a GGUF-loaded model. A fresh model of the
same class, built from the same config without its ``quantization_config``, takes the loaded weights and is
saved with the tokenizer (chat template included, if any) as safetensors.

transformers parses the file's metadata once per call site (the tokenizer's config, the tokenizer, the model's
config, the tensors), each parse about 15 s for Gemma 3's 262,144-token vocabulary, and converts every field
to Python values at each. The conversion parses the file once (one read-only reader for every call site) and
converts its fields once (a copy of the metadata for each call that asks for no tensors).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def _one_parse() -> Iterator[None]:
    """Within the block each GGUF file is parsed once and its metadata converted once (see the module doc)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original_reader, original_load = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint
    readers: dict[tuple[str, str], object] = {}
    metadata: dict[str, dict] = {}

    def reader(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    def load(path, return_tensors: bool = False, **kwargs):
        if return_tensors or kwargs:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = original_load(path, return_tensors=False)
        return copy.deepcopy(metadata[key])  # callers pop from what they are given

    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = reader, load
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = original_reader, original_load


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
    tok.save_pretrained(str(out))
