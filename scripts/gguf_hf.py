"""GGUF file → ordinary Hugging Face model directory, shared by scripts/smollm2.py and scripts/gemma3.py.

transformers reads a GGUF checkpoint (its quantized weights dequantized to float32: real pretrained values,
not the original bf16 ones) but refuses to ``save_pretrained`` a GGUF-loaded model. A fresh model of the
same class, built from the same config without its ``quantization_config``, takes the loaded weights and is
saved with the tokenizer (chat template included, if any) as safetensors.
"""

from __future__ import annotations

from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers and save an ordinary float32 HF model directory at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
