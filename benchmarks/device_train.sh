#!/usr/bin/env bash
# The three training stages on the device (one H200) in one call, each under a time budget:
#   bash benchmarks/device_train.sh            (carry .whl with the llguidance wheel)
# Stage budgets in seconds: PT_S, SFT_S, RL_S (defaults below); SIZE=default|small|tiny.
# The supervision records name matrices of ../shared/matrices: carry .device_carry too and set
# SPARSERL_SHARED_MATRICES (benchmarks/NOTES.md). Writes under "$OUT" after each stage:
# ckpt_<stage>.tgz (model, tokenizer, trainer state; no optimizer) and logs.tgz (the logs themselves
# are not under $OUT, which returns at most 8 files), so a call cut
# by its limit keeps the stages that finished. ckpt_rl becomes policy/checkpoints/default/.
# Knobs: PT_S=0 skips pretraining and SFT starts from SFT_INIT; SFT_ARGS / RL_ARGS are added to
# those stages (e.g. SFT_ARGS="--retrieval --top-variants 3"); RL_EVALUATOR (gpu | measured | cpu);
# ABLATE=1 also trains the ablations from the same start: rl_correctness (RL, correctness-only
# reward, RL_S) and sft_nosin (SFT without the sinusoidal embedding, SFT_S); EVAL="args" then
# runs `sparserl eval $EVAL` on what was trained (JSON in $OUT/eval.json), and on EVAL_CHECKPOINTS
# ("name=folder,...") beside them. RL_S=0 skips RL, the ablation's too (the eval then covers the SFT checkpoints).
# SFT_S=0 (with PT_S=0) skips SFT as well: RL then starts from RL_INIT (e.g. policy/checkpoints/retrieval).
# SFT_INIT and RL_INIT may name a checkpoint packed as .tgz (python benchmarks/device_carry.py --pack; 1.1 MB less to carry).
# RL_ARGS="--validate N ..." keeps RL's best checkpoint on validation problems: ckpt_rl_best.tgz;
# RL_ARGS="--average-from N ..." the run's weights averaged from update N on: ckpt_rl_average.tgz.
# FRESH="--count 48 --seed 7 --max-nnz 1000000 --mix ..." then scores what was trained on fresh validation
# problems (python -m sparserl_compile.training.validation, FRESH_EVALUATOR: gpu) beside FRESH_CHECKPOINTS (default: the shipped
# default checkpoint, as v3), in the same call: $OUT/fresh.json, paired later with training.compare.
# SEEDS="1 2 3" trains one RL run per seed instead of one (rl_s<seed>, each RL_S; one per GPU at once
# where several are visible, else in turn) and their weight average rl_soup (sparserl train soup),
# which FRESH and EVAL score beside the runs; ckpt_rl_soup.tgz comes back, and the runs' (at most KEEP_MEMBERS,
# default 3: a checkpoint is about 14.5 MB packed, and a call returns 64 MiB in all) while the call's 8 files
# allow, each as its run ends on one GPU (a call cut later keeps them).
# A run that finished in an earlier call on the same warm machine (same RUNS) is kept, not run again:
# SEEDS="1" in one call, then SEEDS="1 2" in the next, trains seed 2 and averages the two. Its
# checkpoint, if that call could not return it (8 files, 64 MiB), comes back first in the next.
# RUNS (default /tmp/sr_runs) outlives the call on a machine that stays warm: the next call resumes
# the stages found there. Give an independent run its own RUNS; a stage resumed under other settings
# (another --seed, --reward, ...) stops with an error instead of continuing the first run.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$(pwd)/device_out}"
RUNS="${RUNS:-/tmp/sr_runs}"
SIZE="${SIZE:-default}"
PT_S="${PT_S:-90}"; SFT_S="${SFT_S:-100}"; RL_S="${RL_S:-130}"
DATA="${DATA:-$(python3 -c "from sparserl_compile.training.data import DEFAULT_SUPERVISION as d; print(d)")}"  # the stages' default files
# the logs stay out of $OUT (at most 8 files come back from a call; loose logs could crowd out a
# checkpoint) and come back in logs.tgz
LOGS_ROOT="$(mktemp -d)"; LOGS="$LOGS_ROOT/logs"; mkdir -p "$LOGS" "$RUNS" "$OUT"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || tail -20 "$LOGS/install.log"
python3 -c "import llguidance, torch; print('llguidance', llguidance.__version__ if hasattr(llguidance, '__version__') else 'ok', 'cuda', torch.cuda.is_available())"

SR="python3 -m sparserl_compile.commands.cli"
keep() {  # a stage's checkpoint (weights, tokenizer, configs, trainer log; not the optimizer) and
  # the logs so far, as tarballs: the device returns few files per call, each under 16 MiB, so
  # RL's validation-best checkpoint (--validate: <out>/best/) is a tarball of its own
  [ -d "$RUNS/$1" ] && tar -czf "$OUT/ckpt_$1.tgz" -C "$RUNS/$1" --exclude 'optimizer*' --exclude './best' --exclude './average' .
  [ -d "$RUNS/$1/best" ] && tar -czf "$OUT/ckpt_$1_best.tgz" -C "$RUNS/$1/best" .
  [ -d "$RUNS/$1/average" ] && tar -czf "$OUT/ckpt_$1_average.tgz" -C "$RUNS/$1/average" .  # --average-from
  tar -czf "$OUT/logs.tgz" -C "$LOGS_ROOT" logs
}

