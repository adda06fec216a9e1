#!/usr/bin/env bash
# The package's linter and type checker, with the settings of pyproject.toml ([tool.ruff],
# [tool.mypy]), from the virtualenv that has the package's dependencies and its `lint` extra.
# Both run; the exit status is non-zero when either finds anything.
#   scripts/lint.sh [VENV]
set -uo pipefail
venv=${1:-${OTEL_STRAGGLER_VENV:-$HOME/.cache/otel-straggler/venv}}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
"$venv/bin/python" -m ruff check
ruff=$?
"$venv/bin/python" -m mypy
mypy=$?
exit $(( ruff != 0 ? ruff : mypy ))
