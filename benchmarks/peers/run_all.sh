#!/usr/bin/env bash
# The peers of issue 71 on the project's DSB 2018 protocol: StarDist 2D (as its example
# preprocesses, and with bright backgrounds inverted as gluon_unet's --normalize auto) and
# Cellpose 3, each trained from scratch for the recipe's 58 minutes of wall time on the
# random hold-out's training images and on each grouped fold's, then predicting the held-out
# images and scored by bin/evaluate, paired with the dsb2018 recipe's committed per-image
# scores. How to install the peers' venvs: benchmarks/peers/README.md.
#
#   bash benchmarks/peers/run_all.sh [PEER|all] [SPLIT|all]   train, predict, evaluate
#   bash benchmarks/peers/run_all.sh score                    the tables from what exists
#
# PEER: stardist, stardist-inv, cellpose; SPLIT: random, g1, g2, g3. One training is an hour
# and all 12 are 12 hours, more than one session: a run whose scores CSV exists is skipped,
# so the same command carries on where the last one stopped (while $OUT is kept).
# Run one at a time on a quiet machine (the budget is wall time: another process's load
# takes epochs away; budget.json records the machine's load beside each run).
#
# MATCH=1 repeats instead the work of the committed runs (scores/peers/<peer>-<split>-budget.json,
# 58 minutes on a Zen 4; stardist-inv takes StarDist's): the same steps or batches whatever
# the CPU, MINUTES (then default 600) only a guard. For a CPU slower than that Zen 4 (a Zen 3
# is 2.3-3.5 times slower for the peers) or a busy one; wall time is all that load changes.
#
# Environment: DATA (stage1_train), OUT (default /tmp/peers), MINUTES (58), SD_PY, CP_PY (the
# peers' venv pythons), MAIN_PY (the project's venv), MATCH. Threads: the frameworks use every
# core unless OMP_NUM_THREADS (and TF_NUM_INTRAOP_THREADS) say otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-../shared/data/dsb2018/stage1_train}
OUT=${OUT:-/tmp/peers}
MATCH=${MATCH:-}
if [ -n "$MATCH" ]; then MINUTES=${MINUTES:-600}; else MINUTES=${MINUTES:-58}; fi
SD_PY=${SD_PY:-/tmp/venv-stardist/bin/python}
CP_PY=${CP_PY:-/tmp/venv-cellpose/bin/python}
MAIN_PY=${MAIN_PY:-.venv/bin/python}
S=experiments/dsb2018/scores

peers=(stardist stardist-inv cellpose)
splits=(random g1 g2 g3)

prepare() {  # symlink trees into the data (nothing is copied), under $OUT: not shared with other runs
  if [ ! -d "$OUT/dsb/train" ]; then
    # --check: compare with the committed ids rather than write them
    "$MAIN_PY" experiments/dsb2018/dsb_split.py --data "$DATA" --out "$OUT/dsb" --check
  fi
  for k in 1 2 3; do
    [ -d "$OUT/dsbgroups/fold$k/train" ] || \
      "$MAIN_PY" experiments/dsb2018/dsb_grouped.py fold $k --data "$DATA" --out "$OUT/dsbgroups"
  done
}

dirs() {  # SPLIT -> "TRAIN_DIR TEST_DIR"
  case $1 in
    random) echo "$OUT/dsb/train $OUT/dsb/holdout" ;;
    g[123]) echo "$OUT/dsbgroups/fold${1#g}/train $OUT/dsbgroups/fold${1#g}/heldout" ;;
    *) echo "unknown split $1 (random, g1, g2, g3)" >&2; exit 2 ;;
  esac
}

