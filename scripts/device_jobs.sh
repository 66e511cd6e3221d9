#!/usr/bin/env bash
# Named device jobs, one call's worth each, logs and reports under OUT (the device tool's $OUT).
# Kept in git so the next session's calls do not depend on untracked scripts.
#
#   source .gpu/b/env.sh   (first working call; later calls: source /opt/gpu-env.sh)
#   FLA_CULA_COMMIT=<hash> bash scripts/device_jobs.sh "$OUT" build conv model
#   (peers need carry .gpu/c [.gpu/fk], staged by scripts/stage_peers.sh [scripts/build_flashkda.sh]:
#    FLA_CULA_COMMIT=<hash> bash scripts/device_jobs.sh "$OUT" peers)
#
# jobs:
#   build   the C++ extension in place (a cut build's leftovers are removed), or the prebuilt one of
#           scripts/prebuild_ext.sh when its sources are these
#   conv    strict conv-update GPU tests (xdist when present)
#   kda     strict KDA prefill and training-path GPU tests
#   lightning strict lightning prefill GPU tests (LIGHT_ARGS: shell-parsed pytest arguments)
#   kdabwd  the backward kernels: tests/gpu/test_kda_bwd.py (vs fp64 and FLA's kernels, a strict training step), the
#           training-path gradient tests, benchmarks.kda_bwd_wy --op $KDABWD_OPS (default "wy intra fused gate";
#           each beside FLA's), benchmarks.train_profile, benchmarks.train_knobs (each backward knob off in turn) and
#           the training rows of benchmarks prefill (fla, fla_cula)
#   bwdtests tests/gpu/test_kda_bwd.py alone (the backward kernels vs fp64 and FLA's; xdist; ~160 s on an H100, of which
#           ~40 s are FLA's reference kernels compiling on a fresh machine: give it T_BWD >= 200)
#   abbwdtests the same on each /tmp/ab_<i> of AB_PATCHES in turn
#   model   python -m benchmarks model, 4 and 24 layers, every row
#   lreport python -m benchmarks --only chunk_lightning_attn (graph, eager, fwdbwd): the lightning report rows
#   peers   python -m benchmarks prefill --peers (cuDNN from .gpu/c, FlashKDA's source build from .gpu/fk)
#   ncu     Nsight Compute on kda_prep / kda_state (benchmarks/ncu_kda.py), reports under OUT/ncu
#   unbounded the unbounded gates' GPU tests, strict: chunk_kda's softplus / precomputed cases with grad
#            (test_kda_prefill.py) first, then the backward's intra and gate kernels in both forms
#            (tests/gpu/test_kda_bwd.py: ~4 min on a fresh machine)
#   gateforms python -m benchmarks.kda_gate_forms (GF_ARGS): FLA and fla_cula per gate form, fwd and train
#   bench   python -m benchmarks.$BENCH (kda_variants unless set) with BENCH_ARGS (split on spaces: write JSON without
#           them), in this tree, after FLA's autotune cache is restored
#   flatests FLA's test_kda.py chunk cases through the plugin (carry .flatests, staged by scripts/stage_flatests.sh;
#            xdist when present: on a cold Triton cache each new shape autotunes FLA for ~2 min, so one process runs
#            ~3 cases in 6 min; docs/measuring.md)
#   abbuild  a copy of this tree with the patch AB_PATCH applied, built, in /tmp/ab_new
#   builds   build and abbuild side by side (one job)
#   abkda    the kda job's tests on /tmp/ab_new (KDA_ARGS for both: shell-parsed pytest arguments)
#   ablight  the lightning job's tests on /tmp/ab_new
#   ab       benchmarks.$AB_BENCH (kda_variants unless set; AB_ARGS) in this tree and in /tmp/ab_new, alternating,
#            AB_ROUNDS times each
#   abbuilds this tree and one copy per patch of AB_PATCHES (space-separated) in /tmp/ab_1, /tmp/ab_2, ..., all built
#            side by side (one job; logs OUT/build.log, OUT/abbuild_<i>.log)
#   abkdas   the kda job's tests on each /tmp/ab_<i> in turn
#   abn      benchmarks.$AB_BENCH in this tree and in each /tmp/ab_<i>, in turn, AB_ROUNDS rounds
# A short table of each job's status and time is printed last.
set -u
OUT="${1:?usage: scripts/device_jobs.sh OUT JOB...}"; shift
mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the commit, -dirty when tracked files differ from it (a patch applied to the tree sent), as parity.machine names it
export FLA_CULA_COMMIT="${FLA_CULA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
  [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && echo -dirty)}"
