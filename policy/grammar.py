"""The grammar the decoder constrains the policy to, in llguidance's Lark dialect.

``kernel_grammar()`` returns the output grammar: the two contract header lines
(``sparserl_compile/contract.py``) followed by one kernel in the kernel language. The kernel
language's grammar is owned by the runtime (``sparserl_compile/grammar/kernel.lark``, the same
file the hand-written families are tested against); when that file is installed it is used
as the kernel part. Without it, ``FALLBACK_KERNEL`` below is used: a deliberately loose
grammar (the fixed ``extern "C" __global__ void sparserl_kernel(...)`` shape, balanced braces
and parentheses, C tokens inside) that keeps decoding testable but rejects far less than the
real one. ``grammar_source()`` says which one is active.

This module only produces grammar text; ``decode.py`` compiles it with llguidance.
"""

from __future__ import annotations

from pathlib import Path

def _rx(text: str) -> str:
    """``text`` escaped for a /regex/ literal (Rust regex syntax)."""
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$/-\"#&~" else ch for ch in text)


def header_rules(op: str | None = None, dtype: str | None = None, exclude=()) -> str:
    """One alternative per (format, op, dtype): a terminal holding both header lines (so no
    stray whitespace can enter them), the format's helpers, and a terminal holding the fixed
    kernel signature (``contract.signature_c``). ``op``/``dtype`` pin the header to the
    prompt's operation and value type; the formats in ``exclude`` get no alternative (the
    matrix does not convert to them: ``sparserl_compile.formats.unfit_formats``)."""
    from sparserl_compile.contract import DTYPES, FORMATS, OPS, signature_c

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


FALLBACK_KERNEL = r'''
helpers: helper*
helper: DEVICE_HEAD IDENT "(" params? ")" block
params: param ("," param)*
param: ctoken+
block: "{" item* "}"
item: block | "(" item* ")" | ctoken | ";" | ","
ctoken: IDENT | NUMBER | OP | "[" | "]"
DEVICE_HEAD: /__device__ __forceinline__ [a-z_0-9 ]+ /
IDENT: /[A-Za-z_][A-Za-z_0-9]*/
NUMBER: /[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?[fuU]?/
OP: /(<<=|>>=|&&|\|\||==|!=|<=|>=|\+\+|--|\+=|-=|\*=|\/=|&=|\|=|\^=|<<|>>|->|::|[-+*\/%<>=!&|^~?:.])/
%ignore /[ \t\r\n]+/
'''


def runtime_grammar_path() -> Path | None:
    """``sparserl_compile/grammar/kernel.lark`` if the runtime ships it."""
    try:
        import sparserl_compile
    except ImportError:  # pragma: no cover
        return None
    p = Path(sparserl_compile.__file__).parent / "grammar" / "kernel.lark"
    return p if p.is_file() else None


def grammar_source() -> str:
    """``"runtime"`` or ``"fallback"``: which kernel grammar ``kernel_grammar()`` uses."""
    return "runtime" if runtime_grammar_path() else "fallback"


def _rename_start(lark: str, new: str) -> str:
    """The runtime grammar's ``start`` rule renamed so that ours can wrap it."""
    import re

    return re.sub(r"(?m)^(\s*\??)start(\s*:)", rf"\g<1>{new}\2", lark)


def kernel_grammar(op: str | None = None, dtype: str | None = None, use_fallback: bool = False,
                   exclude=()) -> str:
    """The full output grammar as Lark text for llguidance: for one of the formats, its header
    line 1, header line 2, optional helpers, the format's fixed signature, the kernel body.
    ``op``/``dtype`` (the prompt's) pin the header; None allows any. ``exclude``: formats left
    out (``header_rules``)."""
    p = None if use_fallback else runtime_grammar_path()
    exclude = tuple(sorted(exclude))
    if p is None:
        return "start: kernel_file\n" + header_rules(op, dtype, exclude) + FALLBACK_KERNEL
    # The runtime grammar is expected to define `helper` (a __device__ function) and `block`
    # (a braced body); its own start rule is renamed away. TODO(lead): confirm these names
    # once sparserl_compile/grammar/kernel.lark lands.
    return ("start: kernel_file\n" + header_rules(op, dtype, exclude) + "helpers: helper*\n"
            + _rename_start(p.read_text(), "kernel_unit"))
