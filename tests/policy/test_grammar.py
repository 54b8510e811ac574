"""policy/grammar.py: the output grammar, the kernel language behind the contract header."""

import pytest

from sparserl_compile import contract
from sparserl_compile.policy.grammar import kernel_grammar
from sparserl_compile.policy.masks import grammar_accepts


def test_grammar_accepts_a_contract_kernel_and_rejects_others(tiny_tok, kernel_source):
    V = len(tiny_tok)
    assert grammar_accepts(tiny_tok, V, kernel_source)
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("format=csr", "format=foo"))
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("int n_cols, ", ""))  # wrong signature
    assert not grammar_accepts(tiny_tok, V, kernel_source.rstrip()[:-1])  # unbalanced brace
    # pinned to the prompt's op: an spmv kernel is not a sentence of the spmm grammar
    assert not grammar_accepts(tiny_tok, V, kernel_source, kernel_grammar("spmm", "f32"))


def test_grammar_without_a_format_rejects_its_kernels_only(tiny_tok, kernel_source):
    """``exclude=`` (the formats a matrix does not convert to) drops those formats' kernels from
    the language and keeps the rest."""
    from sparserl_compile import kernels

    V = len(tiny_tok)
    dia = kernels.render("dia", "spmv", "f32", {"block": 128}).source
    assert grammar_accepts(tiny_tok, V, dia, kernel_grammar("spmv", "f32"))
    no_dia = kernel_grammar("spmv", "f32", exclude=("dia",))
    assert not grammar_accepts(tiny_tok, V, dia, no_dia)
    assert grammar_accepts(tiny_tok, V, kernel_source, no_dia)  # the CSR kernel still is
    with pytest.raises(ValueError, match="name formats"):
        kernel_grammar("spmv", "f32", exclude=("diag",))
    with pytest.raises(ValueError, match="leave at least one"):
        kernel_grammar("spmv", "f32", exclude=tuple(contract.FORMATS))


def test_the_output_grammar_is_the_kernel_languages(tiny_tok, kernel_source, monkeypatch):
    """The policy writes the kernel language of ``grammar/kernel.lark``: statements its grammar
    has no rule for are not sentences, wherever they are; a kernel grammar without the rules the
    output grammar builds on is refused, naming them."""
    from sparserl_compile import language

    V, g = len(tiny_tok), kernel_grammar("spmv", "f32")
    assert grammar_accepts(tiny_tok, V, kernel_source, g)
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("float acc = 0.0f;", "float acc acc;"), g)
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("y[row] = acc;", "y[row] = = acc;"), g)
    no_helper = language.grammar().replace("helper:", "device_fn:")
    monkeypatch.setattr(language, "grammar", lambda: no_helper)
    with pytest.raises(RuntimeError, match="defines no rule helper"):
        kernel_grammar("spmv", "f32")
