#!/usr/bin/env bash
# Every public header compiles on its own, with the public include directory as the only
# include path (abseil from the system's): a translation unit of nothing but
# `#include "kvtier/<header>"` for each include/kvtier/*.h as C++20, and kvtier/c_api.h also
# as C99. An installed tree holds exactly these headers, so a header that needs an internal
# one, or relies on another to be included first, fails here.
#
#   header_test.sh INCLUDE_DIR CXX_COMPILER C_COMPILER [EXTRA_INCLUDE_DIR...]
# EXTRA_INCLUDE_DIR: abseil's include directory when it is not one the compiler searches.
set -euo pipefail

if [ "$#" -lt 3 ]; then
  echo "usage: $0 INCLUDE_DIR CXX_COMPILER C_COMPILER [EXTRA_INCLUDE_DIR...]" >&2
  exit 2
fi
include_dir=$(cd "$1" && pwd)
cxx=$2
cc=$3
shift 3
extra=()
for dir in "$@"; do extra+=("-I$dir"); done

# Compile from an empty directory: the TUs come from stdin, and `#include "..."` in them
# searches the working directory first.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

shopt -s nullglob
headers=("$include_dir"/kvtier/*.h)
if [ "${#headers[@]}" -eq 0 ]; then
  echo "header_test: no headers in $include_dir/kvtier" >&2
  exit 1
fi

failed=0
checked=0
check() {  # check LABEL COMPILER ARGS...: compiles the TU on stdin
  local label=$1
  shift
  local out
  if ! out=$("$@" 2>&1); then
    echo "FAIL: $label"
    echo "$out" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
  checked=$((checked + 1))
}

for path in "${headers[@]}"; do
  h=$(basename "$path")
  check "kvtier/$h (C++20)" "$cxx" -std=c++20 -fsyntax-only -x c++ "-I$include_dir" \
    ${extra[@]+"${extra[@]}"} - <<<"#include \"kvtier/$h\""
  if [ "$h" = "c_api.h" ]; then
    check "kvtier/$h (C99)" "$cc" -std=c99 -fsyntax-only -x c "-I$include_dir" \
      ${extra[@]+"${extra[@]}"} - <<<"#include \"kvtier/$h\""
  fi
done

if [ "$failed" -ne 0 ]; then
  echo "header_test: $failed of $checked compilations failed"
  exit 1
fi
echo "header_test: ${#headers[@]} headers, $checked compilations, all self-contained"
