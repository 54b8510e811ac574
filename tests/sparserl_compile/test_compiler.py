"""NVRTC compile, errors with numbered source, memory and disk caches, dumps."""

from __future__ import annotations

import os

import pytest

from sparserl_compile import compiler, kernels

GOOD = kernels.render("csr_scalar", "spmv", "f16", {"block": 128}).source
BAD = GOOD.replace("float acc = 0.0f;", "float acc = 0.0f\n    undeclared_thing += 1;")


@pytest.fixture(autouse=True)
def _fresh_memory():
    compiler.clear_memory_cache()
    yield
    compiler.clear_memory_cache()


def test_nvrtc_version_and_default_arch():
    major, minor = compiler.nvrtc_version()
    assert major >= 12 and minor >= 0
    assert compiler.default_arch().startswith("sm_")
    assert os.path.isfile(os.path.join(compiler.cuda_include_dir(), "cuda_fp16.h"))


def test_compile_returns_cubin_and_caches(_isolated_cache):
    r1 = compiler.compile_cubin(GOOD, "sm_90")
    assert r1.cubin[:4] == b"\x7fELF" and r1.arch == "sm_90" and r1.seconds > 0 and r1.cached == ""
    assert r1.nvrtc_version == compiler.nvrtc_version()
    r2 = compiler.compile_cubin(GOOD, "sm_90")
    assert r2.cached == "memory" and r2.cubin == r1.cubin and r2.seconds == 0.0
    compiler.clear_memory_cache()
    r3 = compiler.compile_cubin(GOOD, "sm_90")
    assert r3.cached == "disk" and r3.cubin == r1.cubin
    files = list((_isolated_cache / "cubin").iterdir())
    assert [f.name for f in files] == [f"{r1.key}.cubin"]
    # another arch is another key
    r4 = compiler.compile_cubin(GOOD, "sm_80")
    assert r4.key != r1.key and r4.cached == ""


def test_corrupt_disk_entry_is_a_miss(_isolated_cache):
    r1 = compiler.compile_cubin(GOOD, "sm_90")
    path = _isolated_cache / "cubin" / f"{r1.key}.cubin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    compiler.clear_memory_cache()
    r2 = compiler.compile_cubin(GOOD, "sm_90")
    assert r2.cached == "" and r2.cubin == r1.cubin  # recompiled, and the entry rewritten
    path.write_bytes(b"short")
    compiler.clear_memory_cache()
    assert compiler.compile_cubin(GOOD, "sm_90").cached == ""


def test_compile_error_carries_log_options_and_numbered_source():
    with pytest.raises(compiler.CompileError) as ei:
        compiler.compile_cubin(BAD, "sm_90")
    e = ei.value
    assert "undeclared_thing" in e.log or "expected" in e.log
    assert "--gpu-architecture=sm_90" not in e.options  # options are the user-visible ones
    assert "-std=c++17" in e.options and e.arch == "sm_90"
    numbered = e.numbered_source()
    lines = numbered.splitlines()
    assert lines[0].split()[0] == "1" and "#include <cuda_fp16.h>" in lines[0]
    bad_line = next(ln for ln in lines if "undeclared_thing" in ln)
    n = int(bad_line.split()[0])
    assert e.source.splitlines()[n - 1].strip() == "undeclared_thing += 1;"
    # the log cites a line of the numbered source
    assert f"({n})" in e.log or f"({n - 1})" in e.log
    assert "NVRTC could not compile" in str(e)


def test_wmma_header_only_when_used():
    assert "mma.h" not in compiler.full_source(GOOD)
    tc = kernels.render("bsr_wmma", "spmm", "f16", {"warps": 4}).source
    assert compiler.full_source(tc).startswith("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <mma.h>\n")


def test_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_DUMP_DIR", str(tmp_path))
    r = compiler.compile_cubin(GOOD, "sm_90")
    assert (tmp_path / f"{r.key}.cubin").read_bytes() == r.cubin
    assert (tmp_path / f"{r.key}.cu").read_text().endswith(GOOD)
    with pytest.raises(compiler.CompileError):
        compiler.compile_cubin(BAD, "sm_90")
    logs = [p for p in tmp_path.glob("*.log") if p.read_text()]
    assert logs, "the failing compile's log is dumped"


