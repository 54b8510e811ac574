import json

import numpy as np
import pytest
import scipy.sparse as sp

import device_carry
from sparserl_compile.training.data import SHARED_HELD_OUT

REC = {"matrix": {"source": "generated", "generator": "banded", "kwargs": {"n": 64, "half_bandwidth": 2, "seed": 0}},
       "op": "spmv", "dtype": "f32", "n": 1, "reference_us": 30.0,
       "variants": [{"family": "csr_scalar", "params": {"block": 256}, "us": 12.0}]}

# the selection with the defaults: training.validation --count 48 --seed 7 drew the recorded
# problems (benchmarks/results/h200_validation_fresh48_*.json) from exactly these
CARRIED = {"ISPD98_ibm01", "PGPgiantcompo", "add32", "airfoil1", "bcspwr10", "bcsstk13", "citeseer_adj", "cora_adj",
           "crack", "dnn_n1024_l1", "dnn_n1024_l2", "polblogs", "power", "wiki-Vote", "citeseer_features", "4elt"}


def test_the_selection_is_the_recorded_one(shared_matrices, monkeypatch):
    from sparserl_compile.training import source_split

    # since the source split, its collections are held out: carried only where a record names them
    source = source_split.held_out_names()
    named = {"bcsstk13", "citeseer_adj", "cora_adj", "cora_features", "dnn_n1024_l1", "dnn_n1024_l2", "rajat01"}
    names = {i.name for i in device_carry.carry_selection()}
    assert names == (CARRIED - source) | SHARED_HELD_OUT | (source & named)
    assert {i.name for i in device_carry.carry_selection(held_out=False)} == CARRIED - source
    # the recorded selection was made before the source split
    monkeypatch.setattr(source_split, "held_out_names", lambda: frozenset())
    assert {i.name for i in device_carry.carry_selection(held_out=False)} == CARRIED


def test_the_selection_draws_the_recorded_fresh_problems(shared_matrices, tmp_path, monkeypatch):
    from pathlib import Path

    from sparserl_compile.training.unlabelled import parse_mix
    from sparserl_compile.training.validation import validation_problems

    from sparserl_compile.training import source_split

    recorded = Path(__file__).resolve().parents[2] / "benchmarks/results/h200_validation_fresh48_correctness_controls_2026-12-04.json"
    # drawn before the source split held out whole collections (cora, citeseer and the others are no
    # training-side source since): the recorded draw is reproduced without it
    monkeypatch.setattr(source_split, "held_out_names", lambda: frozenset())
    assert device_carry.main(["--dest", str(tmp_path / "carry"), "--no-held-out"]) in (0, 1)
    monkeypatch.setenv("SPARSERL_SHARED_MATRICES", str(tmp_path / "carry" / "matrices"))
    mix = ("uniform_random=2,rmat=2,random_geometric=1,stencil3d=1,block_diagonal=1,banded=1,circuit=1,"
           "shared:road_planar=1,shared:social_powerlaw=1,shared:circuit=1,shared:gnn_citation=1,shared:mesh=1")
    drawn = [f"{p.label} {p.op}" for p in validation_problems(48, 7, 1_000_000, mix=parse_mix(mix))]
    assert drawn == json.loads(recorded.read_text())["problems"]


