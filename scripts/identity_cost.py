"""Cost of the model identity on SmolLM2-135M: model_identity against one forward pass (8 × 64 tokens), side by side."""

import time

import torch

from covgrad.identity import model_identity
from storage.models import load_model

torch.manual_seed(0)
ids = torch.randint(0, 49152, (8, 64))
for dtype in ("float32", "bfloat16"):
    m = load_model("/work/models/smollm2-135m-instruct", dtype)
    b = sum(p.numel() * p.element_size() for p in m.parameters())
    h, f = [], []
    for _ in range(3):
        t = time.perf_counter()
        model_identity(m.named_parameters())
        h.append(time.perf_counter() - t)
        with torch.no_grad():
            t = time.perf_counter()
            m(input_ids=ids)
            f.append(time.perf_counter() - t)
    print(f"{dtype}: {b / 1e6:.0f} MB, identity {min(h):.2f} s, forward {min(f):.2f} s, ratio {min(h) / min(f):.2f}")
