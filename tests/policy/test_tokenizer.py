from sparserl_compile.policy.tokenizer import EOS, KERNEL, PAD, STRUCTURE, load_tokenizer, prompt_text, save_tokenizer


def test_special_tokens_have_fixed_ids(tiny_tok):
    assert [tiny_tok.convert_tokens_to_ids(t) for t in (PAD, EOS, STRUCTURE, KERNEL)] == [0, 1, 2, 3]
    assert tiny_tok.eos_token_id == 1 and tiny_tok.pad_token_id == 0


def test_roundtrip_and_prompt(tiny_tok, kernel_source):
    ids = tiny_tok.encode(kernel_source)
    assert tiny_tok.decode(ids) == kernel_source
    assert len(ids) < len(kernel_source) / 2  # BPE merges compress the CUDA text
    p = tiny_tok.encode(prompt_text("spmm", "f16", 32))
    assert p[0] == 2 and p[-1] == 3


def test_unseen_bytes_still_encode(tiny_tok):
    text = "ünïcödé \x01 tab\t"
    assert tiny_tok.decode(tiny_tok.encode(text)) == text


def test_save_load(tiny_tok, tmp_path, kernel_source):
    save_tokenizer(tiny_tok, tmp_path)
    t2 = load_tokenizer(tmp_path)
    assert t2.encode(kernel_source) == tiny_tok.encode(kernel_source)


def test_encode_cached_is_the_tokenizers_encoding_in_a_fresh_list(tiny_tok):
    from sparserl_compile.policy.tokenizer import encode_cached

    text = "// sparserl op=spmv format=csr dtype=f32 index=i32"
    a = encode_cached(tiny_tok, text)
    assert a == tiny_tok.encode(text)
    a.append(-1)  # the caller's list is its own
    assert encode_cached(tiny_tok, text) == tiny_tok.encode(text)

    class Slow:  # no Rust backend to key the memo by: encoded every time
        def encode(self, t):
            return [len(t)]

    assert encode_cached(Slow(), text) == [len(text)]
