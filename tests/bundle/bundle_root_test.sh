#!/usr/bin/env bash
# The GPU bundle runs where nothing of kvtier's build is: packs the bundle from this build
# (scripts/gpu-bundle --no-build), makes a minimal Debian root from Debian packages
# (debootstrap --variant=minbase, Debian 11: its C library, 2.31, is older than the build
# machine's, so the bundle must bring its own), gives it what a GPU host has and a CPU build
# machine can lend -- the CUDA toolkit's libraries, bind-mounted read-only, and no driver --
# and runs the bundle's `run` there, chrooted in a private mount namespace. Then checks: it
# exits 0; the results directory holds run.log, summary.json and raw.tar.gz and nothing
# else; the run finished; it found no CUDA device and said why; every CUDA check was skipped
# for that reason; every CPU check passed (the op table's cpu cases, the host-waits test, the
# engine's golden test); the bundle ran on the root's C library version, not this machine's.
#
#   tests/bundle/bundle_root_test.sh BUILD_DIR SOURCE_DIR
#
# Needs root (chroot, mounts), debootstrap, patchelf and xz (scripts/setup installs them),
# and Debian's package mirror the first time; the root is cached as a tarball under
# $KVTIER_ROOTFS_CACHE (default /var/cache/kvtier). Without root or the tools it exits 77
# (skipped), except with CI=true, where it fails.
set -euo pipefail
BUILD=$(realpath "${1:?usage: bundle_root_test.sh BUILD_DIR SOURCE_DIR}")
SRC=$(realpath "${2:?usage: bundle_root_test.sh BUILD_DIR SOURCE_DIR}")
SUITE=bullseye
SUITE_GLIBC=2.31

skip() {
  if [ "${CI:-}" = true ]; then echo "bundle_root_test: FAIL: $*" >&2; exit 1; fi
  echo "bundle_root_test: skipped: $*"
  exit 77
}
[ "$(id -u)" = 0 ] || skip "needs root (chroot and mounts)"
for t in debootstrap patchelf xz unshare chroot; do
  command -v "$t" >/dev/null 2>&1 || skip "$t is not installed (scripts/setup installs it)"
done
CUDA_LIB=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  if [ -d "$d" ]; then CUDA_LIB=$(realpath "$d"); break; fi
done

WORK=$(mktemp -d /tmp/kvtier-bundle-root.XXXXXX)
cleanup() {
  # The mounts live in the namespace that ended with unshare; only files are left.
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "bundle_root_test: packing the bundle from $BUILD"
bash "$SRC/scripts/gpu-bundle" --build-dir "$BUILD" --no-build --out "$WORK/bundle.tar"

# The minimal root, cached: debootstrap once, then a tarball.
CACHE_DIR=${KVTIER_ROOTFS_CACHE:-/var/cache/kvtier}
CACHE=$CACHE_DIR/debian-$SUITE-minbase.tar
ROOTFS=$WORK/root
mkdir -p "$ROOTFS" "$CACHE_DIR"
if [ ! -s "$CACHE" ]; then
  MIRROR=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources \
    2>/dev/null | head -n 1)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  echo "bundle_root_test: debootstrap --variant=minbase $SUITE (once; cached in $CACHE)"
  if ! debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
    tail -n 20 "$WORK/debootstrap.log" >&2
    echo "bundle_root_test: FAIL: debootstrap $SUITE from $MIRROR failed" >&2
    exit 1
  fi
  tar -C "$ROOTFS" -cf "$CACHE.tmp" . && mv "$CACHE.tmp" "$CACHE"
else
  tar -C "$ROOTFS" -xf "$CACHE"
fi
# None of the build's dependencies are in the root.
for lib in libabsl_base libgrpc++ libprotobuf libopenblas libicuuc libhwloc libstdc++.so.6.0.30; do
  if compgen -G "$ROOTFS/usr/lib/x86_64-linux-gnu/$lib*" >/dev/null; then
    echo "bundle_root_test: FAIL: the minimal root has $lib" >&2
    exit 1
  fi
done
tar -C "$ROOTFS/opt" -xf "$WORK/bundle.tar"
mkdir -p "$ROOTFS/results" "$ROOTFS/usr/local/cuda/lib64"

