# Sourced by the checks that run on another Python than the main virtualenv's:
#   find_python X.Y  prints the path of a working pythonX.Y (on PATH, else pyenv's newest X.Y.*),
#                    or nothing when this machine has none.
find_python() {
  local version=$1 python
  python=$(command -v "python$version" || true)
  if [ -z "$python" ] || ! "$python" -c '' 2>/dev/null; then  # a pyenv shim without that version fails here
    python=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
  fi
  echo "$python"
}
