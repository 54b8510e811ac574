"""Kernel source -> one C++ translation unit for the CPU executor.

``prepare(source, guarded=...)`` reads a kernel written in the kernel language (DESIGN.md,
"Generated code contract"), refuses anything outside it with ``SimtRefused`` naming the
construct, checks the parameter list against ``contract.signature``, and rewrites the few
things plain C++ cannot express:

* ``__shared__`` declarations become views of the block's shared memory (allocated per block
  by the runtime, static and ``extern`` dynamic alike);
* every loop condition is prefixed with ``simt_tick()``, which counts iterations for the step
  and time limits;
* ``#pragma unroll`` is dropped and ``extern "C"`` removed (the runtime calls the kernel);
* comments (the two header lines) are blanked, so kernels that differ only in their header's
  format parameters (the launch record carries everything the header says) build once;
* in guarded mode, every pointer type ``T*`` becomes the bounds-checked ``GPtr<T>`` (pointer
  casts through ``reinterpret_cast``/``static_cast`` become ``simt_cast``), one-dimensional
  shared arrays become race-checked ``SArr<T>`` and one-dimensional local arrays
  bounds-checked ``LArr<T, N, id>``.

Newlines are kept in place, so g++'s line numbers (behind a ``#line 1`` directive) are the
kernel's own. The rewriter is a tokenizer plus a handful of patterns, not a C++ parser: it
supports the kernel language as written by the families and the grammar; constructs it does
not recognise (multi-dimensional arrays in guarded mode, several declarators with pointers
in one declaration) are left unchecked or fail to compile, never silently mis-translated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sparserl_compile import contract
from sparserl_compile.simt.errors import SimtRefused

_TOKEN = re.compile(
    r"""
    (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<ws>\s+)
  | (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<number>(?:\d|\.\d)(?:[\w.]|[eEpP][+-])*)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<punct><<=|>>=|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||::|[-+*/%=&|^!~<>?:;,.(){}\[\]#\\])
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass
class Tok:
    kind: str
    text: str
    line: int
    pre: str = ""
    post: str = ""
    gen: bool = False  # generated text: opaque to later passes

    def out(self) -> str:
        return self.pre + self.text + self.post


def tokenize(source: str) -> list[Tok]:
    """Tokens including whitespace and comments; preprocessor lines are one ``pp`` token."""
    toks: list[Tok] = []
    pos, line, n = 0, 1, len(source)
    while pos < n:
        if source[pos] == "#" and source[source.rfind("\n", 0, pos) + 1:pos].strip() == "":
            m = _PP.match(source, pos)
            toks.append(Tok("pp", m.group(0), line))
            line += m.group(0).count("\n")
            pos = m.end()
            continue
        m = _TOKEN.match(source, pos)
        if not m:
            raise SimtRefused("a character C++ cannot read", source[pos], line)
        toks.append(Tok(m.lastgroup, m.group(0), line))
        line += m.group(0).count("\n")
        pos = m.end()
    return toks


_PP = re.compile(r"#(?:[^\n\\]|\\.)*", re.DOTALL)


# --------------------------------------------------------------------------- language check

_FENCE = "memory fences (__threadfence*)"
_REFUSED: dict[str, str] = {
    **dict.fromkeys(("asm", "__asm__", "__asm"), "inline assembly"),
    **dict.fromkeys(("clock", "clock64", "__clock", "__globaltimer", "globaltimer"), "clock read"),
    "printf": "printf",
    **dict.fromkeys(("template", "typename"), "C++ templates"),
    "static": "static storage (state kept between threads or launches)",
    "__constant__": "__constant__ memory",
    "__managed__": "managed memory",
    "goto": "goto",
    **dict.fromkeys(("new", "delete", "malloc", "free", "cudaMalloc", "cudaFree"), "memory allocation"),
    **dict.fromkeys(("__shfl", "__shfl_up", "__shfl_down", "__shfl_xor"),
                    "a warp shuffle without _sync (use __shfl_*_sync)"),
    **dict.fromkeys(("__ballot_sync", "__any_sync", "__all_sync", "__activemask", "__match_any_sync",
                     "__match_all_sync", "__reduce_add_sync", "__ballot", "__any", "__all"),
                    "warp vote/match intrinsics"),
    **dict.fromkeys(("cooperative_groups", "this_thread_block", "tiled_partition", "grid_group"),
                    "cooperative groups"),
    **dict.fromkeys(("tex1Dfetch", "tex1D", "tex2D", "tex3D", "texture", "surf2Dread", "surf2Dwrite",
                     "cudaTextureObject_t"), "textures/surfaces"),
    **dict.fromkeys(("__threadfence", "__threadfence_block", "__threadfence_system"), _FENCE),
    "__nanosleep": "__nanosleep",
    **dict.fromkeys(("__syncthreads_count", "__syncthreads_and", "__syncthreads_or"),
                    "barriers with a reduction"),
    **dict.fromkeys(("namespace", "using", "class", "struct", "union", "typedef", "enum", "operator"),
                    "type or namespace definitions"),
    **dict.fromkeys(("atomicCAS", "atomicExch", "atomicMax", "atomicMin", "atomicSub", "atomicAnd",
                     "atomicOr", "atomicXor", "atomicInc", "atomicDec"), "atomics other than atomicAdd"),
    **dict.fromkeys(("throw", "try", "catch"), "exceptions"),
    "std": "the C++ standard library",
    **dict.fromkeys(("__trap", "assert", "__brkpt"), "traps and assertions"),
    **dict.fromkeys(("cudaDeviceSynchronize", "cudaMemcpy", "cudaLaunchKernel"), "host API calls"),
}
_CALL_ONLY = {"clock", "clock64", "malloc", "free", "assert", "globaltimer"}

SYNC_NAMES = frozenset({"__syncthreads", "__syncwarp", "__shfl_sync", "__shfl_up_sync",
                        "__shfl_down_sync", "__shfl_xor_sync",
                        "load_matrix_sync", "store_matrix_sync", "mma_sync"})  # wmma: warp-collective

TYPE_WORDS = frozenset({
    "int", "unsigned", "signed", "long", "short", "char", "float", "double", "bool",
    "__half", "half", "__nv_bfloat16", "nv_bfloat16", "__half2", "half2", "__nv_bfloat162",
    "nv_bfloat162", "int2", "int4", "float2", "float4", "double2", "uint3", "size_t",
})
_QUALS = frozenset({"const", "volatile"})


def _sig(toks: list[Tok]) -> list[int]:
    return [i for i, t in enumerate(toks) if t.kind not in ("ws", "comment") and t.text != ""]


def check_language(toks: list[Tok]) -> None:
    """Raise ``SimtRefused`` for the first construct outside the kernel language."""
    sig = _sig(toks)
    for pos, i in enumerate(sig):
        t = toks[i]
        if t.kind == "pp":
            body = t.text.strip()[1:].strip()
            if re.fullmatch(r"pragma\s+unroll(\s+\d+|\s*\(\s*\d+\s*\))?", body):
                continue
            word = body.split()[0] if body.split() else "#"
            raise SimtRefused(f"a preprocessor directive (#{word})", t.text.strip(), t.line)
        if t.kind == "ident" and t.text in _REFUSED:
            nxt = toks[sig[pos + 1]].text if pos + 1 < len(sig) else ""
            if t.text in _CALL_ONLY and nxt != "(":
                continue
            raise SimtRefused(_REFUSED[t.text], t.text, t.line)
        if t.text == "<<" and pos + 1 < len(sig) and toks[sig[pos + 1]].text == "<":
            raise SimtRefused("a kernel launch (<<<...>>>)", "<<<", t.line)
    # file-scope statements: functions (with a body or a prototype) only
    depth, start = 0, 0
    for pos, i in enumerate(sig):
        x = toks[i].text
        if x == "{":
            if depth == 0:
                if not any(toks[sig[k]].text == "(" for k in range(start, pos)):
                    raise SimtRefused("a block at file scope", "{", toks[i].line)
            depth += 1
        elif x == "}":
            depth -= 1
            if depth == 0:
                start = pos + 1
        elif x == ";" and depth == 0:
            words = [toks[sig[k]].text for k in range(start, pos)]
            if "(" not in words and words:
                raise SimtRefused("a file-scope variable (__device__ global state)", " ".join(words),
                                  toks[sig[start]].line)
            start = pos + 1


# --------------------------------------------------------------------------- rewriting


@dataclass
class Prepared:
    """The rewritten kernel, ready for the build (see ``build.py``)."""

    source: str                    # the original kernel source
    body: str                      # the rewritten kernel (same line numbers)
    header: contract.KernelHeader
    params: list[tuple[str, str]]  # contract signature: (C type, name)
    guarded: bool
    uses_fibers: bool
    array_names: dict[int, str] = field(default_factory=dict)  # fault array id -> name


def _match(toks: list[Tok], sig: list[int], pos: int, open_: str, close: str) -> int:
    """Position in ``sig`` of the bracket closing the one at ``sig[pos]``."""
    depth = 0
    for p in range(pos, len(sig)):
        x = toks[sig[p]].text
        if x == open_:
            depth += 1
        elif x == close:
            depth -= 1
            if depth == 0:
                return p
    raise SimtRefused(f"an unbalanced {open_!r}", open_, toks[sig[pos]].line)


def _blank(toks: list[Tok], i: int, j: int, text: str) -> None:
    """Replace tokens i..j (inclusive, raw indices) by ``text``, keeping their newlines."""
    nl = sum(toks[k].out().count("\n") for k in range(i, j + 1))
    for k in range(i, j + 1):
        toks[k].text, toks[k].pre, toks[k].post = "", "", ""
    toks[i].text = text + "\n" * nl
    toks[i].gen = True


def _stmt_start(toks: list[Tok], sig: list[int], pos: int) -> int:
    p = pos
    while p > 0 and toks[sig[p - 1]].text not in (";", "{", "}") and not toks[sig[p - 1]].gen:
        p -= 1
    return p


def _check_signature(toks: list[Tok], sig: list[int], header: contract.KernelHeader) -> None:
    want = contract.signature(header.op, header.format, header.dtype)
    names = [p for p, i in enumerate(sig) if toks[i].text == contract.KERNEL_NAME]
    if not names:
        raise contract.ContractError(f"no function named {contract.KERNEL_NAME}")
    pos = names[0]
    if pos + 1 >= len(sig) or toks[sig[pos + 1]].text != "(":
        raise contract.ContractError(f"{contract.KERNEL_NAME} must be followed by its parameter list")
    end = _match(toks, sig, pos + 1, "(", ")")
    params, cur = [], []
    for p in range(pos + 2, end):
        x = toks[sig[p]].text
        if x == ",":
            params.append(cur)
            cur = []
        else:
            cur.append(x)
    if cur:
        params.append(cur)

    def norm(words: list[str]) -> str:
        return "".join(w for w in words if w not in ("__restrict__", "__restrict"))

    got = [(norm(p[:-1]), p[-1]) for p in params]
    if len(got) != len(want):
        raise contract.ContractError(
            f"{contract.KERNEL_NAME} has {len(got)} parameters; the contract for op={header.op} "
            f"format={header.format} dtype={header.dtype} has {len(want)}: "
            f"{contract.signature_c(header.op, header.format, header.dtype)}")
    for k, ((gt, gn), (wt, wn)) in enumerate(zip(got, want)):
        if gt != norm(wt.split()).replace(" ", ""):
            raise contract.ContractError(
                f"parameter {k + 1} ({gn}) has type {gt!r}; the contract says '{wt} {wn}'")


def _rewrite_shared(toks: list[Tok], guarded: bool, names: dict[int, str]) -> None:
    sig = _sig(toks)
    count = 0
    for pos, i in enumerate(sig):
        if toks[i].text != "__shared__" or toks[i].gen:
            continue
        start = _stmt_start(toks, sig, pos)
        end = pos
        while end < len(sig) and toks[sig[end]].text != ";":
            end += 1
        words, p = [], start
        is_extern = False
        while p < end:
            x = toks[sig[p]].text
            if x == "extern":
                is_extern = True
            elif x == "__align__" and p + 1 < end and toks[sig[p + 1]].text == "(":
                p = _match(toks, sig, p + 1, "(", ")")
            elif x not in ("__shared__", "volatile"):
                words.append(x)
            p += 1
        # words: TYPE... NAME [dims] (, NAME [dims])*
        out = []
        k = 0
        while k < len(words) and not (k + 1 < len(words) and words[k + 1] == "[") and words[k] != ",":
            k += 1
        ctype = " ".join(words[:k])
        if not ctype or k >= len(words):
            raise SimtRefused("a __shared__ declaration this executor cannot read", " ".join(words), toks[i].line)
        while k < len(words):
            name = words[k]
            k += 1
            dims = []
            while k < len(words) and words[k] == "[":
                j = k + 1
                depth = 1
                while depth:
                    depth += {"[": 1, "]": -1}.get(words[j], 0)
                    j += 1
                dims.append(" ".join(words[k + 1:j - 1]))
                k = j
            if k < len(words) and words[k] == ",":
                k += 1
            elif k < len(words):
                raise SimtRefused("an initialised or unusual __shared__ declaration", " ".join(words), toks[i].line)
            if is_extern:
                names[64] = name
                if guarded:
                    out.append(f"SArr<{ctype}> {name} = simt_dynamic_shared<{ctype}>()")
                else:
                    out.append(f"{ctype}* {name} = ({ctype}*)simt_dynamic_shared_raw()")
                continue
            if count >= 64:
                raise SimtRefused("more than 64 __shared__ arrays", name, toks[i].line)
            sid = count
            count += 1
            names[65 + sid] = name
            if not dims or any(d == "" for d in dims):
                raise SimtRefused("a __shared__ scalar or unsized array", name, toks[i].line)
            if guarded and len(dims) == 1:
                out.append(f"SArr<{ctype}> {name} = simt_static_shared<{ctype}>({sid}, (long long)({dims[0]}))")
            else:
                d = "".join(f"[{x}]" for x in dims)
                out.append(
                    f"{ctype} (&{name}){d} = *({ctype} (*){d})simt_static_shared_raw({sid}, "
                    f"(long long)sizeof({ctype}{d}), (long long)alignof({ctype}))")
        _blank(toks, sig[start], sig[end - 1], "; ".join(out))


def _rewrite_local_arrays(toks: list[Tok], names: dict[int, str]) -> None:
    sig = _sig(toks)
    count = 0
    for pos in range(len(sig)):
        i = sig[pos]
        if toks[i].gen or toks[i].text not in TYPE_WORDS and toks[i].text not in _QUALS:
            continue
        if pos > 0 and toks[sig[pos - 1]].text not in (";", "{", "}") and not toks[sig[pos - 1]].gen:
            continue
        p = pos
        while p < len(sig) and (toks[sig[p]].text in TYPE_WORDS or toks[sig[p]].text in _QUALS):
            p += 1
        if p + 1 >= len(sig) or toks[sig[p]].kind != "ident" or toks[sig[p + 1]].text != "[":
            continue
        close = _match(toks, sig, p + 1, "[", "]")
        if close + 1 < len(sig) and toks[sig[close + 1]].text not in (";", "="):
            continue  # multi-dimensional or several declarators: left unchecked
        ctype = " ".join(toks[sig[k]].text for k in range(pos, p))
        name = toks[sig[p]].text
        extent = " ".join(toks[sig[k]].text for k in range(p + 2, close))
        lid = 130 + count
        count += 1
        names[lid] = name
        _blank(toks, sig[pos], sig[close], f"LArr<{ctype}, (long long)({extent}), {lid}> {name}")


def _rewrite_casts(toks: list[Tok]) -> None:
    sig = _sig(toks)
    for pos, i in enumerate(sig):
        if toks[i].text in ("reinterpret_cast", "static_cast") and pos + 1 < len(sig) and toks[sig[pos + 1]].text == "<":
            close = pos + 1
            depth = 0
            for p in range(pos + 1, len(sig)):
                x = toks[sig[p]].text
                depth += {"<": 1, ">": -1}.get(x, 0)
                if depth == 0:
                    close = p
                    break
            if toks[sig[close - 1]].text == "*":
                toks[i].text = "simt_cast"


def _rewrite_pointers(toks: list[Tok]) -> None:
    sig = _sig(toks)
    for pos, i in enumerate(sig):
        if toks[i].text != "*" or pos == 0:
            continue
        p = pos - 1
        while p >= 0 and not toks[sig[p]].gen and (toks[sig[p]].text in TYPE_WORDS or toks[sig[p]].text in _QUALS):
            p -= 1
        first = p + 1
        words = [toks[sig[k]].text for k in range(first, pos)]
        if not any(w in TYPE_WORDS for w in words):
            continue
        # `a * b` where a is a type word cannot happen in the language; `x[i] * float(...)` can't either
        after = pos + 1
        const_ptr = False
        while after < len(sig) and toks[sig[after]].text in ("__restrict__", "__restrict", "const"):
            const_ptr |= toks[sig[after]].text == "const"
            after += 1
        text = ("const " if const_ptr else "") + f"GPtr<{' '.join(words)}> "
        for k in range(first, after):
            toks[sig[k]].text = ""
        toks[sig[first]].text = text


def _rewrite_loops(toks: list[Tok]) -> None:
    sig = _sig(toks)
    for pos, i in enumerate(sig):
        x = toks[i].text
        if x not in ("for", "while") or toks[i].gen or pos + 1 >= len(sig) or toks[sig[pos + 1]].text != "(":
            continue
        close = _match(toks, sig, pos + 1, "(", ")")
        if x == "while":
            if close == pos + 2:
                continue
            toks[sig[pos + 2]].pre = "simt_tick() && (" + toks[sig[pos + 2]].pre
            toks[sig[close - 1]].post += ")"
            continue
        semis, depth = [], 0
        for p in range(pos + 1, close + 1):
            y = toks[sig[p]].text
            depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(y, 0)
            if y == ";" and depth == 1:
                semis.append(p)
        if len(semis) != 2:
            raise SimtRefused("a for statement without two ';' in its header", "for", toks[i].line)
        a, b = semis
        if b == a + 1:
            toks[sig[a]].post += " simt_tick() "
        else:
            toks[sig[a + 1]].pre = "simt_tick() && (" + toks[sig[a + 1]].pre
            toks[sig[b - 1]].post += ")"


def prepare(source: str, *, guarded: bool = True) -> Prepared:
    """Check ``source`` against the kernel language and the contract, and rewrite it."""
    header = contract.parse_header(source)
    toks = tokenize(source)
    check_language(toks)
    sig = _sig(toks)
    _check_signature(toks, sig, header)
    uses_fibers = any(toks[i].text in SYNC_NAMES for i in sig)
    for t in toks:  # the header comments: kernels that differ only there share one build
        if t.kind == "comment":
            t.text = "\n" * t.text.count("\n")
    for p, i in enumerate(sig):
        t = toks[i]
        if t.kind == "pp":
            t.text = ""
        elif t.text == "extern" and p + 1 < len(sig) and toks[sig[p + 1]].text == '"C"':
            t.text = ""
            toks[sig[p + 1]].text = ""
    names: dict[int, str] = {}
    _rewrite_shared(toks, guarded, names)
    if guarded:
        _rewrite_local_arrays(toks, names)
        _rewrite_casts(toks)
        _rewrite_pointers(toks)
    _rewrite_loops(toks)
    body = "".join(t.out() for t in toks)
    params = contract.signature(header.op, header.format, header.dtype)
    for k, (_, n) in enumerate(params):
        names[k] = n
    return Prepared(source, body, header, params, guarded, uses_fibers, names)
