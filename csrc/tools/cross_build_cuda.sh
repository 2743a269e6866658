#!/bin/bash
# Build the engine's CUDA extensions (csrc/adam, csrc/fp8: the CPU and CUDA sources of each)
# on a machine WITHOUT a GPU or a CUDA torch: compile with nvcc and g++ against the headers
# of torch's CUDA wheel, unpacked (not installed, since importing it needs the NVIDIA
# runtime libraries), and link with --no-undefined, so every symbol the kernels and their
# torch bindings use must resolve in libtorch/libc10(_cuda)/libcudart. Flags are the op
# builder's own (engine/ops/builder.py), for sm_80 and sm_90. It proves the build, not the
# kernels: running them needs a GPU (tests/gpu/).
#
#   pip download torch==2.13.0 --no-deps --only-binary=:all: --isolated \
#       --index-url https://pypi.org/simple -d /tmp/cudatorch     # the cu130 wheel, 0.5 GB
#   (cd /tmp/cudatorch && unzip -q torch-2.13.0-*.whl 'torch/include/*' 'torch/lib/*' -d site)
#   csrc/tools/cross_build_cuda.sh /tmp/cudatorch/site/torch /tmp/cudatorch/out
#
# The wheel's CUDA major version must match nvcc's (cu130 and nvcc 13.0 here).
set -euo pipefail
T=${1:?usage: cross_build_cuda.sh TORCH_DIR OUT_DIR}
OUT=${2:?usage: cross_build_cuda.sh TORCH_DIR OUT_DIR}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf $OUT; mkdir -p $OUT
PYINC=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PYLIB=$(python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
read -r CXXFLAGS <<<"$(cd $REPO && python -c "from engine.ops.builder import get_builder; print(' '.join(get_builder('adam').cflags(True)))")"
read -r NVFLAGS <<<"$(cd $REPO && TORCH_CUDA_ARCH_LIST='8.0;9.0' python -c "from engine.ops.builder import get_builder; print(' '.join(get_builder('adam').cuda_cflags()))")"
echo "cxx flags: $CXXFLAGS"; echo "nvcc flags: $NVFLAGS"
INC="-I$T/include -I$T/include/torch/csrc/api/include -I/usr/local/cuda/include -I$PYINC -I$REPO/csrc"
DEF="-DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1"
for op in adam fp8; do
  DEFS="$DEF -DTORCH_EXTENSION_NAME=engine_${op}_ext"
  objs=()
  for src in $REPO/csrc/$op/*.cpp; do
    o=$OUT/$(basename $src).o
    g++ -std=c++20 -fPIC $CXXFLAGS $INC $DEFS -c $src -o $o; objs+=($o)
  done
  for src in $REPO/csrc/$op/*.cu; do
    o=$OUT/$(basename $src).o
    nvcc -std=c++20 -Xcompiler -fPIC $NVFLAGS $INC $DEFS \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      -c $src -o $o; objs+=($o)
  done
  g++ -shared -fopenmp -Wl,--no-undefined "${objs[@]}" -L$T/lib -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python \
      -L/usr/local/cuda/lib64 -lcudart -L$PYLIB -lpython3.11 -o $OUT/engine_${op}_ext.so 2>&1 | grep -v "needed by\|not found (try using" || true
  test -f $OUT/engine_${op}_ext.so
  readelf -S $OUT/engine_${op}_ext.so | grep -q nv_fatbin   # the device code is embedded
  echo "== $op: linked $OUT/engine_${op}_ext.so ($(du -h $OUT/engine_${op}_ext.so | cut -f1)) with device code"
done
