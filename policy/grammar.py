"""The grammar the decoder constrains the policy to, in llguidance's Lark dialect.

``kernel_grammar()`` returns the output grammar: the two contract header lines
(``sparserl_compile/contract.py``) followed by one kernel in the kernel language. There is one
kernel grammar: ``sparserl_compile/grammar/kernel.lark`` (``language.GRAMMAR_PATH``), the file
the hand-written families are tested against. The policy's grammar reuses its ``helper`` and
``block`` rules and replaces its loose header terminals and parameter list with tighter ones:
a header pinned to the prompt's op and dtype, per-format parameter keys, and the exact
signature ``contract.signature_c`` gives for the chosen format, so every sampled kernel has the
signature its header promises.

This module only produces grammar text; ``decode.py`` compiles it with llguidance.
"""

from __future__ import annotations

import re

from sparserl_compile import language
from sparserl_compile.contract import DTYPES, FORMATS, OPS, signature_c

# The kernel grammar's rules that the output grammar is built from.
_REUSED_RULES = ("helper", "block")


def _rx(text: str) -> str:
    """``text`` escaped for a /regex/ literal (Rust regex syntax)."""
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$/-\"#&~" else ch for ch in text)


def header_rules(op: str | None = None, dtype: str | None = None, exclude=()) -> str:
    """One alternative per (format, op, dtype): a terminal holding both header lines (so no
    stray whitespace can enter them), the format's helpers, and a terminal holding the fixed
    kernel signature (``contract.signature_c``). ``op``/``dtype`` pin the header to the
    prompt's operation and value type; the formats in ``exclude`` get no alternative (the
    matrix does not convert to them: ``sparserl_compile.formats.unfit_formats``)."""
    unknown = set(exclude) - set(FORMATS)
    if unknown or not set(FORMATS) - set(exclude):
        raise ValueError(f"exclude={sorted(exclude)}: name formats of {tuple(FORMATS)}, and leave at least one")

    ops = [op] if op else list(OPS)
    dts = [dtype] if dtype else list(DTYPES)
    alts, rules = [], []
    num = "[0-9]{1,7}"
    pos = "[1-9][0-9]{0,6}"
    smem = "(0|[1-9][0-9]{0,4}|1[0-9]{5}|2[0-2][0-9]{4})"  # < 230000 bytes: under the 227 KiB limit
    for fmt, f in FORMATS.items():
        if fmt in exclude:
            continue
        keys = "".join(f" {k}={pos}" for k in f.params)
        work = "(" + "|".join(f.work) + ")"
        for o in ops:
            for d in dts:
                name = f"{o}_{fmt}_{d}".upper()
                line1 = _rx(f"// sparserl op={o} format={fmt} dtype={d} index=i32") + keys + "\\n"
                tail = (f"tile_n={num} smem={smem} zero_output=[01] n_align=[1248]" if o == "spmm"
                        else f"tile_n=0 smem={smem} zero_output=[01] n_align=1")  # contract: spmv has no tile_n/n_align
                line2 = (_rx("// launch ") + "block=(32|64|96|128|192|256|384|512|768|1024) "
                         + f"work={work} per_block={pos} " + tail + "\\n")
                rules.append(f"HEAD_{name}: /{line1}{line2}/\n")
                rules.append(f"SIG_{name}: /{_rx(signature_c(o, fmt, d))}/\n")
                rules.append(f"k_{name.lower()}: HEAD_{name} helpers SIG_{name} block\n")
                alts.append(f"k_{name.lower()}")
    return "kernel_file: " + " | ".join(alts) + "\n" + "".join(rules)


def _kernel_rules() -> str:
    """``kernel.lark`` with its ``start`` rule renamed away (ours wraps it), after checking that
    it defines the rules the output grammar refers to."""
    text = language.grammar()
    missing = [r for r in _REUSED_RULES if not re.search(rf"(?m)^\s*\??{r}\s*:", text)]
    if missing:
        raise RuntimeError(f"{language.GRAMMAR_PATH} defines no rule {', '.join(missing)}: the policy's "
                           f"output grammar needs {', '.join(_REUSED_RULES)} (a __device__ helper and a "
                           "braced kernel body); restore them or update policy/grammar.py")
    return re.sub(r"(?m)^(\s*\??)start(\s*:)", r"\g<1>kernel_unit\2", text)


def kernel_grammar(op: str | None = None, dtype: str | None = None, exclude=()) -> str:
    """The full output grammar as Lark text for llguidance: for one of the formats, its header
    line 1, header line 2, optional helpers, the format's fixed signature, the kernel body.
    ``op``/``dtype`` (the prompt's) pin the header; None allows any. ``exclude``: formats left
    out (``header_rules``)."""
    exclude = tuple(sorted(exclude))
    return ("start: kernel_file\n" + header_rules(op, dtype, exclude) + "helpers: helper*\n"
            + _kernel_rules())
