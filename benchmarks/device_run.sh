#!/usr/bin/env bash
# Everything a GPU machine runs, in one call:
#   [GNN="..."] [LLM="..."] [EVAL="..."] [COLD="..."] [E2E="..."] [PREGEN="..."] bash benchmarks/device_run.sh [sparserl bench args...]
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

# numba's disk cache, as `make setup` writes it: otherwise the first process here (a test, a
# benchmark's first case) would also compile sparserl's numba code (seconds)
python3 -m sparserl_compile.commands.cli warm >"$LOGS/warm.log" 2>&1; head -1 "$LOGS/warm.log"

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
# Each test file with GPU tests in a pytest process of its own, GPU_TEST_JOBS at a time, each cut
# at GPU_TEST_TIMEOUT seconds: a file that hangs or breaks its CUDA context takes no other file's
# results with it, and each file's failures come back in full in logs/gpu/ (GPU_TEST_JOBS=1 for
# timing-sensitive tests run alone).
echo "== gpu tests (${GPU_TEST_JOBS:-4} files at a time, each at most ${GPU_TEST_TIMEOUT:-300}s)"
mkdir -p "$LOGS/gpu"
python3 -m pytest --collect-only -q -m gpu tests -p no:cacheprovider 2>/dev/null | grep "::" | cut -d: -f1 \
  | sort -u | grep -E "${GPU_TEST_ONLY:-.}" >"$LOGS/gpu_files.txt"  # GPU_TEST_ONLY: a regex of the files to run
export LOGS GPU_TEST_TIMEOUT
xargs -P "${GPU_TEST_JOBS:-4}" -I{} bash -c 'f={}; n=$(echo "$f" | tr / _); timeout "${GPU_TEST_TIMEOUT:-300}" \
  python3 -m pytest -q -rfE --tb=short -m gpu "$f" -p no:cacheprovider --junitxml="$LOGS/gpu/$n.xml" \
  >"$LOGS/gpu/$n.log" 2>&1; echo "rc=$? $f: $(tail -1 "$LOGS/gpu/$n.log")"' <"$LOGS/gpu_files.txt" \
  | tee "$LOGS/pytest_gpu.log"
