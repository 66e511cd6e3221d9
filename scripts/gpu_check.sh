#!/usr/bin/env bash
# Everything the H200 is needed for (build the extension, `python -m fla_cula info`, GPU pytest,
# the README's model demo, `python -m parity`, `python -m benchmarks --quick`); full reports into
# OUTDIR, a short summary table printed LAST. A device call is limited to 10 minutes: on a fresh
# machine (FLA's Triton kernels compile and autotune for minutes) split the steps over three calls:
#   STEPS="build info pytest demo" ...   then   STEPS="parity" T_PARITY=540 ...   then   STEPS="bench" ...
#
#   source /opt/gpu-env.sh && bash scripts/gpu_check.sh "$OUT"
#
# OUTDIR receives 7 files (the device tool brings back at most 8): gpu_check.log, junit_gpu.xml,
# REPORT_H200.md, report_H200.json, BENCHMARK_H200.md, benchmark_H200.json, triton_autotune.tgz
# (carry it back as .tcache/triton_autotune.tgz next time to skip FLA's autotuning).
# Per-step time limits (seconds) and extra arguments can be overridden from the environment:
#   T_BUILD T_INFO T_PYTEST T_DEMO T_PARITY T_BENCH; PARITY_ARGS (e.g. "--quick"), PARITY_JOBS (worker
#   processes, default 12), BENCH_ARGS, PYTEST_ARGS.
set -u
OUTDIR="${1:?usage: scripts/gpu_check.sh OUTDIR}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$(dirname "$0")/.."
LOG="$OUTDIR/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the checkout's fla_cula, parity, benchmarks
export FLA_CULA_COMMIT="${FLA_CULA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

T_BUILD="${T_BUILD:-180}"; T_INFO="${T_INFO:-60}"; T_PYTEST="${T_PYTEST:-280}"; T_DEMO="${T_DEMO:-190}"
T_PARITY="${T_PARITY:-300}"; T_BENCH="${T_BENCH:-300}"
STEPS=" ${STEPS:-build info pytest demo parity bench} "   # also: training, flatests, kdaphases (not in the default)
want() { [[ "$STEPS" == *" $1 "* ]]; }

declare -a NAMES STATUSES SECS

step() {  # step NAME TIMEOUT CMD...
  local name="$1" limit="$2"; shift 2
  echo "===== [$name] $* (limit ${limit}s)" | tee -a "$LOG"
  local t0=$(date +%s.%N)
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local t1=$(date +%s.%N)
  local status="ok"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="FAIL(rc=$rc)"; fi
  NAMES+=("$name"); STATUSES+=("$status"); SECS+=("$(python -c "print(f'{$t1-$t0:.1f}')")")
  echo "===== [$name] $status" | tee -a "$LOG"
  tail -n 5 "$LOG" | sed 's/^/    /'
}

build() {
  if [ ! -f setup.py ]; then
    echo "setup.py not present: skipping the extension build (the package works without it)"
    return 0
  fi
  # in place, so its messages (including why the extension is skipped) reach the log; the package
  # is used from the checkout (PYTHONPATH), not installed
  python setup.py build_ext --inplace
}

# Triton autotune results from an earlier run (FLA's chunk kernels autotune for minutes on a fresh
# machine): restore them if carried in .tcache/, and save this run's into OUTDIR at the end.
# Parity gets its own Triton cache: its worker processes autotune FLA side by side on one GPU, and
# configurations picked under that contention must not be the ones the benchmarks time.
TRITON_HOME="$HOME/.triton"
export TRITON_CACHE_DIR="$TRITON_HOME/cache" TRITON_CACHE_AUTOTUNING=1   # autotune results kept on disk
PARITY_TRITON_CACHE="$TRITON_HOME/parity"
# .tcache/ (carried from the last run) first, else the archive committed from an earlier H200 run
# (benchmarks/results/): Triton ignores entries whose kernel source, version or GPU differ.
for TGZ in .tcache/triton_autotune.tgz benchmarks/results/triton_autotune_H200.tgz; do
  if [ -f "$TGZ" ]; then
    mkdir -p "$TRITON_HOME" && tar xzf "$TGZ" -C "$TRITON_HOME" && \
      echo "restored $(tar tzf "$TGZ" | wc -l) Triton autotune results from $TGZ" | tee -a "$LOG"
    break
  fi
done
# GPU tests in parallel processes when pytest-xdist is there: kernel compiles dominate their time
XDIST=""; python -c "import xdist" 2>/dev/null && XDIST="-n ${PYTEST_WORKERS:-8}"

