#!/usr/bin/env bash
# Create the process work pool (once) and register every deployment in prefect.yaml with the server at
# $PREFECT_API_URL. Extra arguments go to `prefect deploy` (default: --all).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$COVGRAD_HOME"
if ! prefect work-pool inspect "$COVGRAD_POOL" >/dev/null 2>&1; then
    prefect work-pool create "$COVGRAD_POOL" --type process
fi
if [ "$#" -eq 0 ]; then set -- --all; fi
exec prefect --no-prompt deploy "$@"