export TRITON_CACHE_DIR="$HOME/.triton/cache" TRITON_CACHE_AUTOTUNING=1
# FLA's Triton autotune results: the last run's (.tcache, carried), else the committed H200 archive; then the test
# shapes (FLA's test_kda.py and our GPU tests) tuned on an H100, for keys that neither holds (flatests: each untuned
# shape costs ~2 min of autotuning)
if [[ ! -f $HOME/.triton/.restored ]]; then
  mkdir -p "$HOME/.triton"
  for tgz in .tcache/triton_autotune.tgz benchmarks/results/triton_autotune_H200.tgz; do
    [[ -f $tgz ]] && tar xzf "$tgz" -C "$HOME/.triton" && break
  done
  [[ -f benchmarks/results/triton_autotune_tests_H100.tgz ]] \
    && tar xzf benchmarks/results/triton_autotune_tests_H100.tgz -C "$HOME/.triton" --skip-old-files
  touch "$HOME/.triton/.restored"
fi
XDIST=""; python -c "import xdist" 2>/dev/null && XDIST="-n ${PYTEST_WORKERS:-8}"
declare -a SUMMARY

# strict KDA prefill and training-path GPU tests of the tree $1; KDA_ARGS is parsed by the shell (-k 'a or b')
export XDIST KDA_ARGS="${KDA_ARGS:-}" LIGHT_ARGS="${LIGHT_ARGS:-}"
kda_tests() {
  cd "$1" && eval "PYTHONPATH='$1':\$PYTHONPATH FLA_CULA_STRICT=1 python -m pytest tests/gpu/test_kda_prefill.py \
    tests/gpu/test_training_path.py -q -rfE -p no:cacheprovider $XDIST $KDA_ARGS"
}

# tests/gpu/test_kda_bwd.py of the tree $1 (its own PYTHONPATH first: the env's site directory stays on it)
bwd_tests() {
  cd "$1" && PYTHONPATH="$1:$PYTHONPATH" python -m pytest tests/gpu/test_kda_bwd.py -q -rfE -p no:cacheprovider $XDIST
}

light_tests() {
  cd "$1" && eval "PYTHONPATH='$1':\$PYTHONPATH FLA_CULA_STRICT=1 python -m pytest tests/gpu/test_lightning_prefill.py \
    -q -rfE -p no:cacheprovider $XDIST $LIGHT_ARGS"
}

# DIR: a copy of this tree (without .gpu/ and build/) with the patch PATCH applied
ab_tree_at() {
  local dir=$1 patch_file
  patch_file="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
  # the same patch already applied (an earlier job of this machine): keep the tree and its build
  [[ -f $dir/.ab_patch ]] && cmp -s "$dir/.ab_patch" "$patch_file" && return 0
  rm -rf "$dir" && mkdir -p "$dir" && tar cf - --exclude=./.gpu --exclude=./build . | tar xf - -C "$dir" \
    && (cd "$dir" && patch -p1 -s < "$patch_file" && rm -f fla_cula/_C*.so && cp "$patch_file" .ab_patch \
        && basename "$patch_file" > .ab_patch_name) \
    || { echo "ab_tree: copy or patch failed ($dir, $2)"; SUMMARY+=("ab_tree   FAIL"); return 1; }
}
# /tmp/ab_new with the patch AB_PATCH; /tmp/ab_<i> with patch i of AB_PATCHES
ab_tree() { ab_tree_at /tmp/ab_new "${AB_PATCH:?AB_PATCH}"; }
ab_trees() {
  local i=0 p
  for p in ${AB_PATCHES:?AB_PATCHES}; do i=$((i + 1)); ab_tree_at "/tmp/ab_$i" "$p" || return 1; done
}
ab_dirs() { local i=0 p; for p in ${AB_PATCHES:?AB_PATCHES}; do i=$((i + 1)); echo "/tmp/ab_$i"; done; }
# this tree and every /tmp/ab_<i> built side by side; fails when any build fails
abbuilds_run() {
  python setup.py build_ext --inplace > "$OUT/build.log" 2>&1 &
  local i=0 d pid rc=0
  for d in $(ab_dirs); do
    i=$((i + 1))
    (cd "$d" && python setup.py build_ext --inplace) > "$OUT/abbuild_$i.log" 2>&1 &
  done
  for pid in $(jobs -p); do wait "$pid" || rc=1; done
  return $rc
}
# benchmarks.$AB_BENCH in this tree and in each /tmp/ab_<i> in turn (the patch named in each header), AB_ROUNDS rounds
abn() {
  local r t
  for r in $(seq "${AB_ROUNDS:-2}"); do
    for t in "$PWD" $(ab_dirs); do
      echo "## round $r: $t $(cat "$t/.ab_patch_name" 2>/dev/null)"
      (cd "$t" && PYTHONPATH="$t:$PYTHONPATH" python -m benchmarks.${AB_BENCH:-kda_variants} ${AB_ARGS:-}) || return 1
    done
  done
}