want build && step build "$T_BUILD" bash -c "$(declare -f build); build"
# a build cut short leaves a truncated object or .so that the next build would take as up to date
want build && [ "${STATUSES[-1]}" != ok ] && rm -rf build fla_cula/_C*.so
want info && step info "$T_INFO" python -m fla_cula info
# -v: a line per finished test, so a run cut by its time limit still shows what passed and failed
want pytest && step pytest "$T_PYTEST" python -m pytest tests/gpu tests/test_extension.py -v -rfEs -p no:cacheprovider \
  $XDIST --durations=15 --junitxml="$OUTDIR/junit_gpu.xml" ${PYTEST_ARGS:-}
# the chunk ops' training path alone (FLA's backward autotunes per new shape: its own time limit)
want training && step training "${T_TRAINING:-400}" python -m pytest tests/gpu/test_training_path.py -v -rfEs \
  -p no:cacheprovider $XDIST --durations=10
# FLA's own test files through the plugin, in one process (route summary at the end); they live in a
# git-ignored .flatests/tests/ (docs/measuring.md); SIGINT at the limit so pytest still prints its report.
# The routed kernels run, forced onto FLA's small test shapes (FLA_CULA_FORCE=1; FLA_CULA_STAND_IN=1 would replace
# them by FLA's forward: FLATESTS_ENV to choose)
want flatests && step flatests "${T_FLATESTS:-300}" env ${FLATESTS_ENV:-FLA_CULA=1 FLA_CULA_FORCE=1} timeout -s INT $(( ${T_FLATESTS:-300} - 20 )) \
  python -m pytest -p fla_cula.testing.plugin -p no:cacheprovider -v -rfE .flatests/tests/ops/test_lightning_attn.py \
  .flatests/tests/ops/test_kda.py -k "chunk and not cp and not flash and not naive"
# the KDA prefill kernel's per-phase cycles, both V widths, phases 6-8 on mma.sync and on wgmma (not in the default)
kda_phases() {
  for bv in 128 64; do for w in "" --mma-sync; do python -m benchmarks.kda_phases --block-v $bv $w || return 1; done; done
}
want kdaphases && step kdaphases "${T_KDAPHASES:-240}" bash -c "$(declare -f kda_phases); kda_phases"
want demo && step demo "$T_DEMO" python -m fla_cula demo
# parity stops starting cases 25 s before its limit and reports what it did not run (exit 3)
want parity && step parity "$T_PARITY" env TRITON_CACHE_DIR="$PARITY_TRITON_CACHE" python -m parity \
  --out "$OUTDIR" --jobs "${PARITY_JOBS:-12}" --budget $((T_PARITY - 25)) ${PARITY_ARGS:-}
want bench && step benchmarks "$T_BENCH" python -m benchmarks --quick --out "$OUTDIR" ${BENCH_ARGS:-}

( cd "$TRITON_HOME" 2>/dev/null && find cache parity -name "*.autotune.json" 2>/dev/null | \
  tar czf "$OUTDIR/triton_autotune.tgz" -T - ) 2>/dev/null || true
{
  echo
  echo "================ gpu_check summary ($FLA_CULA_COMMIT) ================"
  printf "%-12s %-14s %8s\n" step status seconds
  for i in "${!NAMES[@]}"; do printf "%-12s %-14s %8s\n" "${NAMES[$i]}" "${STATUSES[$i]}" "${SECS[$i]}"; done
  if want pytest; then  # from the -v lines: complete even when the step was cut by its limit
    echo "pytest: $(grep -cE '%\] PASSED ' "$LOG") passed, $(grep -cE '%\] FAILED ' "$LOG") failed, $(grep -cE '%\] SKIPPED ' "$LOG") skipped, $(grep -cE '%\] ERROR ' "$LOG") errors"
    grep -E ' (FAILED|ERROR) tests/' "$LOG" | sed -E 's/^.*(FAILED|ERROR) /  \1 /' | sort -u | head -10
  fi
  python - "$OUTDIR" <<'PY'
import json, os, sys
out = sys.argv[1]
p = os.path.join(out, "report_H200.json")
if os.path.exists(p):
    s = json.load(open(p))["summary"]
    print(f"parity: {s['cases']} cases, {s['passed']} passed, {s['failed']} failed, "
          f"{s.get('fla_defects', 0)} FLA defects (fallback = FLA's result), "
          f"{s['kernel_routed']} kernel-routed; fallbacks: {s['fallbacks_by_reason']}")
    for fid in s["failures"][:10]:
        print(f"  FAIL {fid}")
p = os.path.join(out, "benchmark_H200.json")
if os.path.exists(p):
    sys.path.insert(0, os.getcwd())
    from benchmarks.report import short_table
    print(short_table(json.load(open(p))))
PY
} 2>&1 | tee -a "$LOG"
