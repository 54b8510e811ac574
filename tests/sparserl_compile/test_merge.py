"""cache merge: entries by digest, corrupt ones skipped, conflicts (existing kept, --prefer-faster),
the CLI; and sharded pregen (--rank/--world-size, torchrun's env) followed by a merge."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparserl_compile import matrices, pregen, structure
from sparserl_compile.commands import cli
from sparserl_compile.cache import CacheEntry, CacheKey, KernelCache
from sparserl_compile.merge import entry_time_us, merge_caches


def _key(fp: str, **kw) -> CacheKey:
    base = dict(fingerprint=fp, op="spmv", dtype="f32", width=1, arch="sm_90",
                gpu_name="NVIDIA H200", driver_version="13000", nvrtc_version="13.0")
    base.update(kw)
    return CacheKey(**base)


def _entry(key: CacheKey, kernel_us: float | None = 3.5, tag: str = "a") -> CacheEntry:
    times = {} if kernel_us is None else {"kernel_us": kernel_us, "reference_us": 9.0}
    return CacheEntry(key, b"\x7fELF" + tag.encode() * 64, source=f"// kernel {tag}", header="// hdr",
                      times=times, verification={"value_sets": 3}, created=1.0)


def _corrupt(store: KernelCache, key: CacheKey) -> None:
    path = store.path_of(key.digest())
    d = json.loads(path.read_text())
    d["source"] = "// planted"  # sha256 no longer matches
    path.write_text(json.dumps(d))


@pytest.fixture
def two_caches(tmp_path):
    a, b = KernelCache(tmp_path / "rank0"), KernelCache(tmp_path / "rank1")
    k1, k2, k3, k4 = (_key(c * 32) for c in "1234")
    a.put(_entry(k1))
    a.put(_entry(k2, kernel_us=5.0, tag="a"))
    b.put(_entry(k2, kernel_us=2.0, tag="b"))  # same key, different (faster) kernel
    b.put(_entry(k3))
    b.put(_entry(k4))
    _corrupt(b, k4)
    return tmp_path, (k1, k2, k3, k4)


def test_merge_copies_by_digest_and_skips_a_corrupt_entry(two_caches):
    root, (k1, k2, k3, k4) = two_caches
    r = merge_caches([root / "rank0", root / "rank1"], root / "all")
    assert (r.count("copied"), r.count("kept"), r.count("corrupt"), r.count("replaced")) == (3, 1, 1, 0)
    (bad,) = [a for a in r.actions if a.outcome == "corrupt"]
    assert bad.digest == k4.digest() and "sha256" in bad.detail
    fresh = KernelCache(root / "all")  # what another process sees on disk
    assert [x.entry is not None for x in fresh.ls()] == [True, True, True]
    assert fresh.get(k4) is None
    assert fresh.get(k2).source == "// kernel a"  # first source wins without --prefer-faster
    assert fresh.get(k1) == KernelCache(root / "rank0").get(k1)
    again = merge_caches([root / "rank0", root / "rank1"], root / "all")  # idempotent
    assert again.count("copied") == 0 and again.count("identical") == 3


def test_prefer_faster_replaces_only_when_both_are_timed(two_caches, tmp_path):
    root, (k1, k2, k3, k4) = two_caches
    r = merge_caches([root / "rank0", root / "rank1"], root / "all", prefer_faster=True)
    (rep,) = [a for a in r.actions if a.outcome == "replaced"]
    assert rep.digest == k2.digest() and "2.00 us < 5.00 us" in rep.detail
    assert KernelCache(root / "all").get(k2).source == "// kernel b"
    # an untimed (CPU-built) entry never replaces a timed one, nor the other way round
    c = KernelCache(tmp_path / "cpu")
    c.put(_entry(k1, kernel_us=None, tag="c"))
    r2 = merge_caches([tmp_path / "cpu"], root / "all", prefer_faster=True)
    assert [a.outcome for a in r2.actions] == ["kept"] and "untimed" in r2.actions[0].detail
    assert KernelCache(root / "all").get(k1).source == "// kernel a"


def test_entry_time_is_the_reference_time_when_the_reference_won():
    k = _key("9" * 32)
    assert entry_time_us(CacheEntry(k, None, times={"reference_us": 7.0, "kernel_us": 9.0})) == 7.0
    assert entry_time_us(_entry(k, kernel_us=3.0)) == 3.0
    assert entry_time_us(CacheEntry(k, b"x", times={"kernel_us": float("nan")})) is None
    dense = CacheEntry(k, None, times={"reference_us": 7.0, "kernel_us": 9.0, "dense_us": 2.0}, outcome="dense")
    assert entry_time_us(dense) == 2.0  # the dense product's time where it won


def test_merge_errors_and_a_corrupt_destination_entry(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        merge_caches([tmp_path / "absent"], tmp_path / "dst")
    assert not (tmp_path / "absent").exists()  # a source is never created
    src, dst = KernelCache(tmp_path / "src"), KernelCache(tmp_path / "dst")
    k = _key("5" * 32)
    src.put(_entry(k))
    dst.put(_entry(k, tag="old"))
    _corrupt(dst, k)  # a corrupt destination file is a miss: the good entry replaces it
    r = merge_caches([tmp_path / "src", tmp_path / "dst"], tmp_path / "dst")
    assert [a.outcome for a in r.actions] == ["copied"] and "destination itself" in r.warnings[0]
    assert KernelCache(tmp_path / "dst").get(k) == src.get(k)


def test_cli_cache_merge(two_caches, capsys):
    root, _ = two_caches
    rc = cli.main(["cache", "merge", str(root / "rank0"), str(root / "rank1"), "--into", str(root / "all")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped corrupt entry" in out and "copied 3" in out and "kept 1" in out
    assert cli.main(["cache", "--dir", str(root / "all"), "ls"]) == 0
    assert "3 entries" in capsys.readouterr().out


# ---------------------------------------------------------------------- sharded pregen


def _items():
    ms = [matrices.stencil2d(n) for n in (4, 9, 16)] + [matrices.rmat(s, 4, seed=s) for s in (5, 7, 8)]
    return [pregen.Item(f"m{i}", m) for i, m in enumerate(ms)]


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_shard_is_a_deterministic_balanced_partition(ws):
    items = _items()
    shards = [pregen.shard(items, r, ws) for r in range(ws)]
    assert [[i.name for i in s] for s in shards] == [[i.name for i in pregen.shard(_items(), r, ws)]
                                                     for r in range(ws)]
    names = sorted(i.name for s in shards for i in s)
    assert names == sorted(i.name for i in items)  # disjoint and complete
    cost = [sum(i.matrix.nnz + i.matrix.shape[0] for i in s) for s in shards]
    assert max(cost) - min(cost) <= max(i.matrix.nnz + i.matrix.shape[0] for i in items)
    with pytest.raises(SystemExit, match="--rank"):
        pregen.shard(items, ws, ws)


def test_sharded_pregen_cli_then_merge(tmp_path, monkeypatch, capsys):
    for it in _items():
        m = it.matrix
        np.savez(tmp_path / f"{it.name}.npz", indptr=m.indptr, indices=m.indices, data=m.data,
                 shape=np.array(m.shape))
    seen: dict[int, list[str]] = {}

    def fake_pregenerate(items, *, cache_dir, **kw):  # the search itself is tested in test_pregen
        store = KernelCache(cache_dir)
        rank = int(str(cache_dir)[-1])
        seen[rank] = [i.name for i in items]
        for i in items:
            fp = structure.fingerprint(i.matrix.indptr, i.matrix.indices, i.matrix.shape)
            store.put(_entry(_key(fp), tag=i.name))
        return []

    monkeypatch.setattr(pregen, "pregenerate", fake_pregenerate)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets them
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        assert cli.main(["pregen", str(tmp_path), "--out", str(tmp_path / "k" / "rank{rank}"),
                         "--target-gpu", "NVIDIA H200", "--target-driver", "13000", "--target-nvrtc", "13.0",
                         "--no-progress"]) == 0
    assert "rank 1/2:" in capsys.readouterr().err
    assert set(seen[0]).isdisjoint(seen[1]) and len(seen[0]) + len(seen[1]) == 6
    assert cli.main(["cache", "merge", str(tmp_path / "k" / "rank0"), str(tmp_path / "k" / "rank1"),
                     "--into", str(tmp_path / "k" / "all")]) == 0
    merged = KernelCache(tmp_path / "k" / "all").ls()
    assert len(merged) == 6 and all(x.entry is not None for x in merged)
    # flags override the environment
    assert cli.main(["pregen", str(tmp_path), "--out", str(tmp_path / "k" / "rank{rank}"), "--rank", "0",
                     "--world-size", "1", "--target-gpu", "NVIDIA H200", "--target-driver", "13000",
                     "--target-nvrtc", "13.0", "--no-progress"]) == 0
    assert len(seen[0]) == 6


def test_merge_re_signs_with_the_destination_key_and_skips_unsigned_entries(tmp_path):
    """A copied folder's entries become the destination's (signed with its key); an entry of a
    source that does not verify under that source's own key (its sha256 recomputed after an
    edit) is not copied."""
    import base64
    import hashlib

    from sparserl_compile.cache import _canonical

    src, dst = tmp_path / "src", tmp_path / "dst"
    good, edited = _key("1" * 32), _key("2" * 32)
    KernelCache(src).put(_entry(good))
    KernelCache(src).put(_entry(edited))
    p = KernelCache(src).path_of(edited.digest())
    d = json.loads(p.read_text())
    d["cubin_b64"] = base64.b64encode(b"\x7fELF planted").decode()
    body = {k: v for k, v in d.items() if k not in ("sha256", "hmac_sha256")}
    d["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    p.write_text(json.dumps(d))
    r = merge_caches([src], dst)
    assert (r.count("copied"), r.count("corrupt")) == (1, 1)
    (bad,) = [a for a in r.actions if a.outcome == "corrupt"]
    assert bad.digest == edited.digest() and "not signed" in bad.detail
    assert (src / ".key").read_bytes() != (dst / ".key").read_bytes()
    copied = json.loads(KernelCache(dst).path_of(good.digest()).read_text())
    original = json.loads(KernelCache(src).path_of(good.digest()).read_text())
    assert copied["hmac_sha256"] != original["hmac_sha256"]  # re-signed, not copied byte for byte
    assert KernelCache(dst).get(good) == KernelCache(src).get(good)
    assert KernelCache(dst).get(edited) is None


def test_cli_merge_refuses_a_source_others_can_write(tmp_path, capsys):
    import os

    src = tmp_path / "src"
    KernelCache(src).put(_entry(_key("1" * 32)))
    os.chmod(src, 0o777)
    assert cli.main(["cache", "merge", str(src), "--into", str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "not merged" in err and "writable by group or others" in err
    assert KernelCache(tmp_path / "dst").ls() == []
