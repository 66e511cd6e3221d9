#!/usr/bin/env bash
# Stage FLA's own test files for the device job `flatests` (scripts/device_jobs.sh) into the git-ignored .flatests/:
# tests/conftest.py, tests/ops/test_kda.py and tests/ops/test_lightning_attn.py from a checkout or a bare mirror of
# fla-org/flash-linear-attention (the fetch tool's /work/.mirror/fla-org+flash-linear-attention/repo). The mirror has
# no v0.6.0 tag: its HEAD's files are taken, and the tests whose API drifted past fla-core 0.6.0 fail alike on FLA's
# route and ours (the plugin's route summary tells which path ran).
#   bash scripts/stage_flatests.sh /work/.mirror/fla-org+flash-linear-attention/repo [REV]
# then carry [".flatests"] with the call that runs `flatests`.
set -euo pipefail
src="${1:?usage: scripts/stage_flatests.sh FLA_REPO [REV]}"; rev="${2:-HEAD}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.flatests/' .git/info/exclude 2>/dev/null || echo '/.flatests/' >> .git/info/exclude
rm -rf .flatests && mkdir -p .flatests/tests/ops
for f in tests/conftest.py tests/ops/test_kda.py tests/ops/test_lightning_attn.py; do
  git -C "$src" show "$rev:$f" > ".flatests/$f"
done
echo "staged from $(git -C "$src" rev-parse --short "$rev"):"; find .flatests -type f | sort
