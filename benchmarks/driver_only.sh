#!/usr/bin/env bash
# The `[gpu]` install on a machine with only the NVIDIA driver, checked on a GPU machine that also
# has a CUDA toolkit: in a private mount namespace every /usr/local/cuda* folder is hidden under
# an empty tmpfs, CUDA_HOME / CUDA_PATH are unset and PATH loses its CUDA folders, so NVRTC, the
# headers and the launch can only come from the pip wheels the `gpu` extra names. Then:
#   1. each requirement of the `gpu` extra is installed at a version it accepts;
#   2. no toolkit is visible (nvcc, /usr/local/cuda*/include, a cuda_fp16.h outside site-packages);
#   3. the headers NVRTC gets come from a wheel;
#   4. the GPU tests of the compiler, the launcher and the runtime pass.
# Needs root (unshare -m); prints why and exits 2 where it cannot hide the toolkit.
#   bash benchmarks/driver_only.sh            (DRIVER_ONLY=1 in benchmarks/device_run.sh)
set -u -o pipefail
if [ "${1:-}" != inside ]; then
  exec unshare -m --propagation private bash "$0" inside \
    || { echo "driver-only: unshare -m failed (needs root): toolkit not hidden, nothing checked"; exit 2; }
fi
for d in /usr/local/cuda*; do
  [ -d "$d" ] && mount -t tmpfs none "$d"
done
unset CUDA_HOME CUDA_PATH
PATH="$(echo "$PATH" | tr : '\n' | grep -vi cuda | paste -sd:)"
LD_LIBRARY_PATH="$(echo "${LD_LIBRARY_PATH:-}" | tr : '\n' | grep -vi cuda | paste -sd:)"
export PATH LD_LIBRARY_PATH

fail=0
python3 - <<'EOF' || fail=1
import importlib.metadata as md
from packaging.requirements import Requirement
bad = []
for text in md.requires("sparserl") or []:
    r = Requirement(text)
    if r.marker is None or not r.marker.evaluate({"extra": "gpu"}) or r.marker.evaluate({"extra": ""}):
        continue  # not a requirement of the gpu extra alone
    try:
        v = md.version(r.name)
    except md.PackageNotFoundError:
        bad.append(f"{r.name}: not installed")
        continue
    ok = r.specifier.contains(v, prereleases=True)
    print(f"  {r.name:22s} {v:12s} {'ok' if ok else 'REJECTED by ' + str(r.specifier)}")
    if not ok:
        bad.append(f"{r.name} {v} not in {r.specifier}")
if bad:
    raise SystemExit("gpu extra not satisfied: " + "; ".join(bad))
EOF

if nvcc --version >/dev/null 2>&1; then echo "toolkit still visible: $(command -v nvcc) runs"; fail=1; fi
for d in /usr/local/cuda*; do
  [ -e "$d/include/cuda_fp16.h" ] && { echo "toolkit still visible: $d/include"; fail=1; }
done
find / -xdev -name cuda_fp16.h -not -path "*site-packages*" -not -path "/proc/*" 2>/dev/null \
  | sed 's/^/  a cuda_fp16.h outside the wheels (not hidden): /'

python3 - <<'EOF' || fail=1
from sparserl_compile import compiler
inc = compiler.cuda_include_dir()
print("  headers from", inc)
if "site-packages" not in inc:
    raise SystemExit("the headers do not come from a wheel")
EOF

python3 -m pytest -q -m gpu -p no:cacheprovider tests/sparserl_compile/test_launcher.py \
  tests/sparserl_compile/test_runtime.py tests/sparserl_compile/test_plans.py 2>&1 | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || fail=1
echo "driver-only: $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail
