#!/usr/bin/env bash
# The suite's torch-free part (rank instrumentation, detector, span encoding) on the lowest Python
# the package declares (requires-python), C extensions included, so that the floor stays true, and
# on the oldest OpenTelemetry it allows: every opentelemetry-* lower bound of pyproject.toml is
# pinned here (a pip constraints file), while the main virtualenv has what pip picks, the newest at
# its install; the line before the tests names the SDK each one has.
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

# "opentelemetry-sdk>=1.45.2,<2" -> opentelemetry-sdk==1.45.2, from the dependencies and the extras
constraints="$venv.otel-floor.txt"
mkdir -p "$(dirname "$venv")"
sed -n 's/^ *"\(opentelemetry-[a-z-]*\)>=\([^,"]*\).*/\1==\2/p' "$repo/pyproject.toml" | sort -u > "$constraints"
otel_floor=$(sed -n 's/^opentelemetry-sdk==//p' "$constraints")
[ -n "$otel_floor" ] || { echo "scripts/test_python_floor.sh: no \"opentelemetry-sdk>=X\" in pyproject.toml" >&2; exit 1; }

PYTHON=$python "$repo/scripts/setup_venv.sh" "$venv" instrument "pytest>=8" "hypothesis>=6.100" "pyyaml>=6" \
  -c "$constraints"

cd "$repo"
# the extensions are optional at install and their tests skip without them outside CI: here they
# must import (a build that does not import on this Python is what this check is for)
"$venv/bin/python" -c 'import otel_straggler.instrumentation._hot_path, otel_straggler.instrumentation._otlp_write, otel_straggler.detector._otlp_scan, otel_straggler.detector._ingest' \
  || { echo "python floor check: the C extensions do not import on $("$venv/bin/python" --version)" >&2; exit 1; }
sdk_version() { "$1" -c 'from importlib.metadata import version; print(version("opentelemetry-sdk"))' 2>/dev/null; }
sdk=$(sdk_version "$venv/bin/python")
[ "$sdk" = "$otel_floor" ] \
  || { echo "python floor check: opentelemetry-sdk $sdk installed, not the oldest allowed ($otel_floor)" >&2; exit 1; }
main_venv=${OTEL_STRAGGLER_VENV:-$HOME/.cache/otel-straggler/venv}
main_sdk=$(sdk_version "$main_venv/bin/python" || true)
echo "torch-free tests on $("$venv/bin/python" --version) with opentelemetry-sdk $sdk, the oldest pyproject.toml" \
  "allows (the main suite's: ${main_sdk:-not installed})"
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/instrumentation tests/detector tests/equivalence/test_span_encoding.py "$@"