# fla_cula._C from scripts/prebuild_ext.sh (kept by .gpu/so/recv.sh) when it was built from these sources: the build
# job then takes no device time. Any other tree (a patch applied, a source changed since) compiles.
prebuilt() {
  local d=/opt/gpu-stage/so
  [[ -f $d/hash && -f $d/name && $(cat "$d/name") == *"$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" ]] \
    || return 1
  [[ $(bash scripts/ext_source_hash.sh) == "$(cat "$d/hash")" ]] || { echo "prebuilt fla_cula._C: other sources; compiling"; return 1; }
  python -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$d/_C312.so.xz" "fla_cula/$(cat "$d/name")" && python -c "import fla_cula._C" \
    || { rm -f "fla_cula/$(cat "$d/name")"; echo "prebuilt fla_cula._C does not load; compiling"; return 1; }
  echo "===== [build] prebuilt fla_cula._C (sources $(cut -c1-12 "$d/hash"))"
  SUMMARY+=("$(printf '%-9s %-9s %5ss' build prebuilt 0)")
}

job() {  # job NAME LIMIT CMD...: output to OUT/NAME.log, the last lines echoed
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "===== [$name] $*"
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? st=ok
  [[ $rc -eq 124 || $rc -eq 137 ]] && st=TIMEOUT
  [[ $rc -ne 0 && $st == ok ]] && st="FAIL($rc)"
  tail -n "${TAIL:-6}" "$OUT/$name.log" | cut -c1-240
  SUMMARY+=("$(printf '%-9s %-9s %5ss' "$name" "$st" $((SECONDS - t0)))")
}

