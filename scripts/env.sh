# Source this file (`source scripts/env.sh`) before the other scripts: offline Prefect settings and
# the locations covgrad's deployments use. Every value can be preset in the environment.
COVGRAD_HOME="${COVGRAD_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export COVGRAD_HOME
export COVGRAD_ROOT="${COVGRAD_ROOT:-$COVGRAD_HOME/runs}"
export COVGRAD_WATCH_DIR="${COVGRAD_WATCH_DIR:-$COVGRAD_HOME/checkpoints}"
export COVGRAD_MODEL_PATH="${COVGRAD_MODEL_PATH:-$COVGRAD_HOME/model}"
export COVGRAD_POOL="${COVGRAD_POOL:-covgrad-pool}"
export COVGRAD_PREFECT_HOST="${COVGRAD_PREFECT_HOST:-127.0.0.1}"
export COVGRAD_PREFECT_PORT="${COVGRAD_PREFECT_PORT:-4371}"
export PREFECT_HOME="${PREFECT_HOME:-$HOME/.covgrad-prefect}"
export PREFECT_API_URL="${PREFECT_API_URL:-http://$COVGRAD_PREFECT_HOST:$COVGRAD_PREFECT_PORT/api}"
# The offline environment of covgrad.offline.OFFLINE_ENV (the Python side's one home; tests/flows/test_layering.py
# checks that this file exports each of its values).
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=1
export PREFECT_SERVER_UI_ENABLED="${PREFECT_SERVER_UI_ENABLED:-false}"
export PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS=false
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_DISABLE_PROGRESS_BARS="${HF_HUB_DISABLE_PROGRESS_BARS:-1}"
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-300}"
# The project's virtualenv first, so `prefect` and `covgrad` are the ones installed with covgrad.
if [ -d "$COVGRAD_HOME/.venv/bin" ]; then
    export PATH="$COVGRAD_HOME/.venv/bin:$PATH"
fi