if [ "$PT_S" != 0 ]; then
echo "== pretrain ($PT_S s)"
timeout $((PT_S + 120)) $SR train pretrain --out-dir "$RUNS/pretrain" --size "$SIZE" --steps 20000 \
  --batch-size 32 --block-size 512 --max-corpus-bytes 8000000 --lr 1e-3 --log-every 100 --save-every 100000 \
  --time-budget-s "$PT_S" >"$LOGS/pretrain.log" 2>&1
echo "rc=$?"; grep -E "parameters|budget|step .*loss" "$LOGS/pretrain.log" | tail -4; keep pretrain
fi
unpacked() {  # a checkpoint folder as is; a .tgz of one (python benchmarks/device_carry.py --pack), unpacked once into $RUNS
  case "$1" in
    *.tgz) local d="$RUNS/init_$(basename "$1" .tgz)"
           [ -f "$d/model.safetensors" ] || { mkdir -p "$d" && tar -xzf "$1" -C "$d"; } || { echo "cannot unpack $1" >&2; exit 2; }
           echo "$d";;
    *) echo "$1";;
  esac
}
SFT_INIT="$(unpacked "${SFT_INIT:-$RUNS/pretrain}")" || exit 2
[ -n "${RL_INIT:-}" ] && { RL_INIT="$(unpacked "$RL_INIT")" || exit 2; }

sft_stage() {  # name, extra args
  local name="$1"; shift
  echo "== $name from $SFT_INIT ($SFT_S s) ${SFT_ARGS:-} $*"
  timeout $((SFT_S + 150)) $SR train sft --init "$SFT_INIT" --out-dir "$RUNS/$name" --data "$DATA" --steps 20000 \
    --batch-size 16 --top-variants 3 --lr 5e-4 --log-every 100 --save-every 100000 \
    --time-budget-s "$SFT_S" ${SFT_ARGS:-} "$@" >"$LOGS/$name.log" 2>&1
  echo "rc=$?"; grep -E "training examples|ablation|budget|held-out|step .*loss" "$LOGS/$name.log" | tail -5; keep "$name"
}

DONE=.sr_finished  # in a run folder: the stage ended by itself (budget or steps), not by timeout
RETURNED=.sr_returned  # in a SEEDS run folder: its checkpoint came back from a call (under $OUT)
rl_stage() {  # name, extra args
  local name="$1"; shift
  echo "== $name ($RL_S s, ${RL_EVALUATOR:-gpu} rewards) ${RL_ARGS:-} $*"
  timeout $((RL_S + 150)) $SR train rl --init "${RL_INIT:-$RUNS/sft}" --out-dir "$RUNS/$name" --data "$DATA" --steps 10000 \
    --evaluator "${RL_EVALUATOR:-gpu}" --workers 4 --k 8 --problems-per-step 2 --lr 1e-5 --save-every 100000 \
    --time-budget-s "$RL_S" ${RL_ARGS:-} "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?; echo "rc=$rc"; grep -E "^\[rl\]" "$LOGS/$name.log" | tail -6
  [ "$rc" = 0 ] && touch "$RUNS/$name/$DONE"  # SEEDS: a later call on this machine does not run it again
  [ "${KEEP_EACH:-1}" = 0 ] || keep "$name"
}

TRAINED=""
if [ "$SFT_S" != 0 ]; then
  sft_stage sft
  TRAINED="sft=$RUNS/sft"
elif [ -z "${RL_INIT:-}" ] && [ "$RL_S" != 0 ]; then
  echo "SFT_S=0 skips SFT: set RL_INIT to the checkpoint RL starts from"; exit 2