def test_bad_arch_is_refused():
    with pytest.raises(ValueError, match="sm_XY"):
        compiler.compile_cubin(GOOD, "hopper")


def test_precompile_fills_the_caches_and_counts_failures(_isolated_cache):
    good = [c.source for c in kernels.space("spmv", "f32") if "baked" not in c.family][:4]
    bad = "extern \"C\" __global__ void k(int *x) { this is not C; }"
    counts = compiler.precompile(good + [good[0], bad], arch="sm_90", workers=2)
    assert counts == {"compiled": 4, "cached": 0, "failed": 1}  # the duplicate compiled once
    compiler.clear_memory_cache()
    hits = [compiler.compile_cubin(s, arch="sm_90").cached for s in good]
    assert hits == ["disk"] * 4
    assert compiler.precompile(good, arch="sm_90", workers=1) == {"compiled": 0, "cached": 4, "failed": 0}


# ------------------------------------------------------------------ who may have written the disk cache

def _entry(cache, key):
    return cache / "cubin" / f"{key}.cubin"


def test_disk_entries_are_private_and_a_world_writable_one_is_never_served(_isolated_cache):
    r1 = compiler.compile_cubin(GOOD, "sm_90")
    path = _entry(_isolated_cache, r1.key)
    assert (path.stat().st_mode & 0o777) == 0o600 and ((_isolated_cache / "cubin").stat().st_mode & 0o777) == 0o700
    compiler.clear_memory_cache()
    path.chmod(0o666)  # anyone could have rewritten it
    assert compiler.compile_cubin(GOOD, "sm_90").cached == ""  # a miss: recompiled, rewritten 0600
    assert (path.stat().st_mode & 0o777) == 0o600
    compiler.clear_memory_cache()
    assert compiler.compile_cubin(GOOD, "sm_90").cached == "disk"


def test_a_symlinked_entry_is_never_followed(_isolated_cache, tmp_path):
    r1 = compiler.compile_cubin(GOOD, "sm_90")
    path = _entry(_isolated_cache, r1.key)
    planted = tmp_path / "planted.cubin"
    planted.write_bytes(path.read_bytes())  # a valid entry, somewhere else
    planted.chmod(0o600)
    path.unlink()
    path.symlink_to(planted)
    compiler.clear_memory_cache()
    assert compiler.compile_cubin(GOOD, "sm_90").cached == ""
    assert not path.is_symlink()  # replaced by a real entry, the planted file untouched


def test_an_entry_another_user_owns_is_never_served(_isolated_cache, monkeypatch):
    r1 = compiler.compile_cubin(GOOD, "sm_90")
    compiler.clear_memory_cache()
    uid = os.getuid()
    real_fstat = os.fstat

    def fstat(fd):  # the entry file (not the folder) looks as if another user wrote it
        st = real_fstat(fd)
        if not __import__("stat").S_ISDIR(st.st_mode):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, uid + 1) + tuple(st[5:]))
        return st

    monkeypatch.setattr(os, "fstat", fstat)
    assert compiler._disk_read(r1.key) is None
    monkeypatch.setattr(os, "fstat", real_fstat)
    assert compiler._disk_read(r1.key) == r1.cubin


@pytest.mark.parametrize("damage", ["world_writable", "symlink", "other_owner"])
def test_an_unsafe_cache_folder_is_refused_with_a_warning(tmp_path, monkeypatch, damage):
    """A folder another user may write (or that is a symlink, or someone else's) is not read
    nor written: a planted cubin there is never served, and compiling still works."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(root))
    compiler._WARNED.clear()
    r1 = compiler.compile_cubin(GOOD, "sm_90")
    d = root / "cubin"
    if damage == "world_writable":
        d.chmod(0o777)
    elif damage == "symlink":
        d.rename(root / "elsewhere")
        d.symlink_to(root / "elsewhere")
    else:
        real_fstat = os.fstat
        monkeypatch.setattr(os, "fstat", lambda fd: _other_owner(real_fstat(fd)))
    compiler.clear_memory_cache()
    with pytest.warns(compiler.CubinCacheWarning, match="not used"):
        r2 = compiler.compile_cubin(GOOD, "sm_90")
    assert r2.cached == "" and r2.cubin == r1.cubin


def _other_owner(st):
    if __import__("stat").S_ISDIR(st.st_mode):
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, os.getuid() + 1) + tuple(st[5:]))
    return st
