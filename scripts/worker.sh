#!/usr/bin/env bash
# A process worker on $COVGRAD_POOL in the foreground: it runs each flow run in a subprocess inside
# $COVGRAD_HOME. Never installs packages. To stop it from a script, send SIGTERM twice.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$COVGRAD_HOME"
exec prefect worker start --pool "$COVGRAD_POOL" --type process --install-policy never "$@"
