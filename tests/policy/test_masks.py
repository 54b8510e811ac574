"""policy/masks.py: llguidance's token masks as the decoder keeps and applies them."""

import torch

from sparserl_compile.policy.masks import unpack_masks


def test_unpack_masks_matches_bits():
    packed = torch.tensor([[0b1011, 0], [0, 1 << 3]], dtype=torch.int32)
    m = unpack_masks(packed, 40)
    assert m[0].nonzero().flatten().tolist() == [0, 1, 3]
    assert m[1].nonzero().flatten().tolist() == [35]


def test_the_decoders_token_bitmask_is_llguidances(tiny_tok):
    """``token_bitmask``/``fill_token_bitmask`` (the decoder's, which spare a process importing
    ``llguidance.torch`` and with it inductor) hold what llguidance's own helpers write, row by
    row, along a prefix of the grammar."""
    import llguidance.torch as llt

    from sparserl_compile.policy.masks import fill_token_bitmask, make_matcher, token_bitmask

    vocab = len(tiny_tok)
    ours, theirs = token_bitmask(3, vocab), llt.allocate_token_bitmask(3, vocab)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.int32
    assert torch.equal(ours, theirs)  # all allowed before any fill
    a, b = make_matcher(tiny_tok, vocab, None, "spmv", "f32"), make_matcher(tiny_tok, vocab, None, "spmv", "f32")
    for row, tok in enumerate(tiny_tok.encode("// sparserl op=spmv")[:3]):
        fill_token_bitmask(a, ours, row)
        llt.fill_next_token_bitmask(b, theirs, row)
        assert a.consume_token(tok) and b.consume_token(tok)
    assert torch.equal(ours, theirs) and not torch.equal(ours[0], torch.full_like(ours[0], -1))