echo "bundle_root_test: running the bundle in the $SUITE root (CUDA libraries: ${CUDA_LIB:-none})"
set +e
unshare --mount --fork --pid bash -c '
  set -e
  root=$1 cuda=$2
  mount --make-rprivate /
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  if [ -n "$cuda" ]; then
    mount --bind "$cuda" "$root/usr/local/cuda/lib64"
    mount -o remount,bind,ro "$root/usr/local/cuda/lib64"
  fi
  exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    /opt/kvtier-gpu-bundle/run --results-dir /results --budget-s 400
' _ "$ROOTFS" "$CUDA_LIB" >"$WORK/run.out" 2>&1
rc=$?
set -e
cat "$WORK/run.out"
mkdir -p "$BUILD/bundle-root-results"
cp -a "$ROOTFS/results/." "$BUILD/bundle-root-results/"
bash "$SRC/scripts/gpu-check" --summarize-only "$ROOTFS/results"
[ "$rc" = 0 ] || { echo "bundle_root_test: FAIL: run exited $rc" >&2; exit 1; }

python3 - "$ROOTFS/results" "$SUITE_GLIBC" "${CUDA_LIB:+yes}" <<'PY'
import json
import os
import sys
import tarfile

results, glibc, have_cuda_libs = sys.argv[1], sys.argv[2], sys.argv[3] == "yes"
fail = []
files = sorted(os.listdir(results))
if files != ["raw.tar.gz", "run.log", "summary.json"]:
    fail.append("results directory holds %s" % files)
s = json.load(open(os.path.join(results, "summary.json")))
if s.get("finished") is not True:
    fail.append("the run did not finish")
if s.get("cuda_usable") is not False or not s.get("cuda_reason"):
    fail.append("cuda_usable %r, reason %r" % (s.get("cuda_usable"), s.get("cuda_reason")))
env = s["environment"]
if env.get("host_glibc") != "glibc " + glibc:
    fail.append("host C library %r, expected glibc %s" % (env.get("host_glibc"), glibc))
if s["bundle"]["glibc"] == glibc:
    fail.append("the bundle's own glibc is the root's")
steps = [x["step"] for x in s["steps"]]
if steps != list(range(1, 11)):
    fail.append("steps %s" % steps)
cpu_passed = set()
for c in s["checks"]:
    if c["cuda"]:
        if c["status"] != "skipped" or "no usable CUDA device" not in c["note"]:
            fail.append("cuda check %s: %s (%s)" % (c["name"], c["status"], c["note"]))
    elif c["status"] != "passed":
        fail.append("cpu check %s: %s (%s)" % (c["name"], c["status"], c["note"]))
    else:
        cpu_passed.add(c["name"])
want = {"devices", "backend_ops_cpu", "host_waits_cpu"}
if have_cuda_libs:
    want |= {"engine_golden_cpu", "kvtier-run-cpu"}  # the engine's arithmetic links cuBLAS
if not want <= cpu_passed:
    fail.append("cpu checks passed: %s, expected at least %s" % (sorted(cpu_passed), sorted(want)))
for c in s["checks"]:
    if c["name"] in ("backend_ops_cpu", "host_waits_cpu", "engine_golden_cpu") and \
            c["name"] in cpu_passed and not (c.get("gtest") or {}).get("tests"):
        fail.append("%s ran no test" % c["name"])
with tarfile.open(os.path.join(results, "raw.tar.gz")) as t:
    names = {os.path.basename(n) for n in t.getnames()}
for n in ("devices.log", "backend_ops_cpu.xml", "host_waits_cpu.xml"):
    if n not in names:
        fail.append("raw.tar.gz has no %s" % n)
if fail:
    print("bundle_root_test: FAIL:\n  " + "\n  ".join(fail))
    sys.exit(1)
print("bundle_root_test: ok: %d cpu checks passed, %d cuda checks skipped (%s); host %s, "
      "bundle glibc %s" % (len(cpu_passed), sum(c["cuda"] for c in s["checks"]),
                           s["cuda_reason"], env["host_glibc"], s["bundle"]["glibc"]))
PY
