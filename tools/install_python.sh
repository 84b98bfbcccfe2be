#!/usr/bin/env bash
# Installs the shardopt Python package for Debian's /usr/bin/python3 without
# PYTHONPATH: builds //python:shardopt, copies it to a stable directory and
# puts a shardopt.pth file naming that directory into the user site-packages
# (pip is not needed; Debian's python3-torch 1.13 must be installed, as
# tools/setup.sh does). Re-run after rebuilding to update the copy.
#
# usage: tools/install_python.sh [--prefix DIR]   (default ~/.local/share/shardopt)
#        tools/install_python.sh --uninstall
set -euo pipefail
cd "$(dirname "$0")/.."
PY=/usr/bin/python3
prefix="${HOME}/.local/share/shardopt"
mode=install
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) prefix="${2:?--prefix needs a directory}"; shift 2 ;;
    --prefix=*) prefix="${1#--prefix=}"; shift ;;
    --uninstall) mode=uninstall; shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install_python: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
site=$($PY -c 'import site; print(site.getusersitepackages())')
pth="$site/shardopt.pth"
if [[ $mode == uninstall ]]; then
  if [[ -f $pth ]]; then
    dir=$(cat "$pth")
    rm -f "$pth"
    [[ -d $dir/shardopt ]] && rm -rf "$dir/shardopt"
    echo "install_python: removed $pth and $dir/shardopt"
  else
    echo "install_python: nothing installed ($pth does not exist)"
  fi
  exit 0
fi
if ! $PY -c 'import torch' 2>/dev/null; then
  echo "install_python: $PY cannot import torch: run tools/setup.sh (python3-torch)" >&2
  exit 1
fi
if [[ -z ${SHARDOPT_SKIP_BUILD:-} ]]; then
  bazel build //python:shardopt
fi
src="$(bazel info bazel-bin 2>/dev/null)/python/shardopt"
[[ -f $src/_C.so ]] || { echo "install_python: $src/_C.so is missing (build failed?)" >&2; exit 1; }
mkdir -p "$prefix" "$site"
rm -rf "$prefix/shardopt.new"
cp -rL "$src" "$prefix/shardopt.new"
chmod -R u+w "$prefix/shardopt.new"
rm -f "$prefix/shardopt.new"/*.params
rm -rf "$prefix/shardopt"
mv "$prefix/shardopt.new" "$prefix/shardopt"
echo "$prefix" > "$pth"
cd /
$PY -c 'import shardopt, sys; print("install_python: shardopt installed in", shardopt.__path__[0], file=sys.stderr)'
echo "install_python: $pth -> $prefix (remove with --uninstall)"
