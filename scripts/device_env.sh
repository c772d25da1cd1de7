# Sourced on the device machine from the repository root (scripts/stage_device.sh copies it
# to .device/env.sh). Unpacks what .device/ carries into /tmp/dspark-device once per machine
# (each part of the CuTe DSL as it arrives: a fresh machine gets them over two calls), then
# puts the DSL, nox and the packages on the paths. Keeps NVLink multicast off.
_dev=/tmp/dspark-device
mkdir -p "$_dev/site"
for _t in .device/cutedsl-*.tar.xz; do
  [ -e "$_t" ] || continue
  _mark="$_dev/.$(basename "$_t").done"
  if [ ! -e "$_mark" ]; then
    tar -C "$_dev/site" -xJf "$_t" && touch "$_mark"
  fi
done
if [ -d .device/wheels ] && [ ! -e "$_dev/.wheels.done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$_dev/site" .device/wheels/*.whl \
    && touch "$_dev/.wheels.done"
fi
# The packages' entry points (dspark.kernels, dspark.tp_demos) for their src/ on PYTHONPATH.
python3 scripts/dev_entry_points.py "$_dev/meta" >/dev/null
_src=$(printf '%s:' "$PWD"/packages/*/src)
export PYTHONPATH="$_dev/site/nvidia_cutlass_dsl/dsl_packages:$_dev/site/nvidia_cutlass_dsl/python_packages:$_dev/site:$_dev/meta:${_src}$PWD/packages/dspark-comm/tests${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_dev/site/bin:$PATH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# A split release (4.8: parts a and b, one a call) or one whole tarball (4.3.5: python_packages/).
if [ ! -e "$_dev/site/nvidia_cutlass_dsl/python_packages/cutlass" ] && { \
   [ ! -e "$_dev/site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs" ] \
   || ! ls "$_dev"/.cutedsl-*-a.tar.xz.done >/dev/null 2>&1 || ! ls "$_dev"/.cutedsl-*-b.tar.xz.done >/dev/null 2>&1; }; then
  echo "env.sh: the CuTe DSL is not fully unpacked yet (carry both parts, one a call)" >&2
fi
unset _dev _t _mark _src
