#!/usr/bin/env bash
# The suite's torch-free part (rank instrumentation, detector, span encoding) on the lowest Python
# the package declares (requires-python), C extensions included, so that the floor stays true.
# Its virtualenv (scripts/setup_venv.sh) is kept beside the main one and reused; torch is not
# installed there (tests that need it skip). Where that Python is missing, the check says it did
# not run; under CI it fails.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
floor=$(sed -n 's/^requires-python = ">=\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")
[ -n "$floor" ] || { echo "scripts/test_python_floor.sh: cannot read requires-python = \">=X.Y\" in pyproject.toml" >&2; exit 1; }
venv=${OTEL_STRAGGLER_FLOOR_VENV:-$HOME/.cache/otel-straggler/venv-py$floor}

. "$repo/scripts/find_python.sh"
need_python "$floor" "python floor check" "requires-python >=$floor"

PYTHON=$python "$repo/scripts/setup_venv.sh" "$venv" instrument "pytest>=8" "hypothesis>=6.100" "pyyaml>=6"

cd "$repo"
# the extensions are optional at install and their tests skip without them outside CI: here they
# must import (a build that does not import on this Python is what this check is for)
"$venv/bin/python" -c 'import otel_straggler.instrumentation._hot_path, otel_straggler.instrumentation._otlp_write, otel_straggler.detector._otlp_scan, otel_straggler.detector._ingest' \
  || { echo "python floor check: the C extensions do not import on $("$venv/bin/python" --version)" >&2; exit 1; }
echo "torch-free tests on $("$venv/bin/python" --version)"
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/instrumentation tests/detector tests/equivalence/test_span_encoding.py "$@"
