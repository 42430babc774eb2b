"""Benchmark of the masks stage on a synthetic stats store: seconds and peak resident memory.

Writes a stats store shaped like SmolLM2-135M with every parameter selected (tied embedding 49152 × 576
and 30 Llama layers: P = 134,515,008 by default) holding heavy ties (a fifth of the embedding rows are
exactly 0, the rest bf16-rounded) and NaN ρ where Fvar = 0, then runs the stage's computation
(``tasks.masks.compute_masks``) in a child process and prints its seconds and peak resident set (the
child's ru_maxrss). With ``--compare DIR`` it runs the same stage from another checkout too (e.g. the
whole-array code before the block-wise one) and compares every output file byte for byte; Spearman in
``summary.json`` is compared as a number.

Run: ``python -m benchmarks.masks`` (full size: 5.4 GB of stats on disk under ``--root``, about 1.3 GB
of RAM for the stage), smaller e.g. ``python -m benchmarks.masks --layers 4 --vocab 8192``, against the
old code ``python -m benchmarks.masks --compare /path/to/old/checkout``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from covgrad.layout import ParamLayout, TensorEntry
from storage.artifacts import ArtifactStore
from storage.schema import STATS, param_chunk

HIDDEN, INTER, KV = 576, 1536, 192  # SmolLM2-135M: hidden, MLP and key/value widths
QS = [0.001, 0.01, 0.05, 0.1]
STD_A = 0.7
BLOCK = 1 << 22

# the child: run the masks stage's computation on the synthetic stats, print its seconds
CHILD = """
import sys, time
from storage.artifacts import ArtifactStore
from tasks.masks import compute_masks
from tasks.specs import MasksSpec
store = ArtifactStore(sys.argv[1])
spec = MasksSpec(qs=[float(q) for q in sys.argv[3:]])
t0 = time.perf_counter()
compute_masks(store, store.ref("masks", sys.argv[2]), spec, store.ref("stats", "synthetic"))
print(time.perf_counter() - t0)
"""


def smollm2_layout(vocab: int, layers: int) -> ParamLayout:
    """The tensors of a SmolLM2-135M-shaped Llama with ``layers`` layers and a tied embedding."""
    shapes = [("model.embed_tokens.weight", (vocab, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    entries, offset = [], 0
    for name, shape in shapes:
        numel = int(np.prod(shape))
        entries.append(TensorEntry(name, offset, numel, shape, "float32"))
        offset += numel
    return ParamLayout(tuple(entries))


def bf16(x: np.ndarray) -> np.ndarray:
    """Round toward zero to bfloat16, as float64: heavy ties."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)


def synthetic_block(start: int, stop: int, layout: ParamLayout, seed: int) -> dict[str, np.ndarray]:
    """The statistics of parameters [start, stop): F spread over decades by tensor, rows of the
    embedding exactly 0 (tokens never drawn), G, Cov and ρ within the bound."""
    rng = np.random.default_rng([seed, start])
    n = stop - start
    offsets = np.array([e.offset for e in layout.entries])
    tensor = np.searchsorted(offsets, np.arange(start, stop), side="right") - 1  # (n,)
    scale = 10.0 ** np.random.default_rng(seed).uniform(-8, -2, len(offsets))[tensor]
    F = bf16(scale * rng.exponential(1.0, n) ** 2)
    emb = layout.entries[0]
    in_emb = np.arange(start, stop) < emb.offset + emb.numel
    row = np.arange(start, stop) // HIDDEN
    F[in_emb & (row % 5 == 0)] = 0.0
    Fvar = F * rng.uniform(0.5, 1.0, n)
    Cov = bf16(STD_A * np.sqrt(Fvar) * np.clip(rng.normal(0.0, 0.4, n), -1, 1))
    G = Cov + 1e-3 * np.sqrt(F) * rng.normal(0.0, 1.0, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(Fvar > 0, Cov / (STD_A * np.sqrt(Fvar)), np.nan)
    return {"F": F, "G": G, "Fvar": Fvar, "Cov": Cov, "rho": rho}


def write_stats(root: str, layout: ParamLayout, seed: int) -> None:
    """A stats artifact ``stats/synthetic`` under ``root`` with the arrays and attrs the masks stage reads."""
    store = ArtifactStore(root)
    g = store.open_group(store.ref("stats", "synthetic"), STATS, mode="w")
    P = layout.P
    names = ("F", "G", "Fvar", "Cov", "rho")
    for name in names:
        g.create_array(name, shape=(P,), chunks=(param_chunk(P),), dtype="float64", dimension_names=["param"])
    for start in range(0, P, BLOCK):
        stop = min(P, start + BLOCK)
        for name, values in synthetic_block(start, stop, layout, seed).items():
            g[name][start:stop] = values
    g.attrs.update({"tensors": layout.to_records(), "scalars": {"std_A": STD_A, "P": P}, "degenerate": None})


def run_child(root: str, key: str, src: Path) -> tuple[float, float]:
    """Run the masks stage of the checkout ``src`` as ``masks/key``: (seconds, peak resident GiB)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, root, key, *map(str, QS)], cwd=src, env=env, stdout=subprocess.PIPE, text=True
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the masks stage of {src} failed (exit status {os.waitstatus_to_exitcode(status)})")
    return float(out.strip().splitlines()[-1]), usage.ru_maxrss / 2**20  # ru_maxrss in KiB


def compare(a: Path, b: Path) -> list[str]:
    """Lines naming every file that differs between artifact directories a and b (Spearman as numbers)."""
    files = sorted({p.relative_to(d) for d in (a, b) for p in d.rglob("*") if p.is_file()})
    lines = []
    for rel in files:
        fa, fb = a / rel, b / rel
        if not (fa.exists() and fb.exists()):
            lines.append(f"{rel}: only in {'new' if fa.exists() else 'old'}")
        elif fa.read_bytes() != fb.read_bytes():
            if rel.name == "summary.json":
                sa, sb = json.loads(fa.read_text()), json.loads(fb.read_text())
                ra, rb = sa.pop("spearman_F_absG"), sb.pop("spearman_F_absG")
                same = "the rest identical" if sa == sb else "other fields differ too"
                lines.append(f"{rel}: spearman {ra!r} vs {rb!r} (difference {abs(ra - rb):.2e}); {same}")
            else:
                lines.append(f"{rel}: bytes differ")
    return lines or [f"all {len(files)} files identical"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152, help="embedding rows (SmolLM2: 49152)")
    parser.add_argument("--layers", type=int, default=30, help="Llama layers (SmolLM2-135M: 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None, help="artifact root for the synthetic store (default: a temp dir)")
    parser.add_argument("--compare", type=Path, default=None, help="another checkout to run and compare with")
    args = parser.parse_args()
    layout = smollm2_layout(args.vocab, args.layers)
    here = Path(__file__).resolve().parents[1]
    root = args.root or tempfile.mkdtemp(prefix="covgrad-masks-bench-")
    try:
        t0 = time.perf_counter()
        write_stats(root, layout, args.seed)
        print(f"P = {layout.P:,} in {len(layout.entries)} tensors; stats written in {time.perf_counter() - t0:.0f} s\n")
        print("| code | s | peak resident GiB |\n|---|---|---|")
        runs = {"new": here} | ({"old": args.compare.resolve()} if args.compare else {})
        for key, src in runs.items():
            seconds, peak = run_child(root, key, src)
            print(f"| {key} ({src}) | {seconds:.1f} | {peak:.2f} |")
        if args.compare:
            print("\n" + "\n".join(compare(Path(root, "masks", "new"), Path(root, "masks", "old"))))
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
