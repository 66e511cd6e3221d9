#!/usr/bin/env bash
# The hash of every file fla_cula._C is built from (csrc/, setup.py, pyproject.toml's version), run in the project
# root: the same on the CPU machine (scripts/prebuild_ext.sh) and on the device (device_jobs.sh's build job).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
{ find csrc -type f | LC_ALL=C sort; echo setup.py; echo pyproject.toml; } | xargs sha256sum | sha256sum | cut -d' ' -f1
