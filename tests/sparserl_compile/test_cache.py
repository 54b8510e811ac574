"""cache: round trips, corruption is a miss, atomic concurrent writes, folder permissions, CLI."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest

from sparserl_compile.cache import (
    CacheEntry,
    CacheKey,
    CacheWarning,
    KernelCache,
    default_dir,
    width_bucket,
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


def test_width_bucket():
    assert [width_bucket(n) for n in (0, 1, 2, 3, 4, 5, 32, 33, 128)] == [1, 1, 2, 4, 4, 8, 32, 64, 128]
    with pytest.raises(ValueError):
        width_bucket(-1)


def test_key_digest_covers_every_field():
    k = _key()
    assert len(k.digest()) == 64 and k.digest() == _key().digest()
    for field, value in [("fingerprint", "cd" * 16), ("op", "spmm"), ("dtype", "f16"), ("width", 2),
                         ("arch", "sm_100"), ("gpu_name", "X"), ("driver_version", "1"),
                         ("nvrtc_version", "12.9"), ("package_version", "9"),
                         ("kernel_space_version", "2"), ("policy_hash", "ff")]:
        assert _key(**{field: value}).digest() != k.digest(), field


def test_round_trip_disk_and_memory(tmp_path):
    c = KernelCache(tmp_path / "c")
    k, e = _key(), _entry(_key())
    assert c.get(k) is None
    assert c.put(e)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    assert c.get(k) == e
    fresh = KernelCache(tmp_path / "c")  # a new process would see the disk only
    got = fresh.get(k)
    assert got == e and got.cubin == e.cubin and not got.reference_wins
    ref = _entry(_key(op="spmm", width=64), cubin=None)
    assert c.put(ref)
    assert KernelCache(tmp_path / "c").get(ref.key).reference_wins
    assert c.remove(k) and c.get(k) is None and not c.remove(k)


def _corrupt_variants():
    def truncate(p: Path):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    def bitflip(p: Path):
        b = bytearray(p.read_bytes())
        i = b.index(b'"cubin_b64"') + 20
        b[i] ^= 0x01
        p.write_bytes(bytes(b))

    def drop_cubin(p: Path):  # cubin removed, hash left as it was
        d = json.loads(p.read_text())
        d["cubin_b64"] = None
        p.write_text(json.dumps(d))

    def wrong_hash(p: Path):
        d = json.loads(p.read_text())
        d["sha256"] = "0" * 64
        p.write_text(json.dumps(d))

    def edited_times(p: Path):
        d = json.loads(p.read_text())
        d["times"]["kernel_us"] = 0.001
        p.write_text(json.dumps(d))

    def empty(p: Path):
        p.write_bytes(b"")

    def not_utf8(p: Path):
        p.write_bytes(b"\xff\xfe\x00garbage")

    return [truncate, bitflip, drop_cubin, wrong_hash, edited_times, empty, not_utf8]


@pytest.mark.parametrize("damage", _corrupt_variants(), ids=lambda f: f.__name__)
def test_corrupt_entries_are_misses_and_removed(tmp_path, damage, caplog):
    KernelCache(tmp_path).put(_entry(_key()))
    path = KernelCache(tmp_path).path_of(_key().digest())
    damage(path)
    c = KernelCache(tmp_path)
    with caplog.at_level("WARNING", logger="sparserl.cache"):
        assert c.get(_key()) is None
    assert "corrupt" in caplog.text
    assert not path.exists()
    assert c.put(_entry(_key())) and KernelCache(tmp_path).get(_key()) is not None


def test_entry_under_another_keys_name_is_a_miss(tmp_path):
    c = KernelCache(tmp_path)
    c.put(_entry(_key()))
    other = _key(op="spmm", width=8)
    src, dst = c.path_of(_key().digest()), c.path_of(other.digest())
    dst.parent.mkdir(exist_ok=True)
    os.replace(src, dst)
    assert KernelCache(tmp_path).get(other) is None


def _writer(args):
    directory, worker = args
    c = KernelCache(directory)
    for i in range(25):
        c.put(_entry(_key(), cubin=bytes([worker]) * (4000 + i)))  # same key, all writers
        c.put(_entry(_key(fp=f"{worker:02x}{i:02x}" * 8)))  # own keys
        got = KernelCache(directory).get(_key())
        assert got is not None and len(set(got.cubin)) == 1
    return True


def test_concurrent_writers_leave_only_valid_entries(tmp_path):
    ctx = mp.get_context("spawn" if os.name != "posix" else "fork")
    with ctx.Pool(4) as pool:
        assert all(pool.map(_writer, [(str(tmp_path), w) for w in range(4)]))
    c = KernelCache(tmp_path)
    items = c.ls()
    assert len(items) == 1 + 4 * 25
    assert all(x.entry is not None for x in items)
    assert not list(tmp_path.glob("??/.tmp-*"))
    assert c.verify().removed == ()


def test_other_writable_dir_is_refused_with_one_warning(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.warns(CacheWarning, match="chmod 700"):
        c = KernelCache(d)
    assert not c.on_disk
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not c.put(_entry(_key()))
        assert c.get(_key()) is not None  # memory-only still works
    assert not list(d.iterdir())


def test_dir_owned_by_someone_else_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.warns(CacheWarning, match="owned by uid 12345"):
        assert not KernelCache(d).on_disk


def test_unusable_dir_runs_uncached(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(CacheWarning, match="cannot create"):
        c = KernelCache(blocker / "cache")
    assert not c.put(_entry(_key())) and c.get(_key()) is not None


def test_write_failure_warns_once_and_keeps_memory(tmp_path, monkeypatch):
    c = KernelCache(tmp_path)

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sparserl_compile.secure_dir.Folder._write_temp", no_space)
    with pytest.warns(CacheWarning, match="No space"):
        assert not c.put(_entry(_key()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not c.put(_entry(_key(op="spmm")))
    assert c.get(_key()) is not None


def test_default_follows_env_at_call_time(tmp_path, monkeypatch, _isolated_cache):
    assert default_dir() == Path(_isolated_cache)
    a = KernelCache.default()
    assert a.directory == Path(_isolated_cache) and KernelCache.default() is a
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "other"))
    b = KernelCache.default()
    assert b.directory == tmp_path / "other" and b is not a
    monkeypatch.delenv("SPARSERL_CACHE_DIR")
    assert default_dir() == Path.home() / ".cache" / "sparserl"


def test_numpy_and_nonfinite_record_values_round_trip(tmp_path):
    import numpy as np

    e = CacheEntry(_key(), b"cubin", times={"kernel_us": np.float64(2.5), "runs": np.int64(7)},
                   verification={"errs": np.array([1e-7, 0.0]), "worst": float("inf")})
    c = KernelCache(tmp_path)
    assert c.put(e)
    got = KernelCache(tmp_path).get(_key())
    assert got.times == {"kernel_us": 2.5, "runs": 7}
    assert got.verification == {"errs": [1e-7, 0.0], "worst": float("inf")}
    with pytest.raises(TypeError, match="JSON only"):
        c.put(CacheEntry(_key(op="spmm"), None, verification={"obj": object()}))


def test_a_policy_runtime_finds_families_only_entries_but_not_the_reverse(tmp_path):
    from sparserl_compile import cache

    store = KernelCache(tmp_path / "c")
    families = _key()  # built with the search or nearest provider
    store.put(_entry(families))
    policy = _key(policy_hash="ab12")
    runtime = ("none",)  # the fallbacks the runtime passes (miss.verdict)
    assert cache.lookup(store, policy, runtime).key == families  # a policy process serves a search-built cache
    assert cache.lookup(store, policy) is None  # without fallbacks, only the exact key
    store.put(_entry(_key(fp="cd" * 16, policy_hash="ab12")))
    assert cache.lookup(store, _key(fp="cd" * 16), runtime) is None  # a policy's entries need that policy
    assert cache.lookup(store, _key(fp="cd" * 16, policy_hash="ab12"), runtime).key.policy_hash == "ab12"
    assert cache.lookup(store, _key(fp="ef" * 16, policy_hash="ab12"), runtime) is None


def _read_only(monkeypatch):
    """This user may read the folders but not write them (tests run as root, which may always
    write, so the permission check is what is replaced)."""
    from sparserl_compile import cache

    monkeypatch.setattr(cache, "writable", lambda path: False)


def test_a_read_only_folder_skips_a_subfolder_others_can_write(tmp_path, monkeypatch):
    KernelCache(tmp_path).put(_entry(_key()))
    sub = KernelCache(tmp_path).path_of(_key().digest()).parent
    os.chmod(sub, 0o777)
    _read_only(monkeypatch)
    with pytest.warns(CacheWarning):
        c = KernelCache(tmp_path)
    assert c.get(_key()) is None  # a planted entry is never loaded


def test_entries_built_by_the_shipped_policy_serve_every_process(tmp_path, monkeypatch):
    """A cache pre-generated with the default provider (the shipped policy) is found by a
    process whose default fell back to the lookup (no ``train`` extra) and by one running another
    checkpoint; an entry of that other checkpoint still serves only it."""
    from sparserl_compile import cache, providers

    monkeypatch.setattr(providers, "shipped_policy_hash", lambda: "5h1p")
    runtime = ("none", providers.shipped_policy_hash())  # the fallbacks the runtime passes (miss.verdict)
    store = KernelCache(tmp_path / "c")
    store.put(_entry(_key(policy_hash="5h1p")))
    assert cache.lookup(store, _key(), runtime).key.policy_hash == "5h1p"  # the lookup's process
    assert cache.lookup(store, _key(policy_hash="ab12"), runtime).key.policy_hash == "5h1p"
    store.put(_entry(_key(fp="cd" * 16, policy_hash="ab12")))
    assert cache.lookup(store, _key(fp="cd" * 16), runtime) is None
    assert cache.lookup(store, _key(fp="cd" * 16, policy_hash="5h1p"), runtime) is None
    store.put(_entry(_key(fp="cd" * 16)))  # families-only entries come before the shipped policy's
    store.put(_entry(_key(fp="cd" * 16, policy_hash="5h1p")))
    assert cache.lookup(store, _key(fp="cd" * 16, policy_hash="ef34"), runtime).key.policy_hash == "none"


def test_the_shipped_policy_hash_is_its_weights_sha256():
    from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT, weights_sha256
    from sparserl_compile import providers

    f = DEFAULT_CHECKPOINT / "model.safetensors"
    assert providers.shipped_policy_hash() == (weights_sha256(f) if f.is_file() else None)


# ---------------------------------------------------------------------- the tamper matrix
#
# Every kind of damage an attacker (another local user) or an accident can do to a cache folder:
# none may get an entry served, each is a logged miss (or, for the folder itself, one
# CacheWarning and memory-only), and none raises.


class _Owned:
    """An ``os.stat_result`` as ``fstat`` returns it, with another owner (a foreign file
    without needing root to chown it)."""

    def __init__(self, st, uid):
        self._st, self.st_uid = st, uid

    def __getattr__(self, name):
        return getattr(self._st, name)


def _pretend_owner(monkeypatch, path: Path, uid: int) -> None:
    """``path`` (a file or folder) looks owned by ``uid`` to every fstat from now on."""
    ino = os.lstat(path).st_ino
    real = os.fstat

    def fstat(fd):
        st = real(fd)
        return _Owned(st, uid) if st.st_ino == ino else st

    monkeypatch.setattr(os, "fstat", fstat)


def _entry_path(d: Path, key: CacheKey | None = None) -> Path:
    digest = (key or _key()).digest()
    return d / digest[:2] / f"{digest}.json"


def _rewrite(p: Path, **changes) -> None:
    """Edit an entry's fields and recompute its sha256 exactly as the cache does (what anyone
    can do who can write the file): only the HMAC is left stale."""
    import hashlib

    from sparserl_compile.cache import _canonical

    d = json.loads(p.read_text())
    d.update(changes)
    body = {k: v for k, v in d.items() if k not in ("sha256", "hmac_sha256")}
    d["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    p.write_text(json.dumps(d))


def _d_corrupt_json(d, mp):
    _entry_path(d).write_text('{"format": 2, "key": ')


def _d_truncated(d, mp):
    p = _entry_path(d)
    p.write_bytes(p.read_bytes()[:200])


def _d_wrong_key(d, mp):  # the stored key edited to name another problem, hashes recomputed
    p = _entry_path(d)
    k = json.loads(p.read_text())["key"]
    _rewrite(p, key={**k, "width": 64})


def _d_other_digest_name(d, mp):  # another key's (valid, signed) entry renamed to this key's name
    c = KernelCache(d)
    other = _key(op="spmm", width=8)
    c.put(_entry(other))
    os.replace(c.path_of(other.digest()), _entry_path(d))


def _d_mode_0666_file(d, mp):
    os.chmod(_entry_path(d), 0o666)


def _d_group_writable_subfolder(d, mp):
    os.chmod(_entry_path(d).parent, 0o770)


def _d_group_writable_folder(d, mp):
    os.chmod(d, 0o770)


def _d_foreign_file(d, mp):
    _pretend_owner(mp, _entry_path(d), 12345)


def _d_foreign_subfolder(d, mp):
    _pretend_owner(mp, _entry_path(d).parent, 12345)


def _d_foreign_folder(d, mp):
    _pretend_owner(mp, d, 12345)


def _d_symlink_to_outside(d, mp):
    p = _entry_path(d)
    outside = d.parent / f"{d.name}-outside.json"
    outside.write_bytes(p.read_bytes())  # a valid, signed entry, but reached through a link
    os.chmod(outside, 0o600)
    p.unlink()
    p.symlink_to(outside)


def _d_symlinked_subfolder(d, mp):
    p = _entry_path(d)
    elsewhere = d.parent / f"{d.name}-sub"
    os.replace(p.parent, elsewhere)
    p.parent.symlink_to(elsewhere, target_is_directory=True)


def _d_symlinked_cache_folder(d, mp):
    real = d.parent / f"{d.name}-real"
    os.replace(d, real)
    d.symlink_to(real, target_is_directory=True)


def _d_recomputed_sha256(d, mp):  # a changed cubin with its sha256 recomputed: only the HMAC catches it
    import base64

    _rewrite(_entry_path(d), cubin_b64=base64.b64encode(b"\x7fELF planted").decode())


def _d_swapped_entries(d, mp):
    c = KernelCache(d)
    other = _key(fp="cd" * 16)
    c.put(_entry(other, cubin=b"other"))
    a, b = _entry_path(d), c.path_of(other.digest())
    tmp = a.with_suffix(".swap")
    os.replace(a, tmp)
    b.parent.mkdir(exist_ok=True)
    os.replace(b, a)
    os.replace(tmp, b)


def _d_copied_from_another_folder(d, mp):  # a valid entry signed with another folder's key
    other = d.parent / f"{d.name}-other"
    KernelCache(other).put(_entry(_key(), cubin=b"\x7fELF from elsewhere"))
    os.replace(_entry_path(other), _entry_path(d))


def _d_unsigned_old_format(d, mp):
    import hashlib

    from sparserl_compile.cache import _canonical

    p = _entry_path(d)
    doc = json.loads(p.read_text())
    doc = {k: v for k, v in doc.items() if k not in ("sha256", "hmac_sha256")}
    doc["format"] = 1
    doc["sha256"] = hashlib.sha256(_canonical(doc)).hexdigest()
    p.write_text(json.dumps(doc))


def _d_fifo(d, mp):  # a reader must not block on it
    p = _entry_path(d)
    p.unlink()
    os.mkfifo(p, 0o600)


def _d_hard_link(d, mp):  # content that can change through another name
    p = _entry_path(d)
    os.link(p, d.parent / f"{d.name}-link.json")


def _d_key_readable_by_others(d, mp):
    os.chmod(d / ".key", 0o644)


def _d_key_symlink(d, mp):
    key = d / ".key"
    outside = d.parent / f"{d.name}-key"
    outside.write_bytes(key.read_bytes())
    os.chmod(outside, 0o600)
    key.unlink()
    key.symlink_to(outside)


def _d_key_removed(d, mp):
    (d / ".key").unlink()


def _d_key_replaced(d, mp):  # someone who cannot read the key writes their own
    key = d / ".key"
    key.unlink()
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)


def _d_key_foreign(d, mp):
    _pretend_owner(mp, d / ".key", 12345)


def _d_huge_file(d, mp):
    from sparserl_compile.cache import MAX_ENTRY_BYTES

    with open(_entry_path(d), "r+b") as f:
        f.truncate(MAX_ENTRY_BYTES + 1)


#: each damage and what the log (or the folder's CacheWarning) says about it
DAMAGE = {
    _d_corrupt_json: "Expecting value", _d_truncated: "Unterminated string", _d_wrong_key: "not signed",
    _d_other_digest_name: "differs from the requested one", _d_mode_0666_file: "mode 666",
    _d_group_writable_subfolder: "mode 770", _d_group_writable_folder: "mode 770",
    _d_foreign_file: "owned by uid 12345", _d_foreign_subfolder: "owned by uid 12345",
    _d_foreign_folder: "owned by uid 12345", _d_symlink_to_outside: "is a symlink",
    _d_symlinked_subfolder: "is a symlink", _d_symlinked_cache_folder: "is a symlink",
    _d_recomputed_sha256: "not signed", _d_swapped_entries: "differs from the requested one",
    _d_copied_from_another_folder: "not signed", _d_unsigned_old_format: "not a format-2 cache entry",
    _d_fifo: "not a regular file", _d_hard_link: "2 hard links", _d_key_readable_by_others: "mode 644",
    _d_key_symlink: "is a symlink", _d_key_removed: "has no key", _d_key_replaced: "not signed",
    _d_key_foreign: "owned by uid 12345", _d_huge_file: "more than any entry",
}


def _served_after(d: Path, damage, monkeypatch, caplog, read_only: bool) -> tuple[object, str, list]:
    KernelCache(d).put(_entry(_key()))
    assert KernelCache(d).get(_key()) is not None  # served before the damage
    damage(d, monkeypatch)
    if read_only:
        _read_only(monkeypatch)
    with warnings.catch_warnings(record=True) as warned, caplog.at_level("WARNING", logger="sparserl.cache"):
        warnings.simplefilter("always")
        got = KernelCache(d).get(_key())
    return got, caplog.text, [str(w.message) for w in warned if issubclass(w.category, CacheWarning)]


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__[3:])
def test_no_damaged_entry_is_ever_served(tmp_path, damage, read_only, monkeypatch, caplog):
    d = tmp_path / "c"
    got, logged, warned = _served_after(d, damage, monkeypatch, caplog, read_only)
    assert got is None, f"{damage.__name__}: a damaged entry was served"
    assert DAMAGE[damage] in logged + "".join(warned), f"{damage.__name__}: the miss was not logged with its reason"


def test_a_fifo_entry_does_not_block_ls_or_verify(tmp_path):
    d = tmp_path / "c"
    KernelCache(d).put(_entry(_key()))
    _d_fifo(d, None)
    c = KernelCache(d)
    (x,) = c.ls()
    assert x.entry is None and "not a regular file" in x.problem
    assert c.verify().removed == (str(x.path),) and not x.path.exists()


def test_symlinks_are_never_followed_by_clear_or_verify(tmp_path):
    """Removing entries never removes anything outside the folder: a symlinked entry or
    subfolder loses its link, its target stays."""
    d = tmp_path / "c"
    c = KernelCache(d)
    c.put(_entry(_key()))
    c.put(_entry(_key(fp="cd" * 16)))
    _d_symlink_to_outside(d, None)
    outside = d.parent / "c-outside.json"
    sub = c.path_of(_key(fp="cd" * 16).digest()).parent
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.json").write_text("keep me")
    if sub.name == _entry_path(d).parent.name:  # pragma: no cover - the two digests share a subfolder
        pytest.skip("digests collide")
    for f in sub.iterdir():
        f.unlink()
    sub.rmdir()
    sub.symlink_to(victim, target_is_directory=True)
    assert KernelCache(d).clear() == 0  # the entry symlink is removed, not counted as an entry
    assert outside.exists() and (victim / "precious.json").read_text() == "keep me"
    r = KernelCache(d).verify()
    assert str(sub) in r.removed and not sub.is_symlink() and (victim / "precious.json").exists()


def test_a_leaked_key_is_replaced_on_write_and_its_entries_become_misses(tmp_path, caplog):
    d = tmp_path / "c"
    KernelCache(d).put(_entry(_key()))
    os.chmod(d / ".key", 0o644)
    old = (d / ".key").read_bytes()
    c = KernelCache(d)
    with caplog.at_level("WARNING", logger="sparserl.cache"):
        assert c.get(_key()) is None
        assert c.put(_entry(_key(fp="cd" * 16)))
    assert "others could have read it" in caplog.text and "replaced" in caplog.text
    assert (d / ".key").stat().st_mode & 0o777 == 0o600 and (d / ".key").read_bytes() != old
    assert KernelCache(d).get(_key(fp="cd" * 16)) is not None


def test_the_key_is_private_and_concurrent_first_writers_share_it(tmp_path):
    d = tmp_path / "c"
    ctx = mp.get_context("fork")
    with ctx.Pool(4) as pool:
        assert all(pool.map(_writer, [(str(d), w) for w in range(4)]))
    st = (d / ".key").stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_size == 32 and st.st_nlink == 1
    assert all(x.entry is not None for x in KernelCache(d).ls())  # every writer signed with the one key
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]


def test_a_planted_cubin_beside_the_entries_is_not_an_entry(tmp_path):
    """``cubin/`` belongs to the compiler (it checks its own files); the entry cache never
    reads, lists or removes anything there."""
    d = tmp_path / "c"
    c = KernelCache(d)
    c.put(_entry(_key()))
    planted = d / "cubin"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    (planted / f"{_key(fp='ee' * 16).digest()}.json").write_text("{}")
    (planted / "x.cubin").write_bytes(b"\x7fELF planted")
    fresh = KernelCache(d)
    assert fresh.get(_key(fp="ee" * 16)) is None
    assert [x.digest for x in fresh.ls()] == [_key().digest()]
    assert fresh.clear() == 1 and (planted / "x.cubin").exists()


def _become_another_user(monkeypatch):
    """From now on this process is a user other than the folders' owner, which is root (a
    cache deployed into an image or a root-owned folder): the effective uid is not the folders'
    owner, and the folders (whoever really owns them here) look owned by root."""
    from sparserl_compile import secure_dir

    real_euid = secure_dir.euid()
    real = os.fstat

    def fstat(fd):
        st = real(fd)
        return _Owned(st, 0) if st.st_uid == real_euid else st

    monkeypatch.setattr(os, "fstat", fstat)
    monkeypatch.setattr(secure_dir, "euid", lambda: 4242)


def test_a_root_owned_folder_is_served_to_another_user_by_ownership(tmp_path, monkeypatch):
    """The deployed case: the reader cannot check the builder's HMAC (it cannot read root's key,
    and a key it could read would prove nothing), so ownership is the authority: an entry root
    rewrote is served; a file that others can write, a symlink or a foreign file is not."""
    d = tmp_path / "c"
    d.mkdir(mode=0o755)
    KernelCache(d).put(_entry(_key()))  # built by the folder's owner
    KernelCache(d).put(_entry(_key(fp="cd" * 16)))
    _become_another_user(monkeypatch)
    with pytest.warns(CacheWarning, match="belongs to root"):
        c = KernelCache(d)
    assert c.readable and not c.on_disk and c.trust == "owner"
    assert c.get(_key()).cubin == _entry(_key()).cubin
    assert [x.entry is not None for x in c.ls()] == [True, True]
    _rewrite(_entry_path(d, _key(fp="cd" * 16)), source="// root's own edit")
    with pytest.warns(CacheWarning):
        assert KernelCache(d).get(_key(fp="cd" * 16)).source == "// root's own edit"
    os.chmod(_entry_path(d, _key(fp="cd" * 16)), 0o646)
    with pytest.warns(CacheWarning):
        assert KernelCache(d).get(_key(fp="cd" * 16)) is None
    with pytest.warns(CacheWarning):
        assert not KernelCache(d).put(_entry(_key(fp="ee" * 16)))  # new entries stay in memory


@pytest.mark.parametrize("damage", [_d_mode_0666_file, _d_group_writable_subfolder, _d_foreign_file,
                                    _d_symlink_to_outside, _d_symlinked_subfolder, _d_fifo, _d_hard_link,
                                    _d_corrupt_json, _d_other_digest_name], ids=lambda f: f.__name__[3:])
def test_a_root_owned_folder_still_refuses_what_others_could_have_written(tmp_path, monkeypatch, caplog, damage):
    d = tmp_path / "c"
    KernelCache(d).put(_entry(_key()))
    KernelCache(d).put(_entry(_key(op="spmm", width=8)))  # for the renamed entry
    damage(d, monkeypatch)
    _become_another_user(monkeypatch)
    with pytest.warns(CacheWarning, match="belongs to root"), caplog.at_level("WARNING", logger="sparserl.cache"):
        assert KernelCache(d).get(_key()) is None
    assert DAMAGE[damage] in caplog.text


def test_a_folder_of_another_user_is_refused_and_not_merged(tmp_path, monkeypatch):
    from sparserl_compile.merge import merge_caches

    d = tmp_path / "theirs"
    KernelCache(d).put(_entry(_key()))
    _pretend_owner(monkeypatch, d, 12345)
    with pytest.warns(CacheWarning, match="owned by uid 12345"):
        assert not KernelCache(d).readable
    r = merge_caches([d], tmp_path / "mine")
    assert r.refused and "owned by uid 12345" in r.refused[0] and not r.actions
