#!/usr/bin/env bash
# System packages the tests need (CI runs on a clean machine as root). Idempotent:
# installs only what is missing, and says so.
set -euo pipefail
need=()
for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "treadle: missing system packages: ${need[*]} (install them as root)" >&2
        exit 0
    fi
    echo "treadle: installing system packages: ${need[*]}" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
