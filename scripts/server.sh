#!/usr/bin/env bash
# A Prefect server (SQLite in $PREFECT_HOME) on $COVGRAD_PREFECT_HOST:$COVGRAD_PREFECT_PORT, in the
# foreground; stop it with one SIGTERM or Ctrl-C. The UI follows PREFECT_SERVER_UI_ENABLED.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
mkdir -p "$PREFECT_HOME"
ui="--no-ui"
if [ "$PREFECT_SERVER_UI_ENABLED" = "true" ]; then ui="--ui"; fi
exec prefect server start --host "$COVGRAD_PREFECT_HOST" --port "$COVGRAD_PREFECT_PORT" "$ui" --analytics-off
