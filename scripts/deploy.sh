#!/usr/bin/env bash
# Create the process work pool (once), store configs/demo.yaml as the Prefect variable the demo deployment
# reads, and register every deployment in prefect.yaml with the server at $PREFECT_API_URL. Extra arguments go to `prefect deploy` (default: --all).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$COVGRAD_HOME"
if ! prefect work-pool inspect "$COVGRAD_POOL" >/dev/null 2>&1; then
    prefect work-pool create "$COVGRAD_POOL" --type process
fi
# The demo deployment's config is configs/demo.yaml with root=$COVGRAD_ROOT, handed to prefect.yaml as the
# Prefect variable covgrad_demo_config (a JSON object, resolved when deploying).
demo_config="$(python -c 'import json, os, yaml
config = yaml.safe_load(open("configs/demo.yaml"))
print(json.dumps({**config, "root": os.environ["COVGRAD_ROOT"]}))')"
prefect variable set covgrad_demo_config "$demo_config" --overwrite >/dev/null
if [ "$#" -eq 0 ]; then set -- --all; fi
exec prefect --no-prompt deploy "$@"
