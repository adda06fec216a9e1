#!/usr/bin/env bash
# The suite's torch-free part (rank instrumentation, detector, span encoding) on the lowest Python
# the package declares (requires-python), C extensions included, so that the floor stays true.
# Its virtualenv is kept beside the main one and reused; torch is not installed there (tests that
# need it skip). Where that Python is missing, the check says it did not run; under CI it fails.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
floor=$(sed -n 's/^requires-python = ">=\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")
venv=${OTEL_STRAGGLER_FLOOR_VENV:-$HOME/.cache/otel-straggler/venv-py$floor}

python=$(command -v "python$floor" || true)
if [ -z "$python" ] || ! "$python" -c '' 2>/dev/null; then  # a pyenv shim without that version fails here
  python=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$floor".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
fi
if [ -z "$python" ]; then
  echo "python floor check NOT RUN: no python$floor on this machine (requires-python >=$floor)" >&2
  [ "${CI:-}" = true ] && exit 1
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "creating virtualenv $venv ($("$python" --version))"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
# as scripts/setup_venv.sh: reinstall when the dependencies, the C sources or the checkout moved
stamp="$venv/.otel-straggler-installed"
want="$(cat "$repo/pyproject.toml" "$repo/setup.py" "$repo"/otel_straggler/*/*.c | sha256sum | cut -d' ' -f1) $repo"
built=yes
suffix=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for source in "$repo"/otel_straggler/*/_*.c; do
  [ -e "${source%.c}$suffix" ] || built=no
done
if [ "$built" = no ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing otel-straggler (without torch) into $venv"
  "$venv/bin/python" -m pip install -q -e "$repo[instrument]" "pytest>=8" "hypothesis>=6.100" "pyyaml>=6"
  echo "$want" > "$stamp"
fi

cd "$repo"
echo "torch-free tests on $("$venv/bin/python" --version)"
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/instrumentation tests/detector tests/equivalence/test_span_encoding.py "$@"
