#!/usr/bin/env bash
# The one script the lead runs on the device (one H200), in one call:
#   [GNN="..."] [LLM="..."] [EVAL="..."] [COLD="..."] [E2E="..."] [PREGEN="..."] [DECODE="..."] bash benchmarks/device_run.sh [sparserl bench args...]
#   e.g. --quick --time-budget 300 (no bench args: no suite)
# Installs the package (no deps: the image has torch etc.), prints versions, runs the GPU tests
# and the CPU tests of the GPU pieces, then `sparserl bench` with the given args, and writes
# everything under "$OUT" as it goes: logs/, junit XML, and in $OUT/bench the results JSON, supervision
# data and markdown reports as the suite writes them. Ends with a short summary (the tool returns the last 12k chars).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$(pwd)/device_out}"
mkdir -p "$OUT"
LOGS="$OUT/logs"; mkdir -p "$LOGS"
BENCH_DIR="$OUT/bench"  # written as the suite goes: a call cut by its time limit keeps what finished
mkdir -p "$BENCH_DIR"

echo "== install"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 \
  || { echo "pip install failed:"; tail -30 "$LOGS/install.log"; }

# wheels the image lacks (e.g. llguidance for constrained decoding), carried in .whl/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps .whl/*.whl >>"$LOGS/install.log" 2>&1 || echo "carried wheels failed to install"
fi

echo "== versions"
python3 - <<'EOF' 2>&1 | tee "$LOGS/versions.log"
import importlib.metadata as md, torch
for d in ("torch", "cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc", "cupy-cuda13x", "numpy", "scipy", "transformers", "llguidance", "sparserl"):
    try: print(f"{d:20s} {md.version(d)}")
    except md.PackageNotFoundError: print(f"{d:20s} -")
