"""The cache's tamper matrix: every kind of damage an attacker (another local user) or an
accident can do to a cache folder; none may get an entry served, each is a miss logged with
its reason (or, for the folder itself, one CacheWarning and memory-only), none raises."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest

from sparserl_compile.cache import CacheKey, CacheWarning, KernelCache
from test_cache import _entry, _key, _read_only, _writer


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