for j in "$@"; do
  case $j in
    build)
      if prebuilt; then continue; fi
      job build "${T_BUILD:-240}" python setup.py build_ext --inplace
      [[ ${SUMMARY[-1]} == *" ok "* ]] || rm -rf build fla_cula/_C*.so ;;
    conv)
      job conv "${T_CONV:-200}" env FLA_CULA_STRICT=1 python -m pytest tests/gpu/test_conv_update.py -q -rfE \
        -p no:cacheprovider $XDIST ;;
    kda)
      job kda "${T_KDA:-400}" bash -c "$(declare -f kda_tests); kda_tests '$PWD'" ;;
    kdabwd)
      TAIL=${TAIL:-56} job kdabwd "${T_KDABWD:-540}" bash -c "
        python -m pytest tests/gpu/test_kda_bwd*.py -q -s -rfE -p no:cacheprovider 2>&1 | grep -E 'ours /|passed|failed|rror'
        python -m pytest tests/gpu/test_kda_prefill.py tests/gpu/test_training_path.py -q -rfE -p no:cacheprovider \
          $XDIST -k 'test_grad and not dA_log or bit_identical' 2>&1 | tail -3
        python -m benchmarks.kda_bwd_wy --op ${KDABWD_OPS:-wy intra fused gate}
        python -m benchmarks.train_profile --top 12 --out '$OUT' | grep -A13 'GPU us'
        python -m benchmarks.train_knobs
        python -m benchmarks prefill --rows train --impls fla fla_cula --out '$OUT' | grep fwdbwd" ;;
    bwdtests)
      job bwdtests "${T_BWD:-240}" bash -c "$(declare -f bwd_tests); bwd_tests '$PWD'" ;;
    abbwdtests)
      for d in $(ab_dirs); do
        job "abbwd_${d##*_}" "${T_BWD:-240}" bash -c "$(declare -f bwd_tests); bwd_tests $d"
      done ;;
    lightning)
      job lightning "${T_LIGHT:-400}" bash -c "$(declare -f light_tests); light_tests '$PWD'" ;;
    model)
      job model "${T_MODEL:-420}" python -m benchmarks model --layers 4 24 --out "$OUT" ${MODEL_ARGS:-} ;;
    lreport)
      job lreport "${T_LREPORT:-400}" python -m benchmarks --only chunk_lightning_attn --modes graph eager fwdbwd \
        --out "$OUT" ;;
    peers)
      [[ -f .gpu/c/peers.sh ]] && source .gpu/c/peers.sh
      [[ -f /opt/peers.sh ]] && source /opt/peers.sh
      [[ -f .gpu/fk/install.sh ]] && source .gpu/fk/install.sh
      job peers "${T_PEERS:-480}" python -m benchmarks prefill --peers --out "$OUT" ${PEERS_ARGS:-} ;;
    ncu)
      mkdir -p "$OUT/ncu"
      job ncu "${T_NCU:-400}" python -m benchmarks.ncu_kda --out "$OUT/ncu" ${NCU_ARGS:-} ;;
    unbounded)
      job unbounded "${T_UNB:-540}" bash -c "FLA_CULA_STRICT=1 python -m pytest tests/gpu/test_kda_prefill.py -q -rfE \
        -p no:cacheprovider $XDIST -k 'unbounded or abi or out_of_scope'; rp=\$?; FLA_CULA_STRICT=1 python -m pytest \
        tests/gpu/test_kda_bwd.py -q -rfE -p no:cacheprovider $XDIST -k 'intra or gate or rejects' && exit \$rp" ;;
    gateforms)
      TAIL=${TAIL:-20} job gateforms "${T_GF:-300}" python -m benchmarks.kda_gate_forms ${GF_ARGS:-} ;;
    bench)
      TAIL=${TAIL:-30} job bench "${T_BENCH:-300}" python -m benchmarks.${BENCH:-kda_variants} ${BENCH_ARGS:-} ;;
    flatests)
      job flatests "${T_FLATESTS:-500}" env FLA_CULA=1 FLA_CULA_FORCE=1 timeout -s INT $(( ${T_FLATESTS:-500} - 20 )) \
        python -m pytest -p fla_cula.testing.plugin -p no:cacheprovider -q -rfE $XDIST .flatests/tests/ops/test_kda.py \
        -k "chunk and not cp and not flash and not naive" ;;
    abbuild)
      ab_tree && job abbuild "${T_BUILD:-240}" bash -c "cd /tmp/ab_new && python setup.py build_ext --inplace"
      [[ ${SUMMARY[-1]} == *" ok "* ]] || rm -rf /tmp/ab_new/build /tmp/ab_new/fla_cula/_C*.so ;;
    builds)
      ab_tree && job builds "${T_BUILD:-240}" bash -c "python setup.py build_ext --inplace > '$OUT/build.log' 2>&1 & \
        (cd /tmp/ab_new && python setup.py build_ext --inplace) > '$OUT/abbuild.log' 2>&1; rb=\$?; wait \$! && exit \$rb"
      [[ ${SUMMARY[-1]} == *" ok "* ]] || rm -rf build fla_cula/_C*.so /tmp/ab_new/build /tmp/ab_new/fla_cula/_C*.so ;;
    abkda)
      job abkda "${T_KDA:-400}" bash -c "$(declare -f kda_tests); kda_tests /tmp/ab_new" ;;
    ablight)
      job ablight "${T_LIGHT:-400}" bash -c "$(declare -f light_tests); light_tests /tmp/ab_new" ;;
    abbuilds)
      ab_trees && job abbuilds "${T_BUILD:-300}" bash -c "$(declare -f abbuilds_run ab_dirs); OUT='$OUT' abbuilds_run"
      [[ ${SUMMARY[-1]} == *" ok "* ]] || rm -rf build fla_cula/_C*.so /tmp/ab_[0-9]*/build /tmp/ab_[0-9]*/fla_cula/_C*.so ;;
    abkdas)
      for d in $(ab_dirs); do
        job "abkda_${d##*_}" "${T_KDA:-400}" bash -c "$(declare -f kda_tests); kda_tests $d"
      done ;;
    abn)
      TAIL=${TAIL:-60} job abn "${T_AB:-500}" bash -c "$(declare -f abn ab_dirs); abn" ;;
    ab)
      ab() {
        for r in $(seq "${AB_ROUNDS:-2}"); do
          for t in "$PWD" /tmp/ab_new; do
            echo "## round $r: $t"
            (cd "$t" && PYTHONPATH="$t:$PYTHONPATH" python -m benchmarks.${AB_BENCH:-kda_variants} ${AB_ARGS:-}) || return 1
          done
        done
      }
      TAIL=${TAIL:-40} job ab "${T_AB:-400}" bash -c "$(declare -f ab); ab" ;;
    *) echo "unknown job $j"; SUMMARY+=("$j unknown") ;;
  esac
done
( cd "$HOME/.triton" 2>/dev/null && find cache -name "*.autotune.json" | tar czf "$OUT/triton_autotune.tgz" -T - ) 2>/dev/null
echo "===== device_jobs ($FLA_CULA_COMMIT) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
printf '%s\n' "${SUMMARY[@]}"