GPU_RC=$(grep -cv "^rc=0 " "$LOGS/pytest_gpu.log")  # files that failed or were cut
[ -s "$LOGS/gpu_files.txt" ] || { GPU_RC="no GPU test collected"; echo "$GPU_RC (pytest --collect-only -m gpu found none)"; }
grep -h "^FAILED\|^ERROR" "$LOGS"/gpu/*.log | cut -c1-250 | head -40
fi

CPU_RC=skipped
if [ -n "${CPU_TESTS:-}" ]; then
echo "== cpu tests of the gpu pieces"
python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit_cpu.xml" \
  tests/sparserl_compile/test_launcher.py tests/sparserl_compile/test_sandbox.py \
  tests/sparserl_compile/test_verify.py tests/sparserl_compile/test_bench.py \
  tests/sparserl_compile/test_select.py tests/sparserl_compile/test_search.py \
  tests/sparserl_compile/commands/test_bench.py >"$LOGS/pytest_cpu.log" 2>&1
CPU_RC=$?
tail -8 "$LOGS/pytest_cpu.log"
fi

# The [gpu] extra with the CUDA toolkit hidden (DRIVER_ONLY=1): benchmarks/driver_only.sh
DRIVER_RC=skipped
if [ -n "${DRIVER_ONLY:-}" ]; then
  echo "== driver only"
  timeout "${DRIVER_TIMEOUT:-240}" bash benchmarks/driver_only.sh >"$LOGS/driver_only.log" 2>&1
  DRIVER_RC=$?
  tail -15 "$LOGS/driver_only.log"
fi

# The optional steps, each set by a variable holding its arguments. run_hook NAME ARGS LIMIT
# LINES FILTER CMD... runs `CMD... ARGS` when ARGS is not empty, cut at LIMIT seconds, output
# in $LOGS/NAME.log (the last LINES lines not matching FILTER printed), NAME=rc added to APP_RC.
# Every CMD writes its JSON under $OUT/bench.
APP_RC=
run_hook() {
  local name=$1 args=$2 limit=$3 lines=$4 filter=$5
  shift 5
  [ -n "$args" ] || return 0
  echo "== $name: $* $args"
  timeout "$limit" "$@" $args >"$LOGS/$name.log" 2>&1
  APP_RC="$APP_RC $name=$?"
  grep -v "$filter" "$LOGS/$name.log" | tail -"$lines"
}
QUIET="Warning\|warn\|Loading weights\|sparse_csr_tensor"

# Applications, before the suite: GNN="args of examples/gnn_inference.py", LLM="args of examples/pruned_llm.py"
run_hook gnn "${GNN:-}" "${GNN_TIMEOUT:-400}" 60 "^ *warn\|UserWarning" \
  python3 examples/gnn_inference.py --json "$BENCH_DIR/gnn.json"
run_hook llm "${LLM:-}" "${LLM_TIMEOUT:-400}" 40 "^ *warn\|UserWarning" \
  python3 examples/pruned_llm.py --json "$BENCH_DIR/llm.json"

# The hot path, graph SpMM families, pruned-LLM layers: HOT="args of benchmarks/hot_path.py",
# GRAPHK="args of benchmarks/graph_kernels.py", LLMK="args of benchmarks/llm_layers.py"
run_hook hot "${HOT:-}" "${HOT_TIMEOUT:-300}" 60 "$QUIET" \
  python3 benchmarks/hot_path.py --json "$BENCH_DIR/hot_path.json"
run_hook graphk "${GRAPHK:-}" "${GRAPHK_TIMEOUT:-300}" 60 "$QUIET" \
  python3 benchmarks/graph_kernels.py --json "$BENCH_DIR/graph_kernels.json"
run_hook llmk "${LLMK:-}" "${LLMK_TIMEOUT:-300}" 60 "$QUIET" \
  python3 benchmarks/llm_layers.py --json "$BENCH_DIR/llm_layers.json"

# The policy's held-out evaluation: EVAL="args of sparserl eval"; EVAL2 runs a second one after
# it (e.g. another checkpoint), each cut at EVAL_TIMEOUT seconds
for i in "" 2; do
  v="EVAL$i"
  run_hook "eval$i" "${!v:-}" "${EVAL_TIMEOUT:-300}" 40 "^ *warn\|Warning\|Loading weights" \
    python3 -m sparserl_compile.commands.cli eval --out "$BENCH_DIR/eval$i.json"
done

# Cold start per provider: COLD="args of benchmarks/cold_start.py"
run_hook cold "${COLD:-}" "${COLD_TIMEOUT:-240}" 60 "$QUIET" \
  python3 benchmarks/cold_start.py --json "$BENCH_DIR/cold_start.json"

# Through the runtime's provider on the held-out split: E2E="args of benchmarks/provider_e2e.py"
run_hook e2e "${E2E:-}" "${E2E_TIMEOUT:-300}" 100 "$QUIET" \
  python3 benchmarks/provider_e2e.py --json "$BENCH_DIR/provider_e2e.json"

# Pre-generation, end to end: PREGEN="args of examples/pregenerate.py", e.g.
# "$PWD/.device_carry/pregen --provider search --compare-search --time". The cache is built in
# PREGEN_CACHE (default: a fresh /tmp/sr_pregen_cache) and comes back as $OUT/pregen_cache.tgz;
# a later call on another machine serves it: carry it unpacked, e.g. in .device_carry/pregen_cache,
# and set PREGEN_CACHE=$PWD/.device_carry/pregen_cache PREGEN="... --serve-only --time".
PREGEN_CACHE="${PREGEN_CACHE:-/tmp/sr_pregen_cache}"
[ -z "${PREGEN:-}" ] || [ "$PREGEN_CACHE" != /tmp/sr_pregen_cache ] || rm -rf "$PREGEN_CACHE"
run_hook pregen "${PREGEN:-}" "${PREGEN_TIMEOUT:-300}" 60 "Warning\|warn" \
  python3 examples/pregenerate.py --out "$PREGEN_CACHE" --no-progress --json "$BENCH_DIR/pregen.json"
[ -z "${PREGEN:-}" ] || [ ! -d "$PREGEN_CACHE" ] \
  || tar czf "$OUT/pregen_cache.tgz" -C "$(dirname "$PREGEN_CACHE")" "$(basename "$PREGEN_CACHE")"

BENCH_RC=skipped
if [ $# -gt 0 ]; then
echo "== sparserl bench $*"
python3 -m sparserl_compile.commands.cli bench --out "$BENCH_DIR" "$@" >"$LOGS/bench.log" 2>&1
BENCH_RC=$?
tail -30 "$LOGS/bench.log"
fi
# An optional second suite in the same call, e.g. BENCH2="--suite shared --widths 32 --time-budget 150"
if [ -n "${BENCH2:-}" ]; then
  echo "== sparserl bench $BENCH2"
  sleep 1  # results files are named by the second
  python3 -m sparserl_compile.commands.cli bench --out "$BENCH_DIR" $BENCH2 >"$LOGS/bench2.log" 2>&1
  BENCH_RC="$BENCH_RC/$?"
  tail -20 "$LOGS/bench2.log"
fi

RESULTS_ALL="$(ls -t "$BENCH_DIR"/bench_*.json 2>/dev/null)"
RESULTS="$(echo "$RESULTS_ALL" | head -1)"
for r in $RESULTS_ALL; do
  python3 benchmarks/report.py "$r" --out "$BENCH_DIR/$(basename "$r" .json)_report.md" --no-plots >>"$LOGS/report.log" 2>&1
done

echo "== summary"
echo "gpu test files not passing: $GPU_RC  cpu tests rc=$CPU_RC  driver-only rc=$DRIVER_RC  apps $APP_RC  bench rc=$BENCH_RC"
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
# at most 8 files come back from a call: pack the logs, and the results where there are many
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
if [ "$(ls "$BENCH_DIR" | wc -l)" -gt 5 ]; then
  tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$BENCH_DIR"
fi
ls -la "$OUT" "$BENCH_DIR"
