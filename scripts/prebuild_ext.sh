#!/usr/bin/env bash
# Build fla_cula._C for the device's Python (3.12) here, on the CPU machine, so that a device call does not spend
# ~80 s of its budget compiling. The module links neither libtorch nor libcudart (setup.py) and both machines have
# nvcc 13.0, so a build for sm_90a here is the build the device would make. The result goes to .gpu/so (ignored):
# the xz-compressed module and the hash of the sources it was built from (scripts/ext_source_hash.sh);
# device_jobs.sh's `build` job restores it when the device tree's sources hash the same, and compiles otherwise.
#   bash scripts/prebuild_ext.sh            (after any change under csrc/, setup.py or pyproject.toml)
#   device, first call: carry [".gpu/a", ".gpu/so"]: bash .gpu/a/recv.sh && bash .gpu/so/recv.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=""
for c in ${PY312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY=$c; break; }
done
[[ -n $PY ]] || { echo "prebuild_ext: no Python 3.12 here (set PY312)"; exit 1; }
"$PY" -c "import pybind11, cutlass_library, tvm_ffi, setuptools" 2>/dev/null || "$PY" -m pip install -q \
  "setuptools>=64" wheel "pybind11>=3.0" nvidia-cutlass==4.2.0.0 apache-tvm-ffi==0.1.15.post2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the files a device call carries: tracked and untracked-not-ignored, as they are in the working tree
git ls-files -z --cached --others --exclude-standard | tar cf - --null -T - | tar xf - -C "$tmp"
(cd "$tmp" && FLA_CULA_REQUIRE_EXT=1 "$PY" setup.py build_ext --inplace > build.log 2>&1) \
  || { tail -20 "$tmp/build.log"; exit 1; }
so=$(cd "$tmp" && ls fla_cula/_C.cpython-312-*.so)
mkdir -p .gpu/so
xz -9 -c "$tmp/$so" > .gpu/so/_C312.so.xz
bash "$tmp/scripts/ext_source_hash.sh" > .gpu/so/hash   # the sources of the copy that was built
basename "$so" > .gpu/so/name
cat > .gpu/so/recv.sh <<'EOF'
#!/usr/bin/env bash
# GPU machine, run 1 (after .gpu/a/recv.sh): keep the prebuilt fla_cula._C for device_jobs.sh's build job
set -euo pipefail
mkdir -p /opt/gpu-stage/so && cp "$(dirname "${BASH_SOURCE[0]}")"/{_C312.so.xz,hash,name} /opt/gpu-stage/so/
echo "prebuilt fla_cula._C kept (sources $(cut -c1-12 /opt/gpu-stage/so/hash))"
EOF
chmod +x .gpu/so/recv.sh
echo "prebuilt $so ($(stat -c %s .gpu/so/_C312.so.xz) bytes compressed), sources $(cut -c1-12 .gpu/so/hash)"
