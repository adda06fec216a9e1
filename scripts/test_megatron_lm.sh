#!/usr/bin/env bash
# install() and our timers against Megatron-LM's real training package (megatron/training/:
# global_vars, arguments, training_log), which the megatron-core 0.19.2 wheel ships (Python 3.12
# only; 0.16.1, the main suite's, has none). Its virtualenv (scripts/setup_venv.sh) is kept beside
# the main one and reused (the first build downloads torch). Where Python 3.12 is missing, the
# check says it did not run; under CI it fails.
#   scripts/test_megatron_lm.sh [PYTEST-ARGS...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
version=3.12
venv=${OTEL_STRAGGLER_MEGATRON_VENV:-$HOME/.cache/otel-straggler/venv-megatron-lm}

. "$repo/scripts/find_python.sh"
need_python "$version" "Megatron-LM check" "megatron-core 0.19.2, which ships megatron.training, is for Python $version"

PYTHON=$python "$repo/scripts/setup_venv.sh" "$venv" instrument "pytest>=8" "torch>=2.6" "megatron-core==0.19.2"

cd "$repo"
echo "Megatron-LM training package tests on $("$venv/bin/python" --version)"
# the stage map against this megatron-core too: it has Megatron-LM's own timer names
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/megatron_lm \
  tests/instrumentation/test_stage_names.py "$@"
