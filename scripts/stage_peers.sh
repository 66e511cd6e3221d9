#!/usr/bin/env bash
# Stage the KDA prefill peers for the device machine (project root, CPU machine): the cuDNN frontend wheel
# (pyproject.toml's `peers` extra, Python 3.12) and .gpu/c/peers.sh, which installs it on the device beside the
# packages of ../shared/device/stage.sh (its own dependencies, CuTe DSL and apache-tvm-ffi, come from those bundles
# and .whl). FlashKDA is a separate source build: scripts/build_flashkda.sh (.gpu/fk).
#   bash scripts/stage_peers.sh
# then on a warm device machine: carry [".gpu/c", ".gpu/fk"] and `bash scripts/device_jobs.sh "$OUT" peers`,
# which sources .gpu/c/peers.sh and .gpu/fk/install.sh (.gpu/b and .gpu/c do not fit one call's 64 MiB together).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
spec=$(python3 -c "import tomllib
print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['peers'][0])")
rm -rf .gpu/c && mkdir -p .gpu/c
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/c "$spec" 2>&1 | grep -v '^WARNING: Location' || true
cat > .gpu/c/peers.sh <<'EOF'
# device machine, after /opt/gpu-env.sh (or .gpu/b/env.sh): the peers into /opt/peer-site, first on PYTHONPATH
_pc=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /opt/peer-site "$_pc"/*.whl
case ":${PYTHONPATH:-}:" in
  *:/opt/peer-site:*) ;;
  *) export PYTHONPATH="/opt/peer-site${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
unset _pc
EOF
ls -la .gpu/c
