#!/usr/bin/env bash
# Stage what a GPU run needs but the device machine lacks, in .device/ at the repository
# root (ignored by git), so the device tool can carry it:
#
#   scripts/stage_device.sh            # once per machine: downloads and repacks (a few minutes)
#
# It writes
#   .device/cutedsl-4.8.0-a.tar.xz     the CuTe DSL 4.8.0 (vLLM 0.33.0's pin) for CPython 3.12 with its
#   .device/cutedsl-4.8.0-b.tar.xz     CUDA 13 libraries, in two parts under 64 MiB each (one part a call)
#   .device/wheels/                    nox and what it needs, protobuf (the DSL needs it)
#   .device/env.sh                     source it on the device: unpacks the parts carried so far into
#                                      /tmp/dspark-device (once per machine), puts the DSL, nox and the
#                                      packages' src/ and entry-point metadata on the paths
# A fresh device machine needs two calls: the first carries part a, the second part b (a warm
# machine keeps what earlier calls unpacked); see scripts/gpu-check.sh.
set -euo pipefail
CUTEDSL_VERSION=${CUTEDSL_VERSION:-4.8.0}
root=$(git rev-parse --show-toplevel)
dir="$root/.device"
mkdir -p "$dir/wheels"
py=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [ ! -s "$dir/cutedsl-$CUTEDSL_VERSION-b.tar.xz" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q "${py[@]}" -d "$tmp" "nvidia-cutlass-dsl==$CUTEDSL_VERSION" \
    "nvidia-cutlass-dsl-libs-base==$CUTEDSL_VERSION" "nvidia-cutlass-dsl-libs-core==$CUTEDSL_VERSION" \
    "nvidia-cutlass-dsl-libs-cu13==$CUTEDSL_VERSION"
  mkdir "$tmp/site"
  for w in "$tmp"/*.whl; do (cd "$tmp/site" && python3 -m zipfile -e "$w" .); done
  # Part a: the largest library alone; part b: everything else.
  big=$(cd "$tmp/site" && find . -name '_cutlass_ir*.so' | head -n 1)
  echo "repacking the CuTe DSL $CUTEDSL_VERSION (xz, a few minutes)..."
  tar -C "$tmp/site" -cf - "$big" | xz -T0 -9 >"$dir/cutedsl-$CUTEDSL_VERSION-a.tar.xz"
  tar -C "$tmp/site" --exclude="$big" -cf - . | xz -T0 -9 >"$dir/cutedsl-$CUTEDSL_VERSION-b.tar.xz.part"
  mv "$dir/cutedsl-$CUTEDSL_VERSION-b.tar.xz.part" "$dir/cutedsl-$CUTEDSL_VERSION-b.tar.xz"
  rm -rf "$tmp"
fi
if [ -z "$(ls -A "$dir/wheels")" ]; then
  python3 -m pip download -q --no-deps -d "$dir/wheels" nox argcomplete colorlog dependency-groups virtualenv \
    distlib platformdirs filelock
  python3 -m pip download -q "${py[@]}" -d "$dir/wheels" "protobuf>=4.21.12,<8"
fi
cp "$root/scripts/device_env.sh" "$dir/env.sh"
ls -la "$dir"
echo "staged: carry [\".device/cutedsl-$CUTEDSL_VERSION-a.tar.xz\", \".device/env.sh\"] in a first call and"
echo "[\".device/cutedsl-$CUTEDSL_VERSION-b.tar.xz\", \".device/wheels\", \".device/env.sh\"] in the next;"
echo "begin each command with: source .device/env.sh &&"
