"""The kernel language: its grammar (for constrained decoding) and the checks after parsing.

``grammar()`` returns ``grammar/kernel.lark``, the one written-down definition of the language
(header lines + helpers + one kernel) in llguidance's Lark dialect; the policy's decoder
constrains sampling with it, and the hand-written families are tested to parse under it.

``check(source)`` lists what a grammar cannot see: the header must parse
(``contract.parse_header``), the kernel's parameter list must be exactly
``contract.signature_c`` for the header's (op, format, dtype), only built-in functions and the
source's own helpers may be called, and forbidden constructs are named (``#include``/macros,
inline asm, ``printf``, clock reads, ``static``, templates outside ``nvcuda::wmma``,
``__device__``/``__constant__``/``__managed__`` globals, host API calls, comments). An empty
list means the source is in the language.

``accepts(source)`` runs the grammar over raw text with llguidance exactly as a decoder
would (an ``LLMatcher`` fed one byte per token through a 256-token byte tokenizer) and returns
a ``GrammarVerdict``.

This module does not compile (``compiler.py``) or run anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sparserl_compile import contract

GRAMMAR_PATH = Path(__file__).parent / "grammar" / "kernel.lark"

#: functions a kernel may call besides its own __device__ __forceinline__ helpers
BUILTINS = frozenset(
    """
    __ldg __shfl_sync __shfl_down_sync __shfl_xor_sync __shfl_up_sync __syncthreads __syncwarp
    atomicAdd min max fminf fmaxf fmaf fabsf sqrtf
    __half2float __float2half_rn __bfloat162float __float2bfloat16_rn
    __half22float2 __bfloat1622float2 __floats2half2_rn __floats2bfloat162_rn
    __float2half2_rn __float2bfloat162_rn
    __popc __ffs
    make_float2 make_float4 make_int2 make_int4
    nvcuda::wmma::fill_fragment nvcuda::wmma::load_matrix_sync nvcuda::wmma::mma_sync
    nvcuda::wmma::store_matrix_sync
    """.split()
)

_KEYWORDS = frozenset("if for while return sizeof reinterpret_cast switch".split())

_FORBIDDEN = (
    (re.compile(r"#"), "preprocessor directive (#include/#define/#pragma): the runtime prepends the allowed headers; macros are not allowed"),
    (re.compile(r"\b(asm|__asm__|__asm|volatile)\b"), "inline assembly is not allowed"),
    (re.compile(r"\b(printf|vprintf)\b"), "printf is not allowed in kernels"),
    (re.compile(r"\b(clock|clock64|__globaltimer|globaltimer|__nanosleep)\b"), "clock/timer reads are not allowed"),
    (re.compile(r"\bstatic\b"), "'static' is not allowed (no static state)"),
    (re.compile(r"\b(template|typename)\b"), "C++ templates are not allowed outside nvcuda::wmma fragments"),
    (re.compile(r"__device__(?!\s+__forceinline__)"), "__device__ is allowed only as '__device__ __forceinline__' helper functions (no __device__ globals)"),
    (re.compile(r"\b(__constant__|__managed__)"), "__constant__/__managed__ globals are not allowed"),
    (re.compile(r"\b(cuda[A-Z]\w*|cu[A-Z]\w*|malloc|free|new|delete|cudaStream_t)\b"), "host/runtime API calls and allocations are not allowed in kernels"),
    (re.compile(r"//|/\*"), "comments are not part of the kernel language (only the two header lines)"),
)

_SIG = re.compile(r'extern\s+"C"\s+__global__\s+void\s+sparserl_kernel\s*\(([^)]*)\)')
_HELPER = re.compile(r"__device__\s+__forceinline__\s+[\w\s\*]+?\b([A-Za-z_]\w*)\s*\(")
_CALL = re.compile(r"((?:nvcuda::wmma::)?[A-Za-z_]\w*)\s*\(")
_STRING = re.compile(r'"[^"\n]*"')


@lru_cache(maxsize=1)
def grammar() -> str:
    """The kernel language grammar (Lark text for ``llguidance.LLMatcher.grammar_from_lark``)."""
    return GRAMMAR_PATH.read_text()


def _body(source: str) -> str:
    """``source`` without its two header lines (check() reports a bad header separately)."""
    lines = source.lstrip().splitlines(keepends=True)
    return "".join(lines[2:])


def _norm(s: str) -> str:
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"\s*([*(),])\s*", r"\1", s)
    return s


def check(source: str) -> list[str]:
    """Violations of the kernel language that the grammar does not catch; [] when clean."""
    out: list[str] = []
    try:
        header = contract.parse_header(source)
    except contract.ContractError as e:
        header = None
        out.append(f"header: {e}")
    body = _body(source)
    for rx, why in _FORBIDDEN:
        m = rx.search(body)
        if m:
            out.append(f"forbidden: {why} (found {m.group(0)!r})")
    strings = [s for s in _STRING.findall(body) if s != '"C"']
    if strings:
        out.append(f"forbidden: string literals are not allowed (found {strings[0]})")
    if len(re.findall(r"\b__global__\b", body)) != 1:
        out.append('exactly one extern "C" __global__ function (sparserl_kernel) is allowed')
    sig = _SIG.search(body)
    if sig is None:
        out.append('no `extern "C" __global__ void sparserl_kernel(...)` found')
    elif header is not None:
        want = contract.signature_c(header.op, header.format, header.dtype)
        if _norm(sig.group(0)) != _norm(want):
            out.append(f"signature does not match the contract for op={header.op} format={header.format} "
                       f"dtype={header.dtype}: expected `{want}`, found `{' '.join(sig.group(0).split())}`")
    out.extend(_const_violations(body, header))
    helpers = set(_HELPER.findall(body))
    for name in sorted({m.group(1) for m in _CALL.finditer(body)}):
        if name in _KEYWORDS or name in BUILTINS or name in helpers or name == contract.KERNEL_NAME:
            continue
        if name.startswith("nvcuda::wmma::"):
            out.append(f"call to {name}: only fill_fragment/load_matrix_sync/mma_sync/store_matrix_sync are allowed")
            continue
        if _is_declaration(body, name):
            continue
        out.append(f"call to {name}(): not a built-in of the kernel language nor a helper defined here")
    return out


_C_PTR_CAST = re.compile(r"\(\s*(?:const\s+)?(?:unsigned\s+)?[A-Za-z_]\w*\s*\*+\s*\)\s*[A-Za-z_(&]")
_MUT_REINTERPRET = re.compile(r"reinterpret_cast\s*<\s*(?!const\b)[^>]*\*\s*>\s*\(\s*&?\s*([A-Za-z_]\w*)")


def _const_violations(body: str, header) -> list[str]:
    """Inputs are read-only: no C-style pointer casts, no const_cast, and a non-const
    ``reinterpret_cast`` only of the output ``y`` or of the kernel's own (shared/local) arrays."""
    out = []
    m = _C_PTR_CAST.search(body)
    if m:
        out.append(f"forbidden: C-style pointer casts (found {m.group(0)[:-1].strip()!r}); "
                   "use reinterpret_cast<const T*> for vector loads")
    if re.search(r"\bconst_cast\b", body):
        out.append("forbidden: const_cast (inputs are read-only)")
    if header is not None:
        inputs = {name for _, name in contract.signature(header.op, header.format, header.dtype)} - {"y"}
        for m in _MUT_REINTERPRET.finditer(body):
            if m.group(1) in inputs:
                out.append(f"forbidden: a writable reinterpret_cast of the input {m.group(1)!r} "
                           "(only y may be written)")
                break
    return out


