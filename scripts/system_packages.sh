#!/usr/bin/env bash
# Debian packages the suite uses beyond Python: chromium (the report's HTML checked in a headless browser,
# tests/report/test_report_browser.py). Installed with apt-get when missing and this user may (root, apt-get
# present); otherwise one line says which test will skip and how to install it. About 55 s and 115 MB on Debian 12.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends chromium >/dev/null
else
  echo "system_packages: no chromium and no root apt-get here; the browser test skips (apt-get install chromium)"
fi
