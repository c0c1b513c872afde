#!/usr/bin/env bash
# The installed package works for an engine outside kvtier's tree, from wherever it is put:
#   1. cmake --install BUILD into a temporary prefix, then move the prefix elsewhere;
#   2. check its layout: libkvtier.so with its soname links, exactly include/kvtier/*.h,
#      kvtierd, the CMake package and kvtier.pc, no path of the build or source tree or of
#      the prefix before the move, and libkvtier.so exporting only kvtier's API (the
#      functions of kvtier/cuda.h included);
#   3. build tests/install/consumer against the moved prefix (find_package(kvtier) for C++,
#      pkg-config for C);
#   4. start the installed kvtierd on private sockets and run both consumers against it,
#      without LD_LIBRARY_PATH (they find libkvtier.so by their RPATH); stop the daemon.
#
#   install_consumer_test.sh BUILD_DIR CONSUMER_SOURCE_DIR [CMAKE_COMMAND]
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: $0 BUILD_DIR CONSUMER_SOURCE_DIR [CMAKE_COMMAND]" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
consumer_src=$(cd "$2" && pwd)
cmake=${3:-cmake}
source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-install.XXXXXX")
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

step() { echo "== $*"; }
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
# run LOG CMD...: runs CMD with its output in LOG, shown only when CMD fails.
run() {
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    fail "$*"
  fi
}

# ---- 1. install, then move -------------------------------------------------------------------
step "install $build into a temporary prefix"
run "$tmp/install.log" "$cmake" --install "$build" --prefix "$tmp/prefix"
mv "$tmp/prefix" "$tmp/moved"
prefix=$tmp/moved
step "moved the prefix to $prefix"

# ---- 2. layout -------------------------------------------------------------------------------
step "check the installed layout"
pc=$(find "$prefix" -name kvtier.pc -path '*/pkgconfig/*')
[ -n "$pc" ] || fail "no pkgconfig/kvtier.pc under the prefix"
libdir=$(dirname "$(dirname "$pc")")
for f in "$libdir/libkvtier.so" "$libdir/libkvtier.so.0" "$prefix/bin/kvtierd" \
  "$libdir/cmake/kvtier/kvtierConfig.cmake" "$libdir/cmake/kvtier/kvtierConfigVersion.cmake" \
  "$libdir/cmake/kvtier/kvtierTargets.cmake" "$prefix/share/kvtier/kvtierd.example.toml"; do
  [ -e "$f" ] || fail "missing ${f#"$prefix"/}"
done
[ -L "$libdir/libkvtier.so" ] || fail "lib/libkvtier.so is not a symlink"
soname=$(readelf -d "$libdir/libkvtier.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libkvtier.so.0" ] || fail "libkvtier.so has SONAME '$soname', expected libkvtier.so.0"

expected_headers=$(cd "$source_dir/include/kvtier" && printf '%s\n' *.h | sort)
installed_headers=$(cd "$prefix/include/kvtier" && find . -type f | sed 's|^\./||' | sort)
if [ "$expected_headers" != "$installed_headers" ]; then
  diff <(echo "$expected_headers") <(echo "$installed_headers") >&2 || true
  fail "include/kvtier holds other files than the source tree's include/kvtier/*.h"
fi

# Nothing installed may point at the build tree, the source tree or the prefix before the move.
for path in "$build" "$source_dir" "$tmp/prefix"; do
  if grep -rlF -- "$path" "$libdir/cmake" "$libdir/pkgconfig"; then
    fail "the files above name $path: the package is not relocatable"
  fi
  for bin in "$libdir/libkvtier.so" "$prefix/bin/kvtierd"; do
    if readelf -d "$bin" | grep -E 'R(UN)?PATH' | grep -qF -- "$path"; then
      fail "${bin#"$prefix"/} has an RPATH into $path"
    fi
  done
done

