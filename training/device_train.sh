#!/usr/bin/env bash
# The three training stages on the device (one H200) in one call, each under a time budget:
#   bash training/device_train.sh            (carry .whl with the llguidance wheel)
# Stage budgets in seconds: PT_S, SFT_S, RL_S (defaults below); SIZE=default|small|tiny.
# The supervision records name matrices of ../shared/matrices: carry .device_carry too and set
# SPARSERL_SHARED_MATRICES (benchmarks/NOTES.md). Writes under "$OUT" after each stage:
# ckpt_<stage>.tgz (model, tokenizer, trainer state; no optimizer) and logs.tgz, so a call cut
# by its limit keeps the stages that finished. ckpt_rl becomes policy/checkpoints/default/.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$(pwd)/device_out}"
RUNS="${RUNS:-/tmp/sr_runs}"
SIZE="${SIZE:-default}"
PT_S="${PT_S:-90}"; SFT_S="${SFT_S:-100}"; RL_S="${RL_S:-130}"
DATA="${DATA:-$(python3 -c "from training.data import DEFAULT_SUPERVISION as d; print(d)")}"  # the stages' default files
LOGS="$OUT/logs"; mkdir -p "$LOGS" "$RUNS"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || tail -20 "$LOGS/install.log"
python3 -c "import llguidance, torch; print('llguidance', llguidance.__version__ if hasattr(llguidance, '__version__') else 'ok', 'cuda', torch.cuda.is_available())"

SR="python3 -m sparserl_compile.cli"
keep() {  # a stage's checkpoint (weights, tokenizer, configs, trainer log; not the optimizer) and
  # the logs so far, as tarballs: the device returns few files per call
  [ -d "$RUNS/$1" ] && tar -czf "$OUT/ckpt_$1.tgz" -C "$RUNS/$1" --exclude 'optimizer*' .
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs
}

echo "== pretrain ($PT_S s)"
timeout $((PT_S + 120)) $SR train pretrain --out-dir "$RUNS/pretrain" --size "$SIZE" --steps 20000 \
  --batch-size 32 --block-size 512 --max-corpus-bytes 8000000 --lr 1e-3 --log-every 100 --save-every 100000 \
  --time-budget-s "$PT_S" >"$LOGS/pretrain.log" 2>&1
echo "rc=$?"; grep -E "parameters|budget|step .*loss" "$LOGS/pretrain.log" | tail -4; keep pretrain

echo "== sft ($SFT_S s)"
timeout $((SFT_S + 150)) $SR train sft --init "$RUNS/pretrain" --out-dir "$RUNS/sft" --data "$DATA" --steps 20000 \
  --batch-size 16 --top-variants 3 --lr 5e-4 --log-every 100 --save-every 100000 \
  --time-budget-s "$SFT_S" >"$LOGS/sft.log" 2>&1
echo "rc=$?"; grep -E "training examples|budget|held-out|step .*loss" "$LOGS/sft.log" | tail -5; keep sft

echo "== rl ($RL_S s, gpu rewards)"
timeout $((RL_S + 150)) $SR train rl --init "$RUNS/sft" --out-dir "$RUNS/rl" --data "$DATA" --steps 10000 \
  --evaluator "${RL_EVALUATOR:-gpu}" --workers 4 --k 8 --problems-per-step 2 --lr 1e-5 --save-every 100000 \
  --time-budget-s "$RL_S" >"$LOGS/rl.log" 2>&1
echo "rc=$?"; grep -E "^\[rl\]" "$LOGS/rl.log" | tail -6; keep rl
ls -la "$OUT"
