#!/usr/bin/env bash
# Runs the whole test suite with the real services around it: starts the collector, Jaeger
# and Prometheus built by `scripts/services.sh build`, runs pytest, and always stops them.
set -uo pipefail
venv=${1:-${OTEL_STRAGGLER_VENV:-$HOME/.cache/otel-straggler/venv}}
shift || true
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export PATH="$venv/bin:$PATH"

scripts/services.sh start || { echo "services failed to start"; scripts/services.sh stop; exit 1; }
trap 'scripts/services.sh stop' EXIT
# the pipeline tests reuse this stack instead of starting their own
export OTEL_STRAGGLER_SERVICES_ENV="${OTEL_STRAGGLER_SERVICES_DIR:-$repo/.services}/env"
python -m pytest -q -p no:cacheprovider "$@"
