#!/usr/bin/env bash
# Build the FlashKDA peer (MoonshotAI/FlashKDA) from its source for the H200 image's torch, on the CPU machine.
#
# Why: the tokenspeed-flashkda wheel on the package index imports under the device's torch 2.11.0+cu130 but every
# call fails its own check "all tensors must be on CUDA": TensorImpl::is_cuda() is inlined into that wheel from other
# torch headers, so it reads another layout (a C++ ABI mismatch, not our inputs). Built against the torch 2.11.0
# headers it runs. Nothing of FlashKDA enters this repository: the source is fetched, built, and the result staged
# under .gpu/fk (git-ignored), which the device run installs over the wheel's package (`.gpu/fk/install.sh`).
#
#   bash scripts/build_flashkda.sh /path/to/FlashKDA/checkout    # CUTLASS headers: the nvidia-cutlass wheel
# needs: nvcc (CUDA 13), g++, python3.12 headers ($PYTHON312 names the interpreter), network for `pip download torch==2.11.0` (~530 MB, cached in
# $TORCH_WHL_DIR, default /tmp/torchwhl).
set -euo pipefail
src=$(cd "${1:?usage: build_flashkda.sh FLASHKDA_SRC}" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
whl_dir=${TORCH_WHL_DIR:-/tmp/torchwhl}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$whl_dir" "torch==2.11.0" 2>&1 | grep -v '^WARNING: Location' || true
unzip -q -o "$whl_dir"/torch-2.11.0-*.whl 'torch/include/*' 'torch/lib/*' -d "$work"
cut=$(python3 -c "import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / 'source')")
# python3.12: $PYTHON312, else the one on PATH when it runs (a pyenv shim may not), else pyenv's own 3.12
py312=${PYTHON312:-python3.12}
if ! "$py312" -c "" 2>/dev/null; then
  py312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
fi
pyinc=$("${py312:?no python3.12 found: set PYTHON312}" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
ti="$work/torch/include"
rev=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)

# the flags of FlashKDA's setup.py for sm_90a
nvcc -c "$src/csrc/smxx/fwd_launch.cu" -o "$work/fwd_launch.o" -I"$cut/include" -I"$cut/examples/common" \
  -I"$cut/tools/util/include" -I"$src/csrc" -O3 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ \
  -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda \
  --use_fast_math -lineinfo -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC -std=c++17 --threads 2
g++ -c "$src/csrc/flash_kda.cpp" -o "$work/flash_kda.o" -fPIC -std=c++17 -O3 -Wno-psabi -I"$cut/include" \
  -I"$src/csrc" -I"$ti" -I"$ti/torch/csrc/api/include" -I"$pyinc" -I/usr/local/cuda/include \
  -DTORCH_EXTENSION_NAME=flash_kda_C -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 -w

out="$root/.gpu/fk"
rm -rf "$out" && mkdir -p "$out/site/flash_kda" "$out/site/flash_kda-0.0.1+src.$rev.dist-info"
g++ -shared -o "$out/site/flash_kda_C.cpython-312-x86_64-linux-gnu.so" "$work/flash_kda.o" "$work/fwd_launch.o" \
  -L"$work/torch/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda -L/usr/local/cuda/lib64 -lcudart
cp "$src/flash_kda/__init__.py" "$out/site/flash_kda/"
cat > "$out/site/flash_kda-0.0.1+src.$rev.dist-info/METADATA" <<EOF
Metadata-Version: 2.1
Name: flash_kda
Version: 0.0.1+src.$rev
Summary: FlashKDA built from source (commit $rev) against torch 2.11.0+cu130 headers, sm_90a (scripts/build_flashkda.sh)
EOF
cat > "$out/install.sh" <<'EOF'
# GPU machine, after the peers (`source .gpu/c/peers.sh`): FlashKDA's source build over the wheel's package
_fk=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rm -rf /opt/peer-site/flash_kda /opt/peer-site/flash_kda_C*.so
cp -r "$_fk"/site/. /opt/peer-site/
unset _fk
EOF
ls -la "$out/site"
