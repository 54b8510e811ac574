"""guarded: where arrays sit in their regions, the fill around them, and the driver calls that
map a region between unmapped guard ranges (the calls checked against a stand-in driver here;
the real mapping and its illegal-address faults in the ``gpu``-marked test)."""

from __future__ import annotations

import types

import pytest
import torch

from sparserl_compile import guarded


def test_placement_puts_arrays_at_the_start_or_aligned_at_the_end():
    assert guarded.placed_offset(0, 4096, 100, 0) == 0
    assert guarded.placed_offset(0, 4096, 100, 1) == 3984  # 16-aligned, 12 bytes of fill after it
    assert guarded.placed_offset(0, 4096, 4096, 1) == 0
    assert guarded.placed_offset(64, 4160, 4096, 1) == 64
    assert guarded.placed_offset(0, 4096, 0, 1) == 4096  # empty: any access is past its end
    with pytest.raises(ValueError, match="does not fit"):
        guarded.placed_offset(0, 4096, 4097, 0)
    with pytest.raises(ValueError, match="placement"):
        guarded.placed_offset(0, 4096, 16, 2)


@pytest.mark.parametrize("placement", [0, 1])
def test_regions_on_cpu_tensors_find_a_write_beside_the_array(placement):
    regs = guarded.Regions(torch, "cpu")
    assert regs.mode == "zones"
    data = torch.arange(10, dtype=torch.float32)
    r = regs.region("x", 40)
    v = r.place(torch, torch.float32, (10,), placement, data)
    assert torch.equal(v, data) and v.data_ptr() % 16 == 0
    assert regs.outside_ok() is None
    # every byte around the array is the fill: NaN to a float kernel that reads there
    behind = r.pages[r.offset + 40:r.offset + 44].view(torch.float32)
    assert bool(torch.isnan(behind).all()) or placement == 1 and r.offset + 40 == r.pages.numel()
    r.pages[r.offset + 40 + 4 * 7] = 0  # a write 8 elements past the end
    name, off = regs.outside_ok()
    assert name == "x" and off == 40 + 28
    v = r.place(torch, torch.float32, (10,), placement, data)  # placing again refills
    assert regs.outside_ok() is None
    r.pages[r.offset - 1] = 3  # one byte before it
    assert regs.outside_ok() == ("x", -1)
    regs.close()


def test_a_region_grows_for_a_wider_array_and_keeps_its_size_for_narrower_ones():
    regs = guarded.Regions(torch, "cpu")
    big = regs.region("y", 4000)
    assert regs.region("y", 100) is big
    bigger = regs.region("y", 10_000)
    assert bigger is not big and bigger.hi - bigger.lo >= 10_000
    v = bigger.place(torch, torch.float16, (3, 7), 1)
    assert v.shape == (3, 7) and v.dtype == torch.float16
    assert bigger.offset + 42 <= bigger.hi and bigger.hi - (bigger.offset + 42) < 16


class _FakeDriver:
    """The few cuda.bindings.driver names ``_vmm_map`` uses, recording the calls."""

    def __init__(self, fail_at: str | None = None):
        self.calls: list[tuple] = []
        self.fail_at = fail_at
        ok = types.SimpleNamespace(CUDA_SUCCESS=0)
        self.CUresult = ok
        self.CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
        self.CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device")
        self.CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM="min")
        self.CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")

    @staticmethod
    def _struct():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    CUmemAllocationProp = _struct
    CUmemAccessDesc = _struct

    def cuMemGetAllocationGranularity(self, prop, flag):
        self.calls.append(("granularity", prop.location.id, flag))
        return (0, 2 << 20)

    def cuMemAddressReserve(self, size, align, addr, flags):
        self.calls.append(("reserve", size, align))
        return (1,) if self.fail_at == "reserve" else (0, 0x7F0000000000)

    def cuMemCreate(self, size, prop, flags):
        self.calls.append(("create", size, prop.type))
        return (1,) if self.fail_at == "create" else (0, "handle")

    def cuMemMap(self, ptr, size, offset, handle, flags):
        self.calls.append(("map", ptr, size, handle))
        return (1,) if self.fail_at == "map" else (0,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        self.calls.append(("access", ptr, size, descs[0].flags, count))
        return (0,)

    def cuMemUnmap(self, ptr, size):
        self.calls.append(("unmap", ptr, size))
        return (0,)

    def cuMemRelease(self, handle):
        self.calls.append(("release", handle))
        return (0,)

    def cuMemAddressFree(self, ptr, size):
        self.calls.append(("free", ptr, size))
        return (0,)


def _with_driver(monkeypatch, fake):
    import sys

    pkg = types.ModuleType("cuda.bindings")
    pkg.driver = fake
    monkeypatch.setitem(sys.modules, "cuda.bindings", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)


def test_a_mapping_is_reserved_with_unmapped_guards_on_both_sides(monkeypatch):
    fake = _FakeDriver()
    _with_driver(monkeypatch, fake)
    m = guarded._vmm_map(3, 5 << 20)  # 5 MiB: three 2 MiB pages
    g = guarded.GUARD_BYTES
    assert g == 2**31 * 16  # any int32 index times a 16-byte vector
    assert m.size == 6 << 20 and m.total == 2 * g + m.size
    names = [c[0] for c in fake.calls]
    assert names == ["granularity", "reserve", "create", "map", "access"]
    assert fake.calls[0][1] == 3 and fake.calls[1][1] == m.total
    assert fake.calls[3][1] == 0x7F0000000000 + g and fake.calls[3][2] == m.size  # pages in the middle only
    assert fake.calls[4][1:] == (0x7F0000000000 + g, m.size, "rw", 1)
    fake.calls.clear()
    guarded._vmm_unmap(m)
    assert [c[0] for c in fake.calls] == ["unmap", "release", "free"]
    assert fake.calls[2][1:] == (0x7F0000000000, m.total)


def test_a_failed_mapping_releases_what_it_took(monkeypatch):
    fake = _FakeDriver(fail_at="map")
    _with_driver(monkeypatch, fake)
    with pytest.raises(RuntimeError, match="cuMemMap"):
        guarded._vmm_map(0, 100)
    assert [c[0] for c in fake.calls][-3:] == ["unmap", "release", "free"]


@pytest.mark.gpu
def test_vmm_regions_fault_on_an_access_past_the_array():
    """Run in a child process: the illegal address ends its CUDA context."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from sparserl_compile import guarded\n"
        "regs = guarded.Regions(torch, 'cuda')\n"
        "assert regs.mode == 'vmm', regs.reason\n"
        "r = regs.region('x', 1000)\n"
        "v = r.place(torch, torch.float32, (250,), 1, torch.ones(250, device='cuda'))\n"
        "assert float(v.sum()) == 250.0 and regs.outside_ok() is None\n"
        # a view from the array's first byte on (torch checks only where a view starts, which
        # must be mapped) into the unmapped guard past its end
        "past = torch.as_tensor(guarded._Iface(v.data_ptr(), 1000 + 4096), device='cuda')\n"
        "past.fill_(1)\n"
        "torch.cuda.synchronize()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "illegal" in res.stderr.lower(), res.stderr[-2000:]
