#!/usr/bin/env bash
# Checks that every C++/CUDA source in the repository follows .clang-format
# (clang-format 14, Debian's clang-format package). Prints the files that do
# not, with the command that fixes them; exit 1 if any.
#   tools/format_check.sh          check
#   tools/format_check.sh --fix    rewrite the files in place
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  -h|--help)
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    exit 0 ;;
  --fix|"") ;;
  *) echo "format_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

cf=$(command -v clang-format || command -v clang-format-14 || true)
if [[ -z $cf ]]; then
  echo "format_check: clang-format not found (tools/setup.sh installs it)" >&2
  exit 1
fi

mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [[ ${1:-} == --fix ]]; then
  "$cf" -i "${files[@]}"
  echo "format_check: formatted ${#files[@]} files"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  if ! "$cf" --dry-run -Werror "$f" >/dev/null 2>&1; then
    bad+=("$f")
  fi
done
if [[ ${#bad[@]} -ne 0 ]]; then
  echo "format_check: ${#bad[@]} of ${#files[@]} sources do not follow .clang-format:"
  printf '  %s\n' "${bad[@]}"
  echo "fix with: tools/format_check.sh --fix"
  exit 1
fi
echo "format_check: all ${#files[@]} C++/CUDA sources follow .clang-format"
