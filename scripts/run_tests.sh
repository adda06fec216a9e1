#!/usr/bin/env bash
# Runs the whole test suite. The pipeline tests start the real collector, Jaeger and Prometheus
# (built by `scripts/services.sh build`) themselves, on free loopback ports, once the suite gets
# to them, and always stop them: a gateway started minutes before its detector shard backs off
# its reconnects for minutes, so the stack must start fresh, right before the tests that use it.
set -uo pipefail
venv=${1:-${OTEL_STRAGGLER_VENV:-$HOME/.cache/otel-straggler/venv}}
shift || true
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export PATH="$venv/bin:$PATH"
# ruff and mypy on the package first: a finding fails the run, after the tests have run too
scripts/lint.sh "$venv"
lint=$?
# the slowest tests named at the end: what to look at when the run nears its time budget
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
suite=$?
# the torch-free part again on the lowest Python the package declares (only with no arguments:
# arguments select tests of the main run)
floor=0
if [ $# -eq 0 ]; then
  scripts/test_python_floor.sh
  floor=$?
fi
# install() against Megatron-LM's real training package (megatron-core 0.19, Python 3.12), in its
# own virtualenv; likewise only with no arguments
megatron_lm=0
if [ $# -eq 0 ]; then
  scripts/test_megatron_lm.sh
  megatron_lm=$?
fi
exit $(( suite != 0 ? suite : lint != 0 ? lint : floor != 0 ? floor : megatron_lm ))