def _folder(tmp_path, sizes: dict):
    """A shared folder: name -> (kind, file size in bytes, approximately)."""
    entries = []
    for name, (kind, nbytes) in sizes.items():
        n = 8
        m = sp.identity(n, format="csr")  # the padding below gives the file its size
        np.savez(tmp_path / f"{name}.npz", indptr=m.indptr, indices=m.indices, data=m.data, shape=np.array(m.shape),
                 pad=np.zeros(nbytes // 8))
        entries.append({"name": name, "file": f"{name}.npz", "kind": kind, "n_rows": n, "n_cols": n, "nnz": m.nnz})
    (tmp_path / "MANIFEST.json").write_text(json.dumps(entries))
    return tmp_path


def test_mix_kinds_under_the_size_cap_and_held_out_ones_are_chosen(tmp_path, monkeypatch):
    """A mix kind's matrix under the cap is copied, one over it is not, a held-out matrix is
    whatever its size, and a kind no mix draws is not (the supervision names none here)."""
    src = tmp_path / "src"
    src.mkdir()
    _folder(src, {"small_mesh": ("mesh", 20_000), "big_mesh": ("mesh", 400_000), "fem": ("fem_structural", 20_000),
                  "uk": ("road_planar", 400_000)})
    monkeypatch.setenv("SPARSERL_SHARED_MATRICES", str(src))
    sup = tmp_path / "sup.jsonl"
    sup.write_text(json.dumps(REC) + "\n")
    monkeypatch.setattr(device_carry, "tracked_bytes", lambda repo=None: 0)
    assert {i.name for i in device_carry.carry_selection(max_bytes=100_000, supervision=str(sup))} == {"small_mesh", "uk"}
    dest = tmp_path / "carry"
    real = device_carry.carry_selection
    monkeypatch.setattr(device_carry, "carry_selection", lambda max_bytes, held_out: real(max_bytes, held_out,
                                                                                         supervision=str(sup)))
    assert device_carry.main(["--dest", str(dest), "--max-bytes", "100000"]) == 0
    assert sorted(p.name for p in (dest / "matrices").iterdir()) == ["MANIFEST.json", "small_mesh.npz", "uk.npz"]
    assert device_carry.main(["--dest", str(dest), "--max-bytes", "100000", "--no-held-out"]) == 0
    assert sorted(p.name for p in (dest / "matrices").iterdir()) == ["MANIFEST.json", "small_mesh.npz"]


def test_a_bad_checkpoint_revision_says_what_to_name(tmp_path):
    with pytest.raises(SystemExit, match="git show found no policy/checkpoints/default/README.md at nope"):
        device_carry.write_checkpoint("v1", "nope", tmp_path)


def test_version_1_is_written_from_git(tmp_path):
    import subprocess

    if subprocess.run(["git", "cat-file", "-e", "b78a58b"], cwd=device_carry.REPO, capture_output=True).returncode:
        pytest.skip("this checkout lacks the history holding version 1 (b78a58b): a shallow clone")
    out = device_carry.write_checkpoint("v1", "b78a58b", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").stat().st_size > 10_000_000 and cfg.get("model_type")


def test_a_packed_checkpoint_is_one_tgz_of_the_committed_files(tmp_path):
    """--pack writes NAME.tgz (what device_train.sh unpacks) holding the checkpoint's files at its
    top level, byte for byte as committed, and leaves no folder beside it."""
    import subprocess
    import tarfile

    tgz = device_carry.write_checkpoint("v3", "HEAD", tmp_path, pack=True)
    assert tgz == tmp_path / "v3.tgz" and sorted(p.name for p in tmp_path.iterdir()) == ["v3.tgz"]
    with tarfile.open(tgz) as t:
        assert sorted(t.getnames()) == sorted(device_carry.CHECKPOINT_FILES)
        packed = t.extractfile("config.json").read()
    committed = subprocess.run(["git", "show", "HEAD:policy/checkpoints/default/config.json"], cwd=device_carry.REPO,
                               capture_output=True, check=True).stdout
    assert packed == committed


def test_the_carry_is_counted_as_the_device_counts_it_on_disk(tmp_path):
    """A small file takes a whole block on disk; the device's limit counts blocks (du)."""
    (tmp_path / "a").write_bytes(b"x")
    assert device_carry.folder_bytes(tmp_path) >= 1
    assert device_carry.folder_bytes(tmp_path) == device_carry.disk_bytes(tmp_path / "a")
    assert device_carry.disk_bytes(tmp_path / "a") == max(1, (tmp_path / "a").stat().st_blocks * 512)
