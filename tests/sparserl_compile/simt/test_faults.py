"""Deliberately broken kernels are caught with a typed fault that names what went wrong."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import simt
from simt_cases import HDR_SCALAR, SHARED_REDUCE, SIG_F32, VECTOR_CSR
from sparserl_compile.matrices import uniform_random

M = uniform_random(200, 150, 5, seed=3)


def _args(m=M, x=None):
    x = np.ones(m.shape[1], np.float32) if x is None else x
    y = np.full(m.shape[0], np.nan, np.float32)
    return [np.int32(m.shape[0]), np.int32(m.shape[1]), m.indptr, m.indices, m.data, x, y], y


def _launch(src, *, grid=None, block=128, smem=0, m=M, **kw):
    k = simt.compile_kernel(src)
    args, y = _args(m)
    h = k.header.launch
    if grid is None:
        grid = h.grid({"n_rows": m.shape[0]})
    return k.launch(grid, block, smem, args, **kw), y


def _kernel(body: str, launch="// launch block=128 work=rows per_block=128\n") -> str:
    return "// sparserl op=spmv format=csr dtype=f32 index=i32\n" + launch + SIG_F32 + " {\n" + body + "\n}\n"


ROW = "    int row = blockIdx.x * blockDim.x + threadIdx.x;\n"


def test_missing_barrier_is_a_shared_memory_race():
    src = SHARED_REDUCE.replace("    part[threadIdx.x] = acc;\n    __syncthreads();", "    part[threadIdx.x] = acc;")
    assert src != SHARED_REDUCE
    with pytest.raises(simt.SharedMemoryRace) as e:
        _launch(src, grid=M.shape[0])
    assert e.value.array == "__shared__ part"
    assert "no __syncthreads" in str(e.value)


def test_race_on_one_shared_word():
    body = ROW + """    __shared__ float total[1];
    if (threadIdx.x == 0) total[0] = 0.0f;
    __syncthreads();
    total[0] += 1.0f;
    __syncthreads();
    if (row < n_rows) y[row] = total[0];"""
    with pytest.raises(simt.SharedMemoryRace, match="race on shared memory"):
        _launch(_kernel(body))


def test_barrier_in_divergent_branch():
    body = ROW + "    if (threadIdx.x < 64) __syncthreads();\n    if (row < n_rows) y[row] = 1.0f;"
    with pytest.raises(simt.BarrierDivergence) as e:
        _launch(_kernel(body))
    assert "64 of 128 threads" in str(e.value) and e.value.line == 5


def test_barriers_at_different_lines():
    body = ROW + "    if (threadIdx.x < 64) {\n        __syncthreads();\n    } else {\n        __syncthreads();\n    }"
    with pytest.raises(simt.BarrierDivergence, match="different __syncthreads"):
        _launch(_kernel(body))


def test_early_return_before_barrier_on_a_partial_block():
    body = ROW + "    if (row >= n_rows) return;\n    __syncthreads();\n    y[row] = 2.0f;"
    with pytest.raises(simt.BarrierDivergence, match="exited without reaching it"):
        _launch(_kernel(body))  # 200 rows: the second block has 72 live threads of 128


def test_wrong_shuffle_mask_leaves_out_the_caller():
    src = VECTOR_CSR.replace("0xffffffff", "0x0000ffff")
    with pytest.raises(simt.WarpMaskError, match="mask 0x0000ffff") as e:
        _launch(src)
    assert e.value.line == 1 + next(i for i, ln in enumerate(src.splitlines()) if "__shfl" in ln)


def test_shuffle_reading_a_lane_outside_the_mask():
    body = ROW + """    float v = 1.0f;
    if (threadIdx.x % 32 < 16) v = __shfl_down_sync(0x0000ffff, v, 8);
    if (row < n_rows) y[row] = v;"""
    with pytest.raises(simt.WarpMaskError, match="reads lane 16, which is not in mask"):
        _launch(_kernel(body))


def test_shuffle_waiting_for_an_exited_lane():
    body = ROW + """    if (threadIdx.x % 32 == 5) return;
    float v = __shfl_xor_sync(0xffffffff, 1.0f, 1);
    if (row < n_rows) y[row] = v;"""
    with pytest.raises(simt.WarpMaskError, match="exited"):
        _launch(_kernel(body))


def test_lanes_disagreeing_on_the_mask():
    body = ROW + """    unsigned m = threadIdx.x % 32 == 0 ? 0x3u : 0xffffffffu;
    float v = __shfl_sync(m, 1.0f, 0);
    if (row < n_rows) y[row] = v;"""
    with pytest.raises(simt.WarpMaskError, match="disagree on the mask"):
        _launch(_kernel(body))


def test_out_of_bounds_write_names_the_array_and_index():
    body = ROW + "    if (row < n_rows) y[row + 1] = 1.0f;"
    with pytest.raises(simt.OutOfBounds) as e:
        _launch(_kernel(body))
    assert (e.value.array, e.value.index, e.value.extent) == ("y", 200, 200)
    assert e.value.block == (1, 0, 0) and e.value.thread == (71, 0, 0)


def test_far_out_of_bounds_read_does_not_crash_the_process():
    body = ROW + "    if (row < n_rows) y[row] = x[row * 100000000LL];"
    with pytest.raises(simt.OutOfBounds) as e:
        _launch(_kernel(body))
    assert e.value.array == "x" and e.value.index == 100000000


def test_out_of_bounds_through_a_derived_pointer():
    body = ROW + "    const float* xr = x + n_cols;\n    if (row < n_rows) y[row] = xr[row];"
    with pytest.raises(simt.OutOfBounds) as e:
        _launch(_kernel(body))
    assert e.value.array == "x" and e.value.index == 150


def test_local_array_index_out_of_range():
    body = ROW + "    float acc[4];\n    acc[threadIdx.x % 8] = 1.0f;\n    if (row < n_rows) y[row] = acc[0];"
    with pytest.raises(simt.OutOfBounds) as e:
        _launch(_kernel(body))
    assert e.value.array == "local acc" and e.value.index == 4


def test_misaligned_vector_load():
    body = ROW + "    if (row < n_rows) y[row] = reinterpret_cast<const float4*>(x + 1)[0].x;"
    with pytest.raises(simt.MisalignedAccess, match="16-byte"):
        _launch(_kernel(body))


def test_endless_loop_hits_the_step_limit():
    body = ROW + "    float acc = 0.0f;\n    if (row < n_rows) for (int k = row_ptr[row]; k < row_ptr[row + 1]; ) acc += vals[k];\n    if (row < n_rows) y[row] = acc;"
    with pytest.raises(simt.StepLimitExceeded, match="1000 loop iterations"):
        _launch(_kernel(body), step_limit=1000)


def test_endless_loop_hits_the_time_limit():
    body = ROW + "    while (true) { }"
    with pytest.raises(simt.Timeout, match="time limit"):
        _launch(_kernel(body), time_limit_s=0.2)


def test_endless_loop_with_barriers_hits_the_time_limit():
    body = "    int i = 0;\n    while (i >= 0) { __syncthreads(); }\n"
    with pytest.raises(simt.Timeout):
        _launch(_kernel(body), time_limit_s=0.2)


def test_shared_memory_above_the_block_limit():
    body = ROW + "    __shared__ float big[60000];\n    big[threadIdx.x] = 1.0f;"
    with pytest.raises(simt.SharedMemoryExceeded):
        _launch(_kernel(body))


def test_unwritten_shared_memory_reads_as_nan():
    body = ROW + "    __shared__ float s[128];\n    if (row < n_rows) y[row] = s[threadIdx.x];"
    _, y = _launch(_kernel(body))
    assert np.isnan(y).all()


def test_a_correct_kernel_has_no_fault_on_an_empty_matrix():
    m = sp.csr_matrix((0, 0), dtype=np.float32)
    m.indptr = m.indptr.astype(np.int32)
    m.indices = m.indices.astype(np.int32)
    k = simt.compile_kernel(HDR_SCALAR + SIG_F32 + " {\n" + ROW + "    if (row < n_rows) y[row] = 0.0f;\n}\n")
    args, _ = _args(m)
    st = k.launch(1, 128, 0, args)
    assert st.blocks == 1


# ------------------------------------------------------------------ guarded mappings, output races

_SUM = ("    if (row >= n_rows) return;\n    float acc = 0.0f;\n"
        "    for (int k = row_ptr[row]; k < row_ptr[row + 1]; ++k) acc += vals[k] * x[col_idx[k]];\n")


@pytest.mark.parametrize("placement", [0, 1])
def test_raw_pointer_read_far_past_an_array_faults_naming_it(placement):
    """``(&x[0])[...]`` leaves the checked pointer; the guard region around x still faults."""
    body = ROW + _SUM + "    if (row == 0) acc += 0.0f * (&x[0])[n_cols + 5000];\n    y[row] = acc;"
    with pytest.raises(simt.OutOfBounds) as e:
        _launch(_kernel(body), placement=placement)
    assert e.value.array == "x" and e.value.index == M.shape[1] + 5000 and e.value.extent == M.shape[1]
    assert "raw pointer" in str(e.value)


def test_raw_pointer_read_one_past_the_end_or_one_before_faults_at_one_placement():
    past = _kernel(ROW + _SUM + "    if (row == 0) acc += 0.0f * (&x[0])[n_cols];\n    y[row] = acc;")
    before = _kernel(ROW + _SUM + "    if (row == 0) acc += 0.0f * (&x[0])[-1];\n    y[row] = acc;")
    m160 = uniform_random(200, 160, 5, seed=3)  # x of 640 bytes: it ends exactly where its pages end
    with pytest.raises(simt.OutOfBounds, match="index 160 is outside"):
        _launch(past, placement=1, m=m160)
    _, y = _launch(past, placement=0, m=m160)  # inside the fill after x: reads NaN, which shows in y
    assert np.isnan(y[0]) and not np.isnan(y[1:]).any()
    _, y = _launch(past, placement=1)  # 150 floats: 8 bytes of fill after x, read as NaN
    assert np.isnan(y[0])
    with pytest.raises(simt.OutOfBounds, match="index -1 is outside"):
        _launch(before, placement=0)


def test_raw_pointer_write_past_y_faults_or_is_found_in_the_fill():
    body = ROW + _SUM + "    y[row] = acc;\n    if (row == 0) (&y[0])[n_rows + 300] = 1.0f;"
    for placement in (0, 1):
        with pytest.raises(simt.OutOfBounds) as e:
            _launch(_kernel(body), placement=placement)
        assert e.value.array == "y" and e.value.index == M.shape[0] + 300
    near = ROW + _SUM + "    y[row] = acc;\n    if (row == 0) (&y[0])[n_rows + 1] = 1.0f;"
    with pytest.raises(simt.OutOfBounds, match="landed beside the array"):
        _launch(_kernel(near), placement=0)


def test_guarded_launch_copies_arrays_back_and_leaves_other_faults_alone():
    """Arrays are copied into the guarded mappings and back: the output arrives, a write into
    an input shows in the caller's array; a launch without the guard still runs."""
    good = _kernel(ROW + _SUM + "    y[row] = acc;")
    _, y = _launch(good)
    np.testing.assert_allclose(y, M @ np.ones(M.shape[1], np.float32), rtol=1e-6)
    k = simt.compile_kernel(_kernel(ROW + _SUM + "    y[row] = acc;\n    if (row == 0) { ((float*)&x[0])[1] = 7.0f; }"))
    args, y = _args()
    k.launch(M.shape[0] // 128 + 1, 128, 0, args)
    assert args[5][1] == 7.0
    args, y = _args()
    k.launch(M.shape[0] // 128 + 1, 128, 0, args, guard=False)
    assert not np.isnan(y).any()


def test_two_threads_adding_into_one_output_element_is_a_race():
    body = ("    int t = blockIdx.x * blockDim.x + threadIdx.x;\n    int row = t / 2;\n    if (row >= n_rows) return;\n"
            "    float acc = 0.0f;\n"
            "    for (int k = row_ptr[row] + t % 2; k < row_ptr[row + 1]; k += 2) acc += vals[k] * x[col_idx[k]];\n"
            "    y[row] += acc;")
    src = _kernel(body, "// launch block=128 work=rows per_block=64 zero_output=1\n")
    with pytest.raises(simt.GlobalMemoryRace) as e:
        _launch(src)
    assert e.value.array == "y" and e.value.index == 0 and "atomicAdd" in str(e.value)
    atomic = src.replace("y[row] += acc;", "atomicAdd(&y[row], acc);")
    k = simt.compile_kernel(atomic)
    args, y = _args()
    y[:] = 0
    k.launch(k.header.launch.grid({"n_rows": M.shape[0]}), 128, 0, args)
    np.testing.assert_allclose(y, M @ np.ones(M.shape[1], np.float32), rtol=1e-5)


def test_writes_of_one_output_element_ordered_by_a_barrier_are_not_a_race():
    body = ("    int row = blockIdx.x;\n    if (threadIdx.x == 0) y[row] = 0.0f;\n    __syncthreads();\n"
            "    if (threadIdx.x == 1) y[row] = 1.0f;")
    src = _kernel(body, "// launch block=32 work=rows per_block=1\n")
    _, y = _launch(src, block=32)
    assert (y == 1.0).all()
    unordered = src.replace("    __syncthreads();\n", "")
    with pytest.raises(simt.GlobalMemoryRace):
        _launch(unordered, block=32)
