"""Device memory for verification runs in which any address a kernel can form faults or shows.

Each array a kernel under verification sees (its structure arrays, values, ``x`` and ``y``)
lives in a *region* of its own. Where CUDA virtual memory management is available
(``cuda.bindings.driver``: ``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``,
``cuMemSetAccess``), a region is ``GUARD_BYTES`` of reserved, unmapped address space, the
array's pages, and ``GUARD_BYTES`` more: any access up to an int32 index times a 16-byte vector
past either end reaches unmapped memory and stops the kernel with an illegal-address error
(the sandbox worker is replaced). Elsewhere (the driver API missing or refusing) a region is
a plain allocation with ``ZONE_BYTES`` of fill on each side, and ``mode`` says so
(``"zones"``): accesses beyond the zones are not detected.

Within a region the array sits at the start of its pages (``placement=0``: one byte before
it is unmapped) or at their end, 16-byte aligned (``placement=1``: the first byte past it is
unmapped, or lies in fewer than 16 bytes of fill); verification runs both. Every byte of the
region outside the array holds 0xFF (NaN for each float type, -1 for int32): a kernel that
reads there gets NaN or an index that fails elsewhere, and ``outside_ok`` finds any write.

``Regions`` works on CPU tensors too (always ``"zones"``): the layout and fill checks are
tested there; the driver calls need a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

#: unmapped address space on each side of a region: any int32 index times a 16-byte vector
GUARD_BYTES = 2**31 * 16
#: fill on each side of an array where virtual memory management is unavailable
ZONE_BYTES = 1 << 20
#: the fill byte around every array
FILL = 0xFF


def placed_offset(lo: int, hi: int, nbytes: int, placement: int) -> int:
    """Byte offset of an ``nbytes`` array in the usable span ``[lo, hi)`` of a region: ``lo``
    (placement 0), or the highest 16-byte-aligned offset that fits (placement 1)."""
    if placement not in (0, 1):
        raise ValueError(f"placement={placement!r}: 0 (start of the region) or 1 (its end)")
    if nbytes > hi - lo:
        raise ValueError(f"an array of {nbytes} bytes does not fit a region of {hi - lo} bytes")
    return lo if placement == 0 else lo + ((hi - lo - nbytes) & ~15)


def _check(result, what: str):
    from cuda.bindings import driver as cu

    err = result[0]
    if int(err) != int(cu.CUresult.CUDA_SUCCESS):
        raise RuntimeError(f"{what} failed: {err}")
    rest = result[1:]
    return rest[0] if len(rest) == 1 else None


class _Iface:
    """A device byte range in the CUDA array interface, for ``torch.as_tensor`` (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False),
                                         "version": 2}


@dataclass
class _Mapping:
    va: int
    total: int
    size: int
    handle: object