def _is_declaration(body: str, name: str) -> bool:
    """True when ``name(`` only appears as the helper/kernel being declared (not called)."""
    return bool(re.search(r"__forceinline__[^;{]*\b" + re.escape(name) + r"\s*\(", body)) and not re.search(
        r"[=,(+\-*/]\s*" + re.escape(name) + r"\s*\(", body
    )


# ----------------------------------------------------------------------------- llguidance


@dataclass(frozen=True)
class GrammarVerdict:
    """Whether the grammar accepts a text, and where it stopped if not."""

    accepted: bool
    consumed: int  # bytes the grammar accepted before stopping
    error: str = ""


class _ByteTokenizer:
    """256 single-byte tokens plus an end-of-sequence token: the simplest tokenizer llguidance
    accepts, so grammar acceptance of raw text can be checked without a trained vocabulary."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<|eos|>"]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


@lru_cache(maxsize=1)
def _byte_matcher_parts():
    import llguidance

    raw = _ByteTokenizer()
    wrapper = llguidance.TokenizerWrapper(raw)
    tok = llguidance.LLTokenizer(wrapper, slices=[])
    return llguidance, tok, llguidance.LLMatcher.grammar_from_lark(grammar()), wrapper


def accepts(source: str) -> GrammarVerdict:
    """Run ``source`` through the grammar with llguidance, one byte per token."""
    llguidance, tok, g, _wrapper = _byte_matcher_parts()
    m = llguidance.LLMatcher(tok, g, log_level=0)
    if m.is_error():
        raise RuntimeError(f"llguidance refused grammar/kernel.lark: {m.get_error()}")
    data = source.encode()
    n = m.try_consume_tokens(list(data))
    if n < len(data):
        line = data[:n].count(b"\n") + 1
        ctx = data[max(0, n - 40):n + 20].decode(errors="replace")
        m.consume_token(data[n])  # puts the matcher's own reason into get_error()
        why = m.get_error().split("\n", 1)[0]
        return GrammarVerdict(False, n, f"rejected at byte {n} (line {line}): ...{ctx!r} {why}".rstrip())
    if not m.is_accepting():
        return GrammarVerdict(False, n, "text ended before the kernel was complete")
    return GrammarVerdict(True, n)
