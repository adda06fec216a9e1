#!/usr/bin/env bash
# Creates (or reuses) the project's one virtualenv and installs the package with its test and
# lint extras. torch comes from PyPI (the CUDA build, several GB): the venv is kept outside the
# checkout so every clone on this machine shares one download.
#   scripts/setup_venv.sh [VENV] [PACKAGE-EXTRAS [MORE-REQUIREMENTS...]]
# PACKAGE-EXTRAS defaults to "test,lint"; PYTHON picks the interpreter the venv is made from.
# MORE-REQUIREMENTS go to pip as they are, so pip options such as `-c CONSTRAINTS-FILE` work too.
set -euo pipefail
venv=${1:-${OTEL_STRAGGLER_VENV:-$HOME/.cache/otel-straggler/venv}}
extras=${2:-test,lint}
requirements=("${@:3}")
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  case ",$extras,${requirements[*]}" in
    *,test,*|*torch*) echo "creating virtualenv $venv: downloads torch with its CUDA libraries" \
      "(5-6 GB installed); about a minute with pip's cache warm, longer on a first download" ;;
    *) echo "creating virtualenv $venv" ;;
  esac
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
# Skip pip when neither the dependency list, the C extensions' sources nor the checkout's location
# changed, and the extensions are built in this checkout (the editable install builds them in
# place: a fresh clone at the same path has the same stamp but none of them).
stamp="$venv/.otel-straggler-installed"
want="$(cat "$repo/pyproject.toml" "$repo/setup.py" "$repo"/otel_straggler/*/*.c | sha256sum | cut -d' ' -f1) $repo [$extras] ${requirements[*]}"
built=yes
suffix=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for source in "$repo"/otel_straggler/*/_*.c; do
  [ -e "${source%.c}$suffix" ] || built=no  # this Python's build: another's may sit beside it
done
if [ "$built" = no ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing otel-straggler[$extras]${requirements[*]:+ ${requirements[*]}} into $venv"
  # setuptools notes that an editable install resolves the package through a finder and that a
  # folder named like the package could shadow it: here that folder is the package itself.
  PYTHONWARNINGS="ignore:Editable installation" \
    "$venv/bin/python" -m pip install -q -e "$repo[$extras]" "${requirements[@]}"
  echo "$want" > "$stamp"
fi