def _vmm_map(device: int, nbytes: int) -> _Mapping:
    """Reserve ``GUARD_BYTES`` + pages + ``GUARD_BYTES`` of address space on ``device`` and map
    the pages (at least ``nbytes`` + 1) in the middle, readable and writable."""
    from cuda.bindings import driver as cu

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device)
    gran = int(_check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity"))
    size = -(-(int(nbytes) + 1) // gran) * gran
    total = 2 * GUARD_BYTES + size
    va = int(_check(cu.cuMemAddressReserve(total, gran, 0, 0), "cuMemAddressReserve"))
    handle = None
    try:
        handle = _check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        _check(cu.cuMemMap(va + GUARD_BYTES, size, 0, handle, 0), "cuMemMap")
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(device)
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(va + GUARD_BYTES, size, [desc], 1), "cuMemSetAccess")
    except Exception:
        _vmm_unmap(_Mapping(va, total, size, handle))
        raise
    return _Mapping(va, total, size, handle)


def _vmm_unmap(m: _Mapping) -> None:
    from cuda.bindings import driver as cu

    if m.handle is not None:
        cu.cuMemUnmap(m.va + GUARD_BYTES, m.size)
        cu.cuMemRelease(m.handle)
    cu.cuMemAddressFree(m.va, m.total)


class Region:
    """One array's region: ``pages`` (uint8 tensor, everything the kernel can reach without a
    fault) and the span ``[lo, hi)`` of it that may hold the array."""

    def __init__(self, pages, lo: int, hi: int, mapping: _Mapping | None = None):
        self.pages, self.lo, self.hi, self.mapping = pages, lo, hi, mapping
        self.offset, self.nbytes = lo, 0

    def place(self, torch, dtype, shape, placement: int, data=None):
        """A tensor of ``dtype``/``shape`` at ``placement`` in this region, every other byte
        filled with ``FILL``; ``data`` (a tensor of the same element count) is copied in."""
        numel = 1
        for s in shape:
            numel *= int(s)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        off = placed_offset(self.lo, self.hi, nbytes, placement)
        self.pages.fill_(FILL)
        self.offset, self.nbytes = off, nbytes
        view = self.pages[off:off + nbytes].view(dtype).view(*shape) if nbytes else \
            self.pages[off:off].view(dtype).view(*shape)
        if data is not None:
            view.copy_(data.reshape(view.shape))
        return view

    def outside_ok(self) -> int | None:
        """None when every byte outside the placed array still holds ``FILL``, else the byte
        offset (from the array's start) of the first one that does not."""
        before = self.pages[:self.offset]
        after = self.pages[self.offset + self.nbytes:]
        for part, base in ((before, 0), (after, self.offset + self.nbytes)):
            if part.numel() and not bool((part == FILL).all()):
                first = int((part != FILL).nonzero()[0, 0])
                return base + first - self.offset
        return None


#: device index -> (mode, reason) of the first ``Regions`` there
_PROBED: dict[int, tuple[str, str]] = {}


class Regions:
    """The regions of one runner, by array name, on ``device`` ("cuda:i" or "cpu")."""

    def __init__(self, torch, device, *, use_vmm: bool | None = None):
        self.torch, self.device = torch, torch.device(device)
        self._regions: dict[str, Region] = {}
        self.mode, self.reason = "zones", "CPU tensors"
        if self.device.type == "cuda" and use_vmm is not False:
            self.mode, self.reason = self._probe()

    def _probe(self) -> tuple[str, str]:
        """Whether this process can map guarded regions on the device (tried once per device)."""
        dev = self._index()
        if dev not in _PROBED:
            try:
                _vmm_unmap(_vmm_map(dev, 1))
            except Exception as e:  # noqa: BLE001 - the driver API missing, old or refusing
                _PROBED[dev] = ("zones", f"CUDA virtual memory management unavailable ({type(e).__name__}: "
                                         f"{str(e)[:160]}); {ZONE_BYTES >> 10} KiB of fill on each side of every array")
            else:
                _PROBED[dev] = ("vmm", f"{GUARD_BYTES >> 30} GiB unmapped on each side of every array")
        return _PROBED[dev]

    def _index(self) -> int:
        return self.device.index if self.device.index is not None else self.torch.cuda.current_device()

    def region(self, name: str, capacity: int) -> Region:
        """The region for array ``name``, holding at least ``capacity`` bytes (made on first use)."""
        r = self._regions.get(name)
        if r is not None and r.hi - r.lo >= capacity:
            return r
        if r is not None:
            self._free(r)
        torch = self.torch
        if self.mode == "vmm":
            m = _vmm_map(self._index(), capacity)
            pages = torch.as_tensor(_Iface(m.va + GUARD_BYTES, m.size), device=self.device)
            r = Region(pages, 0, m.size, m)
        else:
            span = -(-(capacity + 1) // 256) * 256
            pages = torch.empty(span + 2 * ZONE_BYTES, dtype=torch.uint8, device=self.device)
            r = Region(pages, ZONE_BYTES, ZONE_BYTES + span)
        self._regions[name] = r
        return r

    def outside_ok(self) -> tuple[str, int] | None:
        """None when no region has a byte changed outside its array, else (name, offset)."""
        for name, r in self._regions.items():
            off = r.outside_ok()
            if off is not None:
                return name, off
        return None

    def _free(self, r: Region) -> None:
        r.pages = None
        if r.mapping is not None:
            self.torch.cuda.synchronize(self.device)
            _vmm_unmap(r.mapping)
            r.mapping = None

    def close(self) -> None:
        """Unmap every region (after the device finished with them)."""
        for r in self._regions.values():
            try:
                self._free(r)
            except Exception:  # noqa: BLE001 - a context an illegal address left unusable
                pass
        self._regions.clear()

    def __del__(self):
        self.close()
