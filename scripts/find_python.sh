# Sourced by the checks that run on another Python than the main virtualenv's.
#   find_python X.Y         prints the path of a working pythonX.Y (on PATH, else pyenv's newest
#                           X.Y.*), or nothing when this machine has none
#   need_python X.Y CHECK WHY
#                           sets $python to it, or says CHECK did not run (WHY) and exits: 0, but 1
#                           under CI, where every check must run
find_python() {
  local version=$1 found
  found=$(command -v "python$version" || true)
  if [ -z "$found" ] || ! "$found" -c '' 2>/dev/null; then  # a pyenv shim without that version fails here
    found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
  fi
  echo "$found"
}

need_python() {
  python=$(find_python "$1")
  if [ -z "$python" ]; then
    echo "$2 NOT RUN: no python$1 on this machine ($3)" >&2
    case "${CI:-}" in ""|false|0) exit 0 ;; *) exit 1 ;; esac
  fi
}
