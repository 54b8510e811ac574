"""Verification operands: the value sets a candidate kernel runs on, their float64 references
and the per-output error bound. ``verify.py`` runs kernels on them and applies the checks.

A pattern is verified on several *value sets* (values of the matrix and a dense ``x``), built
once per pattern and shared by every candidate of it:

* random sets (``key`` 0, 1, ...): magnitudes uniform in [0.5, 1.5) with random signs, never
  zero: well conditioned, for the error bound;
* ``"ranges"``: what a kernel tuned to the random sets could get wrong. ``x`` mixes exact
  zeros (either sign), values below 0.25, large values (2^100 in f32/bf16, 2^14..2^15 in f16)
  and subnormal-range ones; each row of the matrix has a regime (a mix of those, all values
  below 0.25, all subnormal, all zero, or plain), so a kernel that clamps ``x``, skips small
  values or flushes tiny ones is wrong on whole rows. Each row's values are then scaled by a
  power of two so that ``sum_j |a_ij x_j|`` stays below ``ROW_LIMIT``: a correct kernel never
  overflows, however large the terms;
* ``"nonfinite"``: plain values with NaN, +inf and -inf in ``x`` and in the matrix values (and
  exact zeros, so 0 * inf occurs), about half the outputs touching one. The float64 reference
  says where NaN and +-inf must come out.

The error bound (``error_bound``) per output ``i`` with row length ``len_i``::

    2 gamma(len_i + 1) sum_j |a_ij x_j| + u_out |ref_i| + (len_i + 2) 2^-149 + eta_out

``gamma(k) = k u / (1 - k u)`` with ``u = 2^-24`` (float accumulation), ``u_out`` half an ulp
of the output type (0 for f32), ``2^-149`` per operation for roundings in float's subnormal
range (the standard model's absolute term) and ``eta_out`` half the output type's smallest
subnormal (its rounding there). It is relative to ``sum_j |a_ij x_j|``, so rows that mix
huge and tiny terms are bounded by the huge ones, and rows of tiny terms by the tiny ones.

Operands are drawn where the kernel runs: on the host for the CPU executor (numpy storage
arrays, scipy reference), on the GPU for the GPU executor (torch tensors, torch.sparse
reference in float64), so a GPU verification moves no operand between host and device. The
special sets are drawn by torch on either device (the CPU executor converts them to numpy).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from sparserl_compile import contract

#: unit roundoff of float accumulation
U_F32 = 2.0**-24
#: half an ulp (relative) of the output type
U_OUT = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}
#: absolute error of one float operation in the subnormal range (generous: a whole subnormal step)
ETA_F32 = 2.0**-149
#: half the smallest subnormal of the output type (the rounding of a tiny result to it)
ETA_OUT = {"f32": 0.0, "f16": 2.0**-25, "bf16": 2.0**-134}
#: the special value sets, after the random ones
SPECIAL = ("ranges", "nonfinite")
#: per dtype: a large magnitude, a subnormal-range magnitude, and the most a row's
#: sum |a_ij x_j| may reach (values are scaled down by powers of two below it)
LARGE = {"f32": 2.0**100, "f16": 2.0**14, "bf16": 2.0**100}
TINY = {"f32": 2.0**-140, "f16": 2.0**-20, "bf16": 2.0**-130}
ROW_LIMIT = {"f32": 2.0**120, "f16": 2.0**15, "bf16": 2.0**120}


def to_dtype(a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(array in the kernel's storage type, its exact float64 value).

    bf16 has no numpy type: it is stored as uint16 bit patterns (rounded to nearest even).
    """
    if dtype == "f32":
        s = a.astype(np.float32)
        return s, s.astype(np.float64)
    if dtype == "f16":
        s = a.astype(np.float16)
        return s, s.astype(np.float64)
    if dtype == "bf16":
        bits = a.astype(np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        s = rounded.astype(np.uint16)
        return s, from_storage(s, "bf16")
    raise ValueError(f"dtype={dtype!r}; expected one of {tuple(contract.DTYPES)}")


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """Kernel storage array (as returned by ``to_dtype``) -> float64."""
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def error_bound(lengths, absref, ref, dtype: str):
    """Per-output allowed error (module docstring); shapes of ``ref``. numpy arrays, or tensors
    (the GPU executor computes it where its outputs are), in float64."""
    n = lengths.double() if hasattr(lengths, "double") else lengths.astype(np.float64)
    k = (n + 1.0) * U_F32
    gamma = k / (1.0 - k).clip(min=1e-3)
    eta = (n + 2.0) * ETA_F32 + ETA_OUT[dtype]
    if ref.ndim == 2:
        gamma, eta = gamma[:, None], eta[:, None]
    return 2.0 * gamma * absref + U_OUT[dtype] * abs(ref) + eta


def _random_operand(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 values of magnitude uniform in [0.5, 1.5) (23 random bits: exact in float32) and
    random sign, from one draw of 32 random bits per value, computed in float32. Drawing float64
    magnitudes and signs apart took ~8 s per 10^6 x 256 operand on the H200's host, most of a
    new 10^7-nonzero structure's first call; this is 7.5x faster on the development CPU."""
    bits = rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
    out = (bits >> np.uint32(9)).astype(np.float32)
    out *= np.float32(2.0 ** -23)
    out += np.float32(0.5)
    np.negative(out, out=out, where=(bits & np.uint32(1)).astype(bool))
    return out


def _torch_operand(torch, numel: int, seed: int, device: str):
    """``_random_operand``'s distribution drawn by torch on ``device`` (Philox on CUDA): float32
    magnitudes uniform in [0.5, 1.5) on a 2^-23 grid, random sign. Drawing a 10^6 x 256 operand
    on the H200's host and uploading it took seconds per value set (22 s of a 10^7-nonzero
    graph's first call for three sets); on the GPU it takes milliseconds."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    bits = torch.randint(0, 1 << 24, (int(numel),), dtype=torch.int32, device=device, generator=g)
    out = (bits >> 1).to(torch.float32).mul_(2.0 ** -23).add_(0.5)
    return torch.where((bits & 1).bool(), -out, out)


# ------------------------------------------------------------------ the special sets

def _seeds(seed: int, key) -> list[int]:
    tag = key if isinstance(key, int) else 1000 + SPECIAL.index(key)
    return [int(s) for s in np.random.SeedSequence([seed, tag]).generate_state(4, np.uint64) >> np.uint64(1)]


class _Numpy:
    """The few array operations the special sets need, on the host (numpy, scipy)."""

    def __init__(self, seed: int, p, dtype: str):
        self.rng, self.p, self.dtype = np.random.default_rng(seed), p, dtype
        self.where, self.exp2, self.ceil, self.log2 = np.where, np.exp2, np.ceil, np.log2

    def rand(self, n: int):
        return self.rng.random(int(n))

    def randint(self, hi: int, n: int):
        return self.rng.integers(0, hi, int(n))

    def full(self, n: int, v: float):
        return np.full(int(n), v)

    def rows(self):
        return np.repeat(np.arange(self.p.shape[0]), np.diff(self.p.indptr))

    def rounded(self, a):
        return to_dtype(a, self.dtype)[1]

    def row_absmax(self, vals, x):
        """max over columns of sum_j |a_ij x_j| per row (float64)."""
        a = sp.csr_matrix((np.abs(vals), self.p.indices, self.p.indptr), shape=self.p.shape)
        out = a @ np.abs(x)
        return out.max(axis=1, initial=0.0) if out.ndim == 2 else out


class _Torch:
    """The same operations with torch on ``device`` (the GPU executor draws where it runs)."""

    def __init__(self, torch, seed: int, p, dtype: str, device):
        self.t, self.p, self.dtype, self.device = torch, p, dtype, device
        self.g = torch.Generator(device=device)
        self.g.manual_seed(int(seed))
        self.where, self.exp2, self.ceil, self.log2 = torch.where, torch.exp2, torch.ceil, torch.log2

    def rand(self, n: int):
        return self.t.rand(int(n), generator=self.g, device=self.device, dtype=self.t.float64)

    def randint(self, hi: int, n: int):
        return self.t.randint(0, hi, (int(n),), generator=self.g, device=self.device)

    def full(self, n: int, v: float):
        return self.t.full((int(n),), v, dtype=self.t.float64, device=self.device)

    def rows(self):
        lengths = self.t.from_numpy(np.diff(self.p.indptr).astype(np.int64)).to(self.device)
        return self.t.repeat_interleave(self.t.arange(self.p.shape[0], device=self.device), lengths)

    def rounded(self, a):
        return a.to(getattr(self.t, contract.TORCH_NAMES[self.dtype])).double()

    def row_absmax(self, vals, x):
        out = _product(self.t, _csr64(self.t, self.p, vals.abs(), self.device), x.abs())
        if out.dim() == 1:
            return out
        return out.amax(dim=1) if out.shape[1] else out.sum(dim=1)


def _categories(B, n: int, parts):
    """float64 values with random sign whose magnitude is chosen per element by category:
    ``parts`` is (probability, kind) in order, the rest "plain" ([0.5, 1.5)); kinds "zero",
    "small" (below 0.25), "large", "tiny" (``LARGE``/``TINY`` of the dtype times [1, 2)),
    "nan", "inf", "-inf" (signs as named)."""
    u, m, sgn = B.rand(n), B.rand(n), B.rand(n)
    large, tiny = LARGE[B.dtype], TINY[B.dtype]
    out = 0.5 + m
    lo = 0.0
    for prob, kind in parts:
        sel = (u >= lo) & (u < lo + prob)
        lo += prob
        mag = {"zero": 0.0 * m, "small": 0.25 * m, "large": (1.0 + m) * large, "tiny": (1.0 + m) * tiny}.get(kind)
        if mag is None:
            mag = B.full(n, {"nan": float("nan"), "inf": float("inf"), "-inf": float("inf")}[kind])
        out = B.where(sel, mag, out)
    out = B.where(sgn < 0.5, -out, out)
    lo = 0.0
    for prob, kind in parts:  # the named signs of the non-finite kinds
        sel = (u >= lo) & (u < lo + prob)
        lo += prob
        if kind in ("inf", "-inf"):
            out = B.where(sel, B.full(n, float(kind)), out)
    return out


def _special(B, key: str, x_shape):
    """(vals, x flat) of special set ``key``, float64 values of the storage type."""
    p = B.p
    nnz, n_x = p.nnz, int(np.prod(x_shape))
    if key == "ranges":
        x = B.rounded(_categories(B, n_x, [(0.10, "zero"), (0.15, "large"), (0.10, "small"), (0.07, "tiny")]))
        mixed = _categories(B, nnz, [(0.10, "zero"), (0.25, "small"), (0.10, "large")])
        regime = B.randint(10, p.shape[0])[B.rows()] if nnz else B.randint(10, 0)
        # per row: 0-3 mixed, 4-5 all subnormal-range, 6-7 all below 0.25, 8 all zero, 9 plain
        u = B.rand(nnz)
        vals = B.where(regime < 4, mixed, 0.5 + u)
        vals = B.where((regime == 4) | (regime == 5), (1.0 + u) * TINY[B.dtype], vals)
        vals = B.where((regime == 6) | (regime == 7), 0.25 * u, vals)
        vals = B.where(regime == 8, 0.0 * u, vals)
        vals = B.rounded(B.where(B.rand(nnz) < 0.5, -vals, vals))
        if nnz:  # each row scaled by a power of two: sum_j |a_ij x_j| <= ROW_LIMIT / 2
            worst = B.row_absmax(vals, x.reshape(x_shape))
            k = B.ceil(B.log2(B.where(worst > 0, worst, 1.0) / (ROW_LIMIT[B.dtype] / 2)))
            k = B.where(k > 0, k, 0.0 * k)
            vals = B.rounded(vals * B.exp2(-k)[B.rows()])
        return vals, x
    if key == "nonfinite":
        frac = min(0.2, 0.35 * max(p.shape[0], 1) / max(nnz, 1))  # ~0.35 non-finite terms per row from each side
        parts = [(frac / 3, "nan"), (frac / 3, "inf"), (frac / 3, "-inf"), (0.1, "zero")]
        return B.rounded(_categories(B, nnz, parts)), B.rounded(_categories(B, n_x, parts))
    raise ValueError(f"value set {key!r}; the special sets are {SPECIAL}")


def special_operands(torch, key: str, p, x_shape, dtype: str, seed: int, device):
    """(vals, x flat) of special set ``key`` as tensors of the kernel's storage type on
    ``device`` (module docstring): the GPU executor's."""
    vals, x = _special(_Torch(torch, _seeds(seed, key)[0], p, dtype, device), key, x_shape)
    st = getattr(torch, contract.TORCH_NAMES[dtype])
    return vals.to(st), x.to(st)


def special_host_operands(key: str, p, x_shape, dtype: str, seed: int):
    """(vals, x) of special set ``key`` as the CPU executor's storage arrays (``to_dtype``)."""
    vals, x = _special(_Numpy(_seeds(seed, key)[0], p, dtype), key, x_shape)
    return to_dtype(vals, dtype)[0], to_dtype(x, dtype)[0].reshape(x_shape)


def _csr64(torch, p, values, device):
    from sparserl_compile.bench import csr_tensor

    ip = torch.from_numpy(p.indptr.astype(np.int64)).to(device)
    ix = torch.from_numpy(p.indices.astype(np.int64)).to(device)
    return csr_tensor(torch, ip, ix, values, p.shape)


def _product(torch, a, x):
    return torch.mv(a, x) if x.dim() == 1 else torch.mm(a, x)


# ------------------------------------------------------------------ references

def host_reference(p, vals64: np.ndarray, x64: np.ndarray):
    """(A @ x, |A| @ |x|) in float64 by scipy (IEEE: NaN and inf propagate as in any sum)."""
    a = sp.csr_matrix((vals64, p.indices, p.indptr), shape=p.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        return a @ x64, abs(a) @ np.abs(x64)


def storage_tensor(torch, a: np.ndarray, dtype: str, device: str = "cuda"):
    """A kernel storage array (``to_dtype``) as a tensor of the kernel's type."""
    t = torch.from_numpy(np.ascontiguousarray(a.view(np.int16) if dtype == "bf16" else a)).to(device)
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def as_storage(torch, a, dtype: str, device: str = "cuda"):
    """A storage array as a tensor on ``device``; a tensor (already there) as it is."""
    return a if isinstance(a, torch.Tensor) else storage_tensor(torch, a, dtype, device)


def device_reference(torch, p, vals, x, dtype: str, device: str = "cuda"):
    """(A @ x, |A| @ |x|) in float64 on ``device`` from the dtype-rounded operands (storage
    arrays, or tensors already on ``device``)."""
    if p.nnz == 0 or 0 in p.shape:
        raise RuntimeError("empty pattern: use the host reference")
    v64 = as_storage(torch, vals, dtype, device).double()
    x64 = as_storage(torch, x, dtype, device).double()
    return _product(torch, _csr64(torch, p, v64, device), x64), \
        _product(torch, _csr64(torch, p, v64.abs(), device), x64.abs())


def host_reference_of_tensors(torch, p, vals, x, dtype: str, device: str):
    """``host_reference`` of tensor operands (patterns torch.sparse cannot take, e.g. empty
    ones), as tensors on ``device``."""
    v64 = vals.detach().to("cpu", torch.float64).numpy()
    x64 = x.detach().to("cpu", torch.float64).numpy()
    ref, absref = host_reference(p, v64, x64)
    return (torch.from_numpy(np.ascontiguousarray(ref)).to(device),
            torch.from_numpy(np.ascontiguousarray(absref)).to(device))


# ------------------------------------------------------------------ value sets, shared per pattern

class ValueSet:
    """One value set's operands, shared by every candidate of a pattern, and its float64
    reference, error bound and cuSPARSE result, each built on first use: for the CPU executor
    on the host (numpy storage arrays, scipy reference: ``host``), for the GPU executor on the
    GPU (operands drawn there by torch, float64 reference by torch.sparse: ``device``). The two
    executors draw different values from the same seed; each is checked against a reference of
    its own. ``key``: an int (a random set) or one of ``SPECIAL``."""

    __slots__ = ("p", "lengths", "x_shape", "dtype", "seed", "key", "_vals", "_x", "_host", "_device",
                 "_operands", "cusparse")

    def __init__(self, p, lengths, x_shape, dtype: str, seed: int, key):
        if dtype not in contract.TORCH_NAMES:
            raise ValueError(f"dtype={dtype!r}; expected one of {tuple(contract.DTYPES)}")
        if not isinstance(key, int) and key not in SPECIAL:
            raise ValueError(f"value set {key!r}: an int (a random set) or one of {SPECIAL}")
        self.p, self.lengths, self.x_shape, self.dtype = p, lengths, tuple(x_shape), dtype
        self.seed, self.key = seed, key
        self._vals = self._x = self._host = self._device = self._operands = None
        self.cusparse = None  # filled by the first GPU candidate that compares

    @property
    def special(self) -> bool:
        return not isinstance(self.key, int)

    def _host_operands(self):
        if self._vals is None:
            if self.special:
                self._vals, self._x = special_host_operands(self.key, self.p, self.x_shape, self.dtype, self.seed)
            else:
                rng = np.random.default_rng([self.seed, self.key])
                self._vals = to_dtype(_random_operand(rng, self.p.nnz), self.dtype)[0]
                self._x = to_dtype(_random_operand(rng, self.x_shape), self.dtype)[0]
        return self._vals, self._x

    @property
    def vals(self) -> np.ndarray:
        """The host operands (storage arrays, ``to_dtype``) of the CPU executor."""
        return self._host_operands()[0]

    @property
    def x(self) -> np.ndarray:
        return self._host_operands()[1]

    def device_operands(self, device: str = "cuda"):
        """(vals, x flat) as tensors of the kernel's storage type on ``device``, drawn there once
        and read by every candidate's runs. A run that writes into them is failed by the input
        check and calls ``drop_device_operands``; the next run draws them again, the same values
        from the same seed, so the reference stays valid."""
        if self._operands is None:
            import torch

            if self.special:
                self._operands = special_operands(torch, self.key, self.p, self.x_shape, self.dtype,
                                                  self.seed, device)
            else:
                st = getattr(torch, contract.TORCH_NAMES[self.dtype])
                seeds = _seeds(self.seed, self.key)
                n_x = int(np.prod(self.x_shape))
                self._operands = (_torch_operand(torch, self.p.nnz, seeds[0], device).to(st),
                                  _torch_operand(torch, n_x, seeds[1], device).to(st))
        return self._operands

    def drop_device_operands(self) -> None:
        self._operands = None

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ref, absref, bound), float64 numpy arrays, by scipy from the dtype-rounded inputs."""
        if self._host is None:
            vals, x = self._host_operands()
            ref, absref = host_reference(self.p, from_storage(vals, self.dtype), from_storage(x, self.dtype))
            with np.errstate(invalid="ignore", over="ignore"):  # the non-finite set's rows
                self._host = (ref, absref, error_bound(self.lengths, absref, ref, self.dtype))
        return self._host

    def device(self, device: str = "cuda"):
        """(ref, absref, bound) as tensors on ``device``: ref and bound float64 (ref by
        torch.sparse CSR in float64 from ``device_operands``, i.e. cuSPARSE, whose error is
        ~1e-16 relative, far below the float32 bound), absref float32 (it only scales the
        reported relative error). Where torch.sparse cannot (empty patterns), the reference is
        computed on the host from the same operands and uploaded."""
        if self._device is None:
            import torch

            vals, x = self.device_operands(device)
            x = x.reshape(self.x_shape)
            try:
                ref, absref = device_reference(torch, self.p, vals, x, self.dtype, device)
            except RuntimeError:
                ref, absref = host_reference_of_tensors(torch, self.p, vals, x, self.dtype, device)
            bound = error_bound(torch.from_numpy(self.lengths).to(device), absref, ref, self.dtype)
            self._device = (ref, absref.float(), bound)
        return self._device


#: (pattern, dtype, x shape, seed) of the cached value sets, and the sets by key. A search
#: verifies tens of candidates on one pattern in one worker; building the operands and the
#: float64 reference once instead of per candidate is most of the cost on large matrices.
_VALUE_SETS: dict = {"key": None, "pattern": None, "sets": {}}


def clear_value_sets() -> None:
    """Drop the cached value sets (the sandbox worker does when its pattern changes)."""
    _VALUE_SETS.update(key=None, pattern=None, sets={})


def value_set(p, lengths, x_shape, dtype: str, seed: int, key) -> ValueSet:
    """The cached ``ValueSet`` ``key`` of pattern ``p`` (a new pattern drops the others)."""
    cache_key = (id(p), id(p.indptr), id(p.indices), p.shape, dtype, tuple(x_shape), seed)
    if _VALUE_SETS["key"] != cache_key or _VALUE_SETS["pattern"] is not p:
        _VALUE_SETS.update(key=cache_key, pattern=p, sets={})
    sets = _VALUE_SETS["sets"]
    if key not in sets:
        sets[key] = ValueSet(p, lengths, x_shape, dtype, seed, key)
    return sets[key]
