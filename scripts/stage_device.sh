#!/usr/bin/env bash
# Prepare the H200 bundles from the CPU machine (project root): the shared recipe (FLA, CuTe DSL,
# CUTLASS headers) plus what fla_cula needs beyond it: the apache-tvm-ffi wheel for Python 3.12, and
# pytest-xdist (GPU tests in parallel processes: kernel compiles dominate their time).
#   bash scripts/stage_device.sh
# then, on the device:  run 1 carry [".gpu/a", ".gpu/so"]: bash .gpu/a/recv.sh && bash .gpu/so/recv.sh
#                           (.gpu/so: fla_cula._C prebuilt here for the device's Python, scripts/prebuild_ext.sh;
#                            rerun that script after a change under csrc/)
#                       run 2 carry [".gpu/b", ".whl"]  : source .gpu/b/env.sh && \
#                           python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
#                               --target /opt/gpu-site .whl/*.whl && <command>
#                       later (warm machine), carry [".whl", ".tcache"]: source /opt/gpu-env.sh && <command>
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ../shared/device/stage.sh
for d in /.whl/ /.tcache/ /.sweep/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
mkdir -p .whl .tcache
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl "apache-tvm-ffi==0.1.15.post2" "pytest-xdist==3.8.0" "execnet==2.1.1" 2>&1 | grep -v '^WARNING: Location' || true
bash scripts/prebuild_ext.sh || echo "no prebuilt fla_cula._C: device calls compile it (build job)"
ls -la .whl .tcache; ls -la .gpu/so 2>/dev/null || true
echo "staged; put the last run's triton_autotune.tgz into .tcache/ to skip FLA's autotuning"