# libkvtier.so exports kvtier's API only: no abseil, gRPC, protobuf or upb symbol.
exported=$(nm -D --defined-only "$libdir/libkvtier.so" | awk '{print $3}')
demangled=$(c++filt <<<"$exported")
dependency='(absl|grpc|grpc_impl|grpc_core|google|upb|re2)::'
leaked=$(grep -E "^((typeinfo( name)?|vtable|VTT|guard variable) for )?$dependency|^(grpc|gpr|upb|absl)_" \
  <<<"$demangled" || true)
if [ -n "$leaked" ]; then
  head -n 20 <<<"$leaked" >&2
  fail "libkvtier.so exports $(wc -l <<<"$leaked") symbols of its dependencies"
fi
for sym in kvtier_connect kvtier_decode; do
  grep -qx -- "$sym" <<<"$exported" || fail "libkvtier.so does not export $sym"
done
grep -q '^kvtier::Client::Connect(' <<<"$demangled" ||
  fail "libkvtier.so does not export kvtier::Client::Connect"
# kvtier/cuda.h is defined in every build (by the CUDA backend, or by its stub).
for fn in NativeCudaStream AdoptCudaStream CudaDeviceOrdinal; do
  grep -q "^kvtier::$fn(" <<<"$demangled" || fail "libkvtier.so does not export kvtier::$fn"
done
echo "libkvtier.so: $(wc -l <<<"$exported") exported symbols, none of its dependencies"

# ---- 3. build the consumer against the moved prefix -----------------------------------------
step "build $consumer_src against the moved prefix"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
run "$tmp/consumer-configure.log" "$cmake" -S "$consumer_src" -B "$tmp/consumer" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
found=$(sed -n 's/^kvtier_DIR:PATH=//p' "$tmp/consumer/CMakeCache.txt")
[ "$found" = "$libdir/cmake/kvtier" ] || fail "find_package(kvtier) found '$found', not the moved prefix"
run "$tmp/consumer-build.log" "$cmake" --build "$tmp/consumer"

# ---- 4. run it against the installed kvtierd -------------------------------------------------
step "start the installed kvtierd"
socket=$tmp/kvtierd.sock
attach=$tmp/attach.sock
# A small arena of normal pages, not locked: nothing that needs privileges.
cat >"$tmp/kvtierd.toml" <<'EOF'
[server]
cpu_threads = 2
shutdown_grace_ms = 2000

[limits]
max_tokens_per_session = 4096
max_tokens_per_offload = 4096
default_max_tokens = 1024

[log]
level = "warn"

[[tenant]]
name = "default"
host_memory_bytes = 67108864  # 64 MiB
hugepages = "off"
lock = false
EOF
kvtierd=("$prefix/bin/kvtierd" --config "$tmp/kvtierd.toml" --unix-socket "$socket"
  --attach-socket "$attach")
run "$tmp/check-config.log" "${kvtierd[@]}" --check-config
"${kvtierd[@]}" >"$tmp/kvtierd.log" 2>&1 &
daemon_pid=$!
daemon_failed() {
  echo "---- kvtierd log" >&2
  tail -n 50 "$tmp/kvtierd.log" >&2 || true
  fail "$*"
}
for _ in $(seq 200); do
  [ -S "$socket" ] && [ -S "$attach" ] && break
  kill -0 "$daemon_pid" 2>/dev/null || daemon_failed "kvtierd exited during start-up"
  sleep 0.1
done
[ -S "$socket" ] && [ -S "$attach" ] || daemon_failed "kvtierd did not create its sockets in 20 s"

step "run consumer_cpp and consumer_c"
for consumer in consumer_cpp consumer_c; do
  if ! env -u LD_LIBRARY_PATH "$tmp/consumer/$consumer" "unix://$socket"; then
    daemon_failed "$consumer against the installed kvtierd"
  fi
done

step "stop kvtierd"
kill -TERM "$daemon_pid"
for _ in $(seq 200); do
  kill -0 "$daemon_pid" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$daemon_pid" 2>/dev/null && daemon_failed "kvtierd did not stop within 20 s of SIGTERM"
status=0
wait "$daemon_pid" || status=$?
daemon_pid=""
[ "$status" -eq 0 ] || daemon_failed "kvtierd exited with status $status after SIGTERM"
echo "install_consumer: OK"
