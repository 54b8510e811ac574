"""Probe the device image: versions and the exact cuda.core / NVRTC recipe the launcher relies on.

Run on the device: ``python3 benchmarks/probe_device.py``. Prints JSON.
"""
import importlib
import json
import os
import sys
import time

out = {"python": sys.version}
for mod in ["torch", "numpy", "scipy", "numba", "cuda.core", "cuda.bindings", "cupy", "triton",
            "transformers", "tokenizers", "safetensors", "llguidance", "onnx", "matplotlib",
            "hypothesis", "pytest", "tqdm", "ml_dtypes", "setuptools", "torch_geometric"]:
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", "present")
    except Exception as e:  # noqa: BLE001
        out[mod] = f"MISSING: {type(e).__name__}: {e}"[:200]

import numpy as np
import torch

out["cuda"] = torch.version.cuda
out["gpu"] = torch.cuda.get_device_name(0)
out["cap"] = torch.cuda.get_device_capability(0)
props = torch.cuda.get_device_properties(0)
out["sms"] = props.multi_processor_count
out["l2"] = getattr(props, "L2_cache_size", None)

src = r'''
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void k(int n, const __half* __restrict__ a, float* __restrict__ y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __half2float(a[i]) * 2.0f;
}
'''
try:
    from cuda.bindings import nvrtc
    err, ver_major, ver_minor = nvrtc.nvrtcVersion()
    out["nvrtc_version"] = (ver_major, ver_minor)
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"k.cu", 0, [], [])
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    out["nvrtc_compile_fp16_noinclude_path"] = str(err)
    err, logsize = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(logsize)
    nvrtc.nvrtcGetProgramLog(prog, log)
    out["nvrtc_log"] = bytes(log).decode(errors="replace")[:500]
except Exception as e:  # noqa: BLE001
    out["nvrtc_error"] = repr(e)[:500]

try:
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    t0 = time.perf_counter()
    prog = Program(src, code_type="c++", options=ProgramOptions(arch="sm_90"))
    obj = prog.compile("cubin")
    out["cuda_core_compile_ms"] = (time.perf_counter() - t0) * 1e3
    cubin = obj.code
    out["cubin_type"] = type(cubin).__name__
    from cuda.core import ObjectCode
    obj2 = ObjectCode.from_cubin(cubin)
    kern = obj2.get_kernel("k")

    class _S:
        def __init__(self, s):
            self.s = s

        def __cuda_stream__(self):
            return (0, self.s.cuda_stream)

    ts = torch.cuda.current_stream()
    stream = dev.create_stream(_S(ts))
    n = 1000
    a = torch.randn(n, device="cuda").half()
    y = torch.empty(n, device="cuda")
    cfg = LaunchConfig(grid=(4, 1, 1), block=(256, 1, 1), shmem_size=0)
    launch(stream, cfg, kern, np.int32(n), a.data_ptr(), y.data_ptr())
    torch.cuda.synchronize()
    out["launch_ok"] = bool(torch.allclose(y, a.float() * 2))
    # host overhead
    for _ in range(100):
        launch(stream, cfg, kern, np.int32(n), a.data_ptr(), y.data_ptr())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        launch(stream, cfg, kern, np.int32(n), a.data_ptr(), y.data_ptr())
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    out["launch_host_us"] = (t1 - t0) / 2000 * 1e6
    out["kernel_attrs"] = [a for a in dir(kern.attributes) if not a.startswith("_")][:40]
    out["launch_config_fields"] = [a for a in dir(cfg) if not a.startswith("_")]
except Exception:  # noqa: BLE001
    import traceback
    out["cuda_core_error"] = traceback.format_exc()[-1500:]

out["nvcc"] = os.popen("nvcc --version | tail -2").read()
out["cuda_include"] = os.path.exists("/usr/local/cuda/include/cuda_fp16.h")
out["pip_freeze_head"] = os.popen("python3 -m pip list 2>/dev/null | grep -i -E 'numba|llguidance|lark|cuda|nvidia|hypothesis|ml.dtypes|setuptools|wheel'").read()
print(json.dumps(out, indent=1, default=str))
