#!/usr/bin/env bash
# The GPU checks of the scores stage in one run, for a machine with one CUDA device and PyTorch, Triton and
# transformers but none of the pipeline's storage or orchestration packages (no zarr, dask, prefect,
# pydantic): the cuda exactness tests (FSDP2 with one nccl rank against the plain path, and the regime folds'
# prompt-group state, included), then benchmarks.scores on the 134M fp32 and 0.85B bf16 Llamas, then
# benchmarks.regimes (scores plus one regime's g in one pass) on the 134M, then benchmarks.inrun (the trainer's
# step with and without in-run folding at every_n 1 and 10) on the 134M.
# Everything printed is also written under $OUT (default ./gpu-check): env.txt, cuda_tests.txt,
# bench_scores.txt, bench_regimes.txt, bench_inrun.txt.
#
#   PY=python3 OUT=/tmp/gpu-check bash scripts/gpu_check.sh           # on the GPU machine
#   PY=.venv/bin/python bash scripts/gpu_check.sh --dry-run            # on a CPU: tests skip, benchmark refused
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONPATH=.
status=0
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt" || status=1
# the tests' conftest sets up Prefect and the demo run; the cuda tests need neither
"$PY" -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_cuda.py tests/tokens/test_token_fisher.py tests/gpu/test_fsdp_cuda.py -m gpu -rs \
    2>&1 | tee "$OUT/cuda_tests.txt" || status=1
if [ "${1:-}" != "--dry-run" ]; then
    "$PY" -m benchmarks.scores --device cuda --model llama-134m llama-0.85b --reps 3 2>&1 \
        | tee "$OUT/bench_scores.txt" || status=1
    "$PY" -m benchmarks.regimes --device cuda --model llama-134m --reps 3 2>&1 \
        | tee "$OUT/bench_regimes.txt" || status=1
    "$PY" -m benchmarks.inrun --device cuda --model llama-134m --every 1 10 --steps 1 --reps 1 2>&1 \
        | tee "$OUT/bench_inrun.txt" || status=1
fi
exit $status
