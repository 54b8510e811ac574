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


def test_an_entry_replaced_while_it_is_read_is_served_not_discarded(tmp_path, monkeypatch, caplog):
    """A writer may rename a new entry over the name between a reader's open and its fstat;
    the opened file then has no link left, which is not a hard link to refuse: the reader
    serves what it opened and removes nothing."""
    c = KernelCache(tmp_path)
    c.put(_entry(_key(), cubin=b"\x01" * 4000))
    path = c.path_of(_key().digest())
    real_open = os.open

    def open_then_replace(name, flags, *args, **kw):
        fd = real_open(name, flags, *args, **kw)
        if name == path.name:
            monkeypatch.setattr(os, "open", real_open)
            KernelCache(tmp_path).put(_entry(_key(), cubin=b"\x02" * 4000))
        return fd

    monkeypatch.setattr(os, "open", open_then_replace)
    with caplog.at_level("WARNING", logger="sparserl.cache"):
        got = KernelCache(tmp_path).get(_key())
    assert got is not None and got.cubin == b"\x01" * 4000
    assert caplog.text == "" and KernelCache(tmp_path).get(_key()).cubin == b"\x02" * 4000


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
    from sparserl_compile import miss

    store = KernelCache(tmp_path / "c")
    families = _key()  # built with the search or nearest provider
    store.put(_entry(families))
    policy = _key(policy_hash="ab12")
    assert miss.lookup(store, policy).key == families  # a policy process serves a search-built cache
    store.put(_entry(_key(fp="cd" * 16, policy_hash="ab12")))
    assert miss.lookup(store, _key(fp="cd" * 16)) is None  # a policy's entries need that policy
    assert miss.lookup(store, _key(fp="cd" * 16, policy_hash="ab12")).key.policy_hash == "ab12"
    assert miss.lookup(store, _key(fp="ef" * 16, policy_hash="ab12")) is None


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
    from sparserl_compile import miss, providers

    monkeypatch.setattr(providers, "shipped_policy_hash", lambda: "5h1p")
    store = KernelCache(tmp_path / "c")
    store.put(_entry(_key(policy_hash="5h1p")))
    assert miss.lookup(store, _key()).key.policy_hash == "5h1p"  # the lookup's process
    assert miss.lookup(store, _key(policy_hash="ab12")).key.policy_hash == "5h1p"
    store.put(_entry(_key(fp="cd" * 16, policy_hash="ab12")))
    assert miss.lookup(store, _key(fp="cd" * 16)) is None
    assert miss.lookup(store, _key(fp="cd" * 16, policy_hash="5h1p")) is None
    store.put(_entry(_key(fp="cd" * 16)))  # families-only entries come before the shipped policy's
    store.put(_entry(_key(fp="cd" * 16, policy_hash="5h1p")))
    assert miss.lookup(store, _key(fp="cd" * 16, policy_hash="ef34")).key.policy_hash == "none"


def test_the_shipped_policy_hash_is_its_weights_sha256():
    from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT, weights_sha256
    from sparserl_compile import providers

    f = DEFAULT_CHECKPOINT / "model.safetensors"
    assert providers.shipped_policy_hash() == (weights_sha256(f) if f.is_file() else None)



def test_entries_on_disk_are_signed_with_the_folders_private_key(tmp_path):
    """What pregen and the runtime write (both through put) carries an HMAC-SHA256 under
    ``<dir>/.key``, a 0600 file of 32 bytes, checked here with the standard library alone."""
    import hashlib
    import hmac

    d = tmp_path / "c"
    KernelCache(d).put(_entry(_key()))
    key = d / ".key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size == 32
    doc = json.loads(KernelCache(d).path_of(_key().digest()).read_text())
    body = {k: v for k, v in doc.items() if k != "hmac_sha256"}
    signed = b"sparserl kernel cache entry\0" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert doc["format"] == 2 and doc["hmac_sha256"] == hmac.new(key.read_bytes(), signed, hashlib.sha256).hexdigest()


def test_a_dense_verdict_round_trips_and_outcomes_must_match_the_cubin(tmp_path):
    e = CacheEntry(_key(op="spmm", width=16), None, times={"reference_us": 90.0, "dense_us": 12.5},
                   verification={"dense_us": 12.5}, outcome="dense")
    KernelCache(tmp_path / "c").put(e)
    got = KernelCache(tmp_path / "c").get(e.key)
    assert got == e and got.dense_wins and not got.reference_wins and got.outcome == "dense"
    assert _entry(_key()).outcome == "kernel" and _entry(_key(), cubin=None).outcome == "reference"
    for bad in (dict(cubin=None, outcome="kernel"), dict(cubin=b"x", outcome="dense"),
                dict(cubin=None, outcome="fast")):
        with pytest.raises(ValueError, match="outcome"):
            CacheEntry(_key(), **bad)


def test_entries_written_before_the_outcome_field_still_load(tmp_path):
    """An entry file without ``outcome`` (written before the dense product was a candidate), signed
    as such a writer signed it, reads as a kernel or a reference verdict by its cubin."""
    import hashlib
    import hmac

    from sparserl_compile.cache_keys import _canonical

    d = tmp_path / "c"
    store = KernelCache(d)
    store.put(_entry(_key(fp="01" * 16)))  # creates the folder's key
    for cubin, outcome in ((b"\x7fELF", "kernel"), (None, "reference")):
        k = _key(fp=("cd" if cubin else "ef") * 16)
        doc = _entry(k, cubin=cubin).to_json_dict()
        del doc["outcome"], doc["sha256"]
        doc["sha256"] = hashlib.sha256(_canonical(doc)).hexdigest()
        signed = b"sparserl kernel cache entry\0" + _canonical(doc)
        doc["hmac_sha256"] = hmac.new((d / ".key").read_bytes(), signed, hashlib.sha256).hexdigest()
        path = store.path_of(k.digest())
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_text(json.dumps(doc))
        got = KernelCache(d).get(k)
        assert got is not None and got.outcome == outcome and got.cubin == cubin
        assert got.reference_wins == (cubin is None) and not got.dense_wins
