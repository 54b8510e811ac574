"""sparserl cache ls | show | clear | verify: what a user sees of a cache folder, errors on stderr."""

from __future__ import annotations

import os
import warnings

import pytest

from sparserl_compile.commands import cli
from sparserl_compile.cache import (
    CacheEntry,
    CacheKey,
    CacheWarning,
    KernelCache,
)


def _key(fp: str = "ab" * 16, **kw) -> CacheKey:
    base = dict(fingerprint=fp, op="spmv", dtype="f32", width=1, arch="sm_90",
                gpu_name="NVIDIA H200", driver_version="13000", nvrtc_version="13.0")
    base.update(kw)
    return CacheKey(**base)


def _entry(key: CacheKey, cubin: bytes | None = b"\x7fELF" + bytes(range(256)) * 4) -> CacheEntry:
    return CacheEntry(key, cubin, source="// sparserl op=spmv ...\nkernel", header="// sparserl ...",
                      times={"kernel_us": 3.5, "reference_us": 9.25},
                      verification={"max_rel_err": 1e-7, "value_sets": 3})


def _read_only(monkeypatch):
    """This user may read the folders but not write them (tests run as root, which may always
    write, so the permission check is what is replaced)."""
    from sparserl_compile import cache

    monkeypatch.setattr(cache, "writable", lambda path: False)


def test_cli_ls_show_verify_clear(tmp_path, capsys):
    c = KernelCache(tmp_path)
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    assert "no kernel entries" in capsys.readouterr().out
    c.put(_entry(_key()))
    c.put(_entry(_key(op="spmm", width=32), cubin=None))
    bad = _key(fp="ee" * 16)
    c.put(_entry(bad))
    c.path_of(bad.digest()).write_text("{not json")

    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    out = capsys.readouterr().out
    assert "DIGEST" in out and "kernel" in out and "reference" in out and "CORRUPT" in out
    assert "3 entries" in out

    digest = _key().digest()
    assert cli.main(["cache", "--dir", str(tmp_path), "show", digest[:10]]) == 0
    out = capsys.readouterr().out
    assert "sm_90" in out and "kernel_us" in out and "cubin" in out and "kernel" in out
    assert cli.main(["cache", "--dir", str(tmp_path), "show", "zz"]) == 1
    err = capsys.readouterr().err
    assert f"no entry of {tmp_path} has a digest starting with 'zz'" in err and "longer" not in err

    assert cli.main(["cache", "--dir", str(tmp_path), "verify"]) == 0
    out = capsys.readouterr().out
    assert "2 valid entries, 1 removed" in out

    assert cli.main(["cache", "--dir", str(tmp_path), "clear"]) == 1
    assert "--yes" in capsys.readouterr().out and len(c.ls()) == 2
    assert cli.main(["cache", "--dir", str(tmp_path), "clear", "--yes"]) == 0
    assert "removed 2" in capsys.readouterr().out and c.ls() == []


def test_cli_uses_env_dir_and_refuses_insecure(tmp_path, capsys, monkeypatch):
    KernelCache.default().put(_entry(_key()))
    assert cli.main(["cache", "ls"]) == 0
    assert "1 entries" in capsys.readouterr().out
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    assert cli.main(["cache", "--dir", str(d), "ls"]) == 1
    assert "writable by group or others" in capsys.readouterr().err


def test_a_read_only_pregenerated_folder_is_served_and_never_changed(tmp_path, monkeypatch, capsys):
    """A cache deployed read-only (an image, a read-only mount) serves its entries; new kernels
    stay in memory, with one warning; corrupt entries are misses and stay; clear and verify refuse."""
    built = KernelCache(tmp_path)
    built.put(_entry(_key()))
    bad = built.path_of(_key(op="spmm").digest())
    bad.parent.mkdir(exist_ok=True)
    bad.write_text("{not json")
    _read_only(monkeypatch)
    with pytest.warns(CacheWarning, match="read-only .* not writable by this user"):
        c = KernelCache(tmp_path)
    assert c.readable and not c.on_disk
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, at start
        assert c.get(_key()).cubin == _entry(_key()).cubin  # served from the folder
        assert c.get(_key(op="spmm")) is None and bad.exists()  # a miss; the folder is not touched
        assert not c.put(_entry(_key(fp="cd" * 16)))
        assert c.get(_key(fp="cd" * 16)) is not None  # kept in memory
    assert not c.path_of(_key(fp="cd" * 16).digest()).exists()
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    assert "2 entries" in capsys.readouterr().out
    for action in (["verify"], ["clear", "--yes"]):
        assert cli.main(["cache", "--dir", str(tmp_path), *action]) == 1
        assert "cannot change the cache folder" in capsys.readouterr().err
    with pytest.warns(CacheWarning):
        assert bad.exists() and len(KernelCache(tmp_path).ls()) == 2


def test_inspecting_a_missing_folder_does_not_create_it(tmp_path, capsys):
    d = tmp_path / "nope"
    assert cli.main(["cache", "--dir", str(d), "ls"]) == 1
    assert "does not exist" in capsys.readouterr().err and not d.exists()


def test_deeply_nested_json_is_a_corrupt_entry(tmp_path, capsys):
    c = KernelCache(tmp_path)
    path = c.path_of(_key().digest())
    path.parent.mkdir()
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert KernelCache(tmp_path).get(_key()) is None and not path.exists()  # a miss, removed
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    assert "CORRUPT" in capsys.readouterr().out
    assert cli.main(["cache", "--dir", str(tmp_path), "verify"]) == 0
    assert "0 valid entries, 1 removed" in capsys.readouterr().out and not path.exists()


def test_verify_says_which_corrupt_entries_it_cannot_remove(tmp_path, capsys):
    c = KernelCache(tmp_path)
    c.put(_entry(_key()))
    stuck = c.path_of(_key(op="spmm").digest())
    stuck.mkdir(parents=True)  # a folder where an entry file should be
    assert cli.main(["cache", "--dir", str(tmp_path), "verify"]) == 1
    out, err = capsys.readouterr()
    assert "cannot be removed" in err and "1 valid entries, 0 removed, 1 corrupt and not removable" in out
    assert cli.main(["cache", "--dir", str(tmp_path), "clear"]) == 1
    assert "would remove 1 entries" in capsys.readouterr().out  # the folder is not counted


def test_cli_ls_and_show_tell_a_dense_verdict(tmp_path, capsys):
    c = KernelCache(tmp_path)
    key = _key(op="spmm", width=16, dtype="bf16")
    c.put(CacheEntry(key, None, times={"reference_us": 90.0, "dense_us": 12.5},
                     verification={"why": "the dense product wins: ..."}, outcome="dense"))
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    out = capsys.readouterr().out
    assert "DENSE_US" in out and "dense" in out.splitlines()[1] and "12.50" in out
    assert cli.main(["cache", "--dir", str(tmp_path), "show", key.digest()[:10]]) == 0
    assert "dense product wins" in capsys.readouterr().out