run() {  # PEER SPLIT
  local peer=$1 split=$2 train test py script extra=()
  read -r train test <<< "$(dirs "$split")"
  case $peer in
    stardist) py=$SD_PY; script=benchmarks/peers/stardist_peer.py ;;
    stardist-inv) py=$SD_PY; script=benchmarks/peers/stardist_peer.py; extra=(--invert-bright) ;;
    cellpose) py=$CP_PY; script=benchmarks/peers/cellpose_peer.py ;;
    *) echo "unknown peer $peer (stardist, stardist-inv, cellpose)" >&2; exit 2 ;;
  esac
  if [ -n "$MATCH" ]; then extra+=(--match "$S/peers/${peer%-inv}-$split-budget.json"); fi
  local model=$OUT/models/$peer-$split pred=$OUT/pred/$peer-$split csv=$OUT/scores/$peer-$split.csv
  if [ -f "$csv" ]; then echo "== $peer $split: $csv exists, skipped"; return; fi
  mkdir -p "$OUT/models" "$OUT/pred" "$OUT/scores" "$OUT/logs"
  echo "== $peer $split: train $MINUTES min on $train"
  if [ ! -f "$model/budget.json" ]; then
    rm -rf "$model"  # a training cut short leaves a model that never kept its budget
    "$py" "$script" train --data "$train" --out "$model" --minutes "$MINUTES" "${extra[@]}" \
      2>&1 | tee "$OUT/logs/$peer-$split-train.log"
  fi
  "$py" "$script" predict --model "$model" --input "$test" --output "$pred" \
    2>&1 | tee "$OUT/logs/$peer-$split-predict.log"
  "$MAIN_PY" bin/evaluate --pred "$pred" --truth "$test" --csv "$csv"
}

score() {  # the grouped table (per group, macro, paired with the recipe) and the random hold-out by kind
  local names=() randoms=() args=(RECIPE="$S/g1-full-range.csv,$S/g2-full-range.csv,$S/g3-full-range.csv")
  local rnd=(--random RECIPE="$S/v36.csv")
  for peer in "${peers[@]}"; do
    local name=${peer^^}; name=${name//-/_}
    if [ -f "$OUT/scores/$peer-g1.csv" ] && [ -f "$OUT/scores/$peer-g2.csv" ] && [ -f "$OUT/scores/$peer-g3.csv" ]; then
      args+=("$name=$OUT/scores/$peer-g1.csv,$OUT/scores/$peer-g2.csv,$OUT/scores/$peer-g3.csv")
      [ -f "$OUT/scores/$peer-random.csv" ] && rnd+=(--random "$name=$OUT/scores/$peer-random.csv")
      names+=("$name")
    fi
    [ -f "$OUT/scores/$peer-random.csv" ] && randoms+=("$OUT/scores/$peer-random.csv")
  done
  if [ ${#names[@]} -gt 0 ]; then
    echo "== grouped validation: the recipe's full-length fold runs against ${names[*]}"
    "$MAIN_PY" experiments/dsb2018/dsb_grouped.py score "${args[@]}" "${rnd[@]}" --bootstrap 10000
  else
    echo "== grouped validation: no peer has all three folds yet"
  fi
  if [ ${#randoms[@]} -gt 0 ]; then
    echo "== random hold-out by kind, paired with the recipe (v36): ${randoms[*]}"
    "$MAIN_PY" experiments/dsb2018/dsb_by_kind.py "$S/v36.csv" "${randoms[@]}" --bootstrap 10000
  fi
  echo "== time and memory: $OUT/models/*/budget.json (training), $OUT/pred/*/prediction.json (per image)"
  for f in "$OUT"/models/*/budget.json "$OUT"/pred/*/prediction.json; do
    [ -f "$f" ] && "$MAIN_PY" - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ('wall_seconds', 'cpu_seconds', 'epochs', 'images_seen', 'machine_busy_seconds', 'images',
        'seconds_median', 'seconds_total', 'peak_rss_mib_max', 'peak_rss_mib_median')
print(sys.argv[1], {k: r[k] for k in keys if k in r})
EOF
  done
}

if [ "${1:-}" = score ]; then score; exit 0; fi
want_peer=${1:-all}; want_split=${2:-all}
prepare
for split in "${splits[@]}"; do
  [ "$want_split" = all ] || [ "$want_split" = "$split" ] || continue
  for peer in "${peers[@]}"; do
    [ "$want_peer" = all ] || [ "$want_peer" = "$peer" ] || continue
    run "$peer" "$split"
  done
done
score
