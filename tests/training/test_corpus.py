from sparserl_compile.training.corpus import build_corpus, cuda_toolkit_roots, save_corpus, source_files


def test_corpus_is_deduplicated_capped_and_counted(tmp_path, monkeypatch):
    d = tmp_path / "cuda" / "include"
    d.mkdir(parents=True)
    (d / "a.cuh").write_text("__global__ void a() {}\n")
    (d / "b.h").write_text("__global__ void a() {}\n")  # duplicate text
    (d / "c.cu").write_text("x" * 5000)
    (d / "notes.txt").write_text("not source")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    c = build_corpus(max_bytes=1000, sources=("cuda_toolkit",))
    assert c.stats.files["cuda_toolkit"] == 1 and c.stats.duplicates == 1 and c.stats.capped
    assert c.stats.total_bytes == len("__global__ void a() {}\n")
    assert "total" in c.stats.summary()
    out = save_corpus(c, tmp_path / "corpus.jsonl")
    assert out.read_text().count("\n") == 1


def test_real_toolkit_headers_when_installed():
    roots = [r for r in cuda_toolkit_roots() if r.is_dir()]
    if not roots:
        import pytest

        pytest.skip("no CUDA toolkit headers on this machine")
    assert any(p.suffix in (".h", ".cuh", ".hpp") for _, p in zip(range(50), source_files(roots[0])))
    c = build_corpus(max_bytes=2_000_000, sources=("cuda_toolkit",))
    assert c.stats.total_files > 10 and c.stats.total_bytes <= 2_000_000