print("cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
EOF

GPU_RC=skipped
if [ "${GPU_TESTS:-1}" != 0 ]; then
echo "== gpu tests (at most ${GPU_TEST_TIMEOUT:-180}s)"
timeout "${GPU_TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu tests -p no:cacheprovider \
  --junitxml="$OUT/junit_gpu.xml" >"$LOGS/pytest_gpu.log" 2>&1
GPU_RC=$?
tail -25 "$LOGS/pytest_gpu.log"
fi

CPU_RC=skipped
if [ -n "${CPU_TESTS:-}" ]; then
echo "== cpu tests of the gpu pieces"
python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit_cpu.xml" \
  tests/sparserl_compile/test_launcher.py tests/sparserl_compile/test_sandbox.py \
  tests/sparserl_compile/test_verify.py tests/sparserl_compile/test_bench.py \
  tests/sparserl_compile/test_select.py tests/sparserl_compile/test_search.py \
  tests/sparserl_compile/test_suite.py >"$LOGS/pytest_cpu.log" 2>&1
CPU_RC=$?
tail -8 "$LOGS/pytest_cpu.log"
fi

# Applications, before the suite (each optional): GNN="args of examples/gnn_inference.py",
# LLM="args of examples/pruned_llm.py" (their JSON goes to $OUT/bench/{gnn,llm}.json)
APP_RC=
if [ -n "${GNN:-}" ]; then
  echo "== gnn_inference.py $GNN"
  timeout "${GNN_TIMEOUT:-400}" python3 examples/gnn_inference.py $GNN --json "$BENCH_DIR/gnn.json" >"$LOGS/gnn.log" 2>&1
  APP_RC="gnn=$?"
  grep -v "^ *warn\|UserWarning" "$LOGS/gnn.log" | tail -60
fi
if [ -n "${LLM:-}" ]; then
  echo "== pruned_llm.py $LLM"
  timeout "${LLM_TIMEOUT:-400}" python3 examples/pruned_llm.py $LLM --json "$BENCH_DIR/llm.json" >"$LOGS/llm.log" 2>&1
  APP_RC="$APP_RC llm=$?"
  grep -v "^ *warn\|UserWarning" "$LOGS/llm.log" | tail -40
fi

# The policy's held-out evaluation (optional): EVAL="args of sparserl eval" (JSON to $OUT/bench/eval*.json);
# EVAL2 runs a second one after it (e.g. another checkpoint), each cut at EVAL_TIMEOUT seconds
for i in "" 2; do
  v="EVAL$i"; args="${!v:-}"
  [ -n "$args" ] || continue
  echo "== sparserl eval $args"
  timeout "${EVAL_TIMEOUT:-300}" python3 -m sparserl_compile.cli eval $args --out "$BENCH_DIR/eval$i.json" >"$LOGS/eval$i.log" 2>&1
  APP_RC="$APP_RC eval$i=$?"
  grep -v "^ *warn\|Warning\|Loading weights" "$LOGS/eval$i.log" | tail -40
done

# Cold start per provider (optional): COLD="args of benchmarks/cold_start.py" (JSON to $OUT/bench/cold_start.json)
if [ -n "${COLD:-}" ]; then
  echo "== cold_start.py $COLD"
  timeout "${COLD_TIMEOUT:-240}" python3 benchmarks/cold_start.py $COLD --json "$BENCH_DIR/cold_start.json" >"$LOGS/cold.log" 2>&1
  APP_RC="$APP_RC cold=$?"
  grep -v "Warning\|warn\|Loading weights\|sparse_csr_tensor" "$LOGS/cold.log" | tail -60
fi

# Through the runtime's provider on the held-out split (optional): E2E="args of benchmarks/provider_e2e.py"
if [ -n "${E2E:-}" ]; then
  echo "== provider_e2e.py $E2E"
  timeout "${E2E_TIMEOUT:-300}" python3 benchmarks/provider_e2e.py $E2E --json "$BENCH_DIR/provider_e2e.json" >"$LOGS/e2e.log" 2>&1
  APP_RC="$APP_RC e2e=$?"
  grep -v "Warning\|warn\|Loading weights\|sparse_csr_tensor" "$LOGS/e2e.log" | tail -100
fi

# Pre-generation, end to end (optional): PREGEN="args of examples/pregenerate.py", e.g.
# "$SPARSERL_SHARED_MATRICES --compare-search" (the cache goes to /tmp, the JSON to $OUT/bench/pregen.json)
if [ -n "${PREGEN:-}" ]; then
  echo "== pregenerate.py $PREGEN"
  rm -rf /tmp/sr_pregen_cache
  timeout "${PREGEN_TIMEOUT:-300}" python3 examples/pregenerate.py $PREGEN --out /tmp/sr_pregen_cache --no-progress \
    --json "$BENCH_DIR/pregen.json" >"$LOGS/pregen.log" 2>&1
  APP_RC="$APP_RC pregen=$?"
  grep -v "Warning\|warn" "$LOGS/pregen.log" | tail -60
fi

# Policy decoding, plain vs speculative (optional): DECODE="args of benchmarks/decode_speed.py", e.g. "--k 4"
if [ -n "${DECODE:-}" ]; then
  echo "== decode_speed.py $DECODE"
  timeout "${DECODE_TIMEOUT:-180}" python3 benchmarks/decode_speed.py $DECODE --json "$BENCH_DIR/decode_speed.json" >"$LOGS/decode.log" 2>&1
  APP_RC="$APP_RC decode=$?"
  grep -v "Warning\|warn\|Loading weights\|forward_call" "$LOGS/decode.log" | tail -20
fi

BENCH_RC=skipped
if [ $# -gt 0 ]; then
echo "== sparserl bench $*"
python3 -m sparserl_compile.cli bench --out "$BENCH_DIR" "$@" >"$LOGS/bench.log" 2>&1
BENCH_RC=$?
tail -30 "$LOGS/bench.log"
fi
# An optional second suite in the same call, e.g. BENCH2="--suite shared --widths 32 --time-budget 150"
if [ -n "${BENCH2:-}" ]; then
  echo "== sparserl bench $BENCH2"
  sleep 1  # results files are named by the second
  python3 -m sparserl_compile.cli bench --out "$BENCH_DIR" $BENCH2 >"$LOGS/bench2.log" 2>&1
  BENCH_RC="$BENCH_RC/$?"
  tail -20 "$LOGS/bench2.log"
fi

RESULTS_ALL="$(ls -t "$BENCH_DIR"/bench_*.json 2>/dev/null)"
RESULTS="$(echo "$RESULTS_ALL" | head -1)"
for r in $RESULTS_ALL; do
  python3 benchmarks/report.py "$r" --out "$BENCH_DIR/$(basename "$r" .json)_report.md" --no-plots >>"$LOGS/report.log" 2>&1
done

echo "== summary"
echo "gpu tests rc=$GPU_RC  cpu tests rc=$CPU_RC  apps $APP_RC  bench rc=$BENCH_RC"
grep -E "passed|failed|error" "$LOGS/pytest_gpu.log" 2>/dev/null | tail -3
if [ -n "$RESULTS" ]; then
  python3 - $RESULTS_ALL <<'EOF'
import json, sys, math
rows = [r for p in sys.argv[1:] for r in json.load(open(p))["rows"] if "op" in r]
print(f"{'matrix':24s} {'op':8s} {'nnz':>9s} {'torch':>8s} {'best':>8s} {'x':>6s} {'floor':>6s}  family")
sp = []
for r in rows:
    op = "spmv" if r["op"] == "spmv" else f"spmm{r['n']}"
    f = lambda v, s=".1f": "-" if v is None else format(v, s)
    print(f"{r['matrix'][:24]:24s} {op:8s} {r.get('nnz', 0):>9d} {f(r.get('torch_int32_us')):>8s} "
          f"{f(r.get('best_us')):>8s} {f(r.get('speedup'), '.2f'):>6s} {f((r.get('frac_floor') or 0)*100, '.0f'):>6s}  "
          f"{r.get('best_family') or r.get('error', '')[:40]}")
    if r.get("speedup"): sp.append(r["speedup"])
if sp: print(f"geomean speedup {math.exp(sum(map(math.log, sp))/len(sp)):.2f} over {len(sp)} rows")
EOF
fi
# at most 8 files come back from a call: pack the logs
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
ls -la "$OUT" "$BENCH_DIR"