fi
if [ "$RL_S" != 0 ] && [ -n "${SEEDS:-}" ]; then
  # one RL run per seed from the same start, then their weight average (sparserl train soup)
  NGPU="${NGPU:-$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")}"  # NGPU=2 on a CPU tests the parallel path
  # at most 8 files, 64 MiB in all, come back from a call: the soup, logs.tgz, fresh.json and
  # eval.json are reserved; the first KEEP_MEMBERS new runs' checkpoints (and their
  # --average-from averages) take what is left, each as soon as its run ends, so a call cut by
  # its limit keeps them
  budget=8; KEPT=""; SOUP=0
  [ "$(echo $SEEDS | wc -w)" -gt 1 ] && SOUP=1 && budget=$((budget - 1))
  [ -n "${FRESH:-}" ] && budget=$((budget - 1)); [ -n "${EVAL:-}" ] && budget=$((budget - 1))
  keep_member() {  # seed
    local ckpts=$((1 + $([ -d "$RUNS/rl_s$1/average" ] && echo 1 || echo 0)))
    local need=$((ckpts + $([ -f "$OUT/logs.tgz" ] && echo 0 || echo 1)))
    # and 64 MiB in all: what is there, these checkpoints and the soup's, each about its weights' size
    local weights=$(stat -c %s "$RUNS/rl_s$1/model.safetensors" 2>/dev/null || echo 0)  # not the optimizer, left out
    local bytes=$(( $(du -cb "$OUT" | tail -1 | cut -f1) + (ckpts + SOUP) * weights ))
    if [ "$(echo $KEPT | wc -w)" -lt "${KEEP_MEMBERS:-3}" ] && [ $(( $(ls "$OUT" | wc -l) + need )) -le "$budget" ] \
        && [ "$bytes" -le $((64 * 1024 * 1024)) ]; then
      keep "rl_s$1"; KEPT="$KEPT $1"; touch "$RUNS/rl_s$1/$RETURNED"
    else
      tar -czf "$OUT/logs.tgz" -C "$LOGS_ROOT" logs
    fi
  }
  i=0; MEMBERS=""; NEW=""
  for seed in $SEEDS; do  # finished in an earlier call whose limits left its checkpoint behind: returned first
    [ -f "$RUNS/rl_s$seed/$DONE" ] && [ ! -f "$RUNS/rl_s$seed/$RETURNED" ] && keep_member "$seed"
  done
  for seed in $SEEDS; do
    MEMBERS="${MEMBERS:+$MEMBERS,}$RUNS/rl_s$seed"
    if [ -f "$RUNS/rl_s$seed/$DONE" ]; then  # finished in an earlier call on this warm machine: not run again
      echo "== rl_s$seed: finished in an earlier call"; continue
    fi
    NEW="$NEW $seed"
    if [ "$NGPU" -gt 1 ]; then  # one run per GPU at once; a new group starts when every GPU is busy
      CUDA_VISIBLE_DEVICES=$((i % NGPU)) KEEP_EACH=0 rl_stage "rl_s$seed" --seed "$seed" &
      i=$((i + 1)); [ $((i % NGPU)) = 0 ] && wait
    else
      KEEP_EACH=0 rl_stage "rl_s$seed" --seed "$seed"
      keep_member "$seed"
    fi
  done
  wait
  for seed in $NEW; do  # runs made at once on several GPUs are kept once all of them end
    case " $KEPT " in *" $seed "*) ;; *) keep_member "$seed";; esac
  done
  if [ "$(echo $SEEDS | wc -w)" -gt 1 ]; then
    echo "== soup of $MEMBERS"
    $SR train soup --checkpoints "$MEMBERS" --out "$RUNS/rl_soup" >"$LOGS/soup.log" 2>&1; echo "rc=$?"; tail -1 "$LOGS/soup.log"
    keep rl_soup
    TRAINED="${TRAINED:+$TRAINED,}rl_soup=$RUNS/rl_soup"
  fi
  for seed in $SEEDS; do TRAINED="${TRAINED:+$TRAINED,}rl_s$seed=$RUNS/rl_s$seed"; done
elif [ "$RL_S" != 0 ]; then
  rl_stage rl
  TRAINED="${TRAINED:+$TRAINED,}rl=$RUNS/rl"
fi
if [ "${ABLATE:-0}" = 1 ]; then
  if [ "$RL_S" != 0 ]; then
    rl_stage rl_correctness --reward correctness
    TRAINED="${TRAINED:+$TRAINED,}rl_correctness=$RUNS/rl_correctness"
  fi
  if [ "$SFT_S" != 0 ]; then
    sft_stage sft_nosin --no-sinusoidal
    TRAINED="${TRAINED:+$TRAINED,}sft_nosin=$RUNS/sft_nosin"
  fi
fi
if [ -n "${FRESH:-}" ] && [ -n "$TRAINED" ]; then
  FRESH_ALL="${FRESH_CHECKPOINTS:-v3=policy/checkpoints/default},$TRAINED"
  echo "== python -m sparserl_compile.training.validation --checkpoints $FRESH_ALL $FRESH"
  timeout "${FRESH_TIMEOUT:-200}" python3 -m sparserl_compile.training.validation --checkpoints "$FRESH_ALL" $FRESH \
    --evaluator "${FRESH_EVALUATOR:-gpu}" --out "$OUT/fresh.json" >"$LOGS/fresh.log" 2>&1
  echo "rc=$?"; grep -E "^\[validation\]" "$LOGS/fresh.log"
  keep none
fi
TRAINED="$TRAINED${EVAL_CHECKPOINTS:+${TRAINED:+,}$EVAL_CHECKPOINTS}"
if [ -n "${EVAL:-}" ]; then
  echo "== sparserl eval --checkpoints $TRAINED $EVAL"
  timeout "${EVAL_TIMEOUT:-300}" $SR eval --checkpoints "$TRAINED" $EVAL --out "$OUT/eval.json" >"$LOGS/eval.log" 2>&1
  echo "rc=$?"; grep -E "^\[eval\] [a-z_/]+: " "$LOGS/eval.log" | cut -c1-600
  keep none
fi
ls -la "$OUT"
