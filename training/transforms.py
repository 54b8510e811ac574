"""Textual transformations of kernel sources that stay inside the kernel grammar, and the
rendering of a variant (a kernel-space point's source, then its transforms).

The transforms are described in ``variants.py``, which generates and verifies variants with
them; this module is text only (no records, no evaluators), so ``space.default_render`` can
render a variant without importing the generation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product

#: the single transforms, in the order ``transform_names`` tries them
TRANSFORMS = ("unroll2", "unroll4", "while", "fma_expand", "plain_loads", "split_acc", "shfl_xor", "prefetch")

#: the transforms that restructure a loop: a combination takes one of them, then one of the others
_LOOP_TRANSFORMS = ("unroll2", "unroll4", "while", "split_acc", "prefetch")

_NO_UNROLL = re.compile(r"\b(break|continue|return|__syncthreads|__syncwarp)\b|_sync\s*\(")


def _close(s: str, i: int) -> int:
    """Index of the bracket closing the one at ``s[i]`` (``(`` or ``{``); -1 if none."""
    pair = {"(": ")", "{": "}"}[s[i]]
    depth = 0
    for j in range(i, len(s)):
        if s[j] == s[i]:
            depth += 1
        elif s[j] == pair:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _split_top(s: str, sep: str) -> list[str]:
    """``s`` split at ``sep`` outside brackets."""
    out, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth == 0:
            out.append(s[start:j])
            start = j + 1
    return out + [s[start:]]


@dataclass(frozen=True)
class _Loop:
    start: int  # index of "for"
    end: int  # index after the body's closing brace
    var: str
    init: str  # the init clause as written ("" when empty)
    bound: str
    step: int
    body: str  # inside the braces


_INIT = re.compile(r"^\s*(?:(int|unsigned|long long)\s+)?([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", re.S)
_STEP = re.compile(r"^\s*(?:\+\+\s*(\w+)|(\w+)\s*\+\+|(\w+)\s*\+=\s*(\d+))\s*$")


def _loops(src: str) -> list[_Loop]:
    """The ``for`` loops of ``src`` with a braced body, a ``v < bound`` condition and a constant
    positive step, innermost (no ``for`` in the body) only."""
    out = []
    for m in re.finditer(r"\bfor\s*\(", src):
        p = m.end() - 1
        q = _close(src, p)
        parts = _split_top(src[p + 1:q], ";") if q > 0 else []
        b = q + 1
        while 0 < b < len(src) and src[b].isspace():
            b += 1
        if len(parts) != 3 or b >= len(src) or src[b] != "{":
            continue
        e = _close(src, b)
        step = _STEP.match(parts[2])
        if e < 0 or not step:
            continue
        var = step.group(1) or step.group(2) or step.group(3)
        cond = re.match(rf"^\s*{re.escape(var)}\s*<\s*(.+?)\s*$", parts[1], re.S)
        init = _INIT.match(parts[0]) if parts[0].strip() else None
        if not cond or (parts[0].strip() and (not init or init.group(2) != var)):
            continue
        body = src[b + 1:e]
        if re.search(r"\bfor\b", body):
            continue
        out.append(_Loop(m.start(), e + 1, var, parts[0].strip(), cond.group(1), int(step.group(4) or 1), body))
    return out


def _assigns(body: str, var: str) -> bool:
    v = re.escape(var)
    return bool(re.search(rf"(?<![\w.]){v}\s*([-+*/%&|^]|<<|>>)?=(?!=)|(\+\+|--)\s*{v}\b|(?<![\w.]){v}\s*(\+\+|--)",
                          body))


def _shift(body: str, var: str, by: int) -> str:
    """``body`` with the loop variable read ``by`` ahead."""
    return re.sub(rf"(?<![\w.]){re.escape(var)}\b", f"({var} + {by})", body) if by else body


def unroll(src: str, factor: int) -> str | None:
    """The first eligible innermost loop unrolled ``factor`` times (module docstring); None
    when no loop is eligible."""
    for lp in _loops(src):
        if _NO_UNROLL.search(lp.body) or _assigns(lp.body, lp.var):
            continue
        v, s = lp.var, lp.step
        copies = "\n".join("{" + _shift(lp.body, v, j * s) + "}" for j in range(factor))
        main = f"for (; {v} + {(factor - 1) * s} < {lp.bound}; {v} += {factor * s}) {{\n{copies}\n}}\n"
        rest = f"for (; {v} < {lp.bound}; {v} += {s}) {{{lp.body}}}"
        # the init (a declaration, or an assignment to a variable declared before) opens a block
        # that both loops share; without one the loops continue the enclosing block's variable
        text = f"{{\n{lp.init};\n{main}{rest}\n}}" if lp.init else main + rest
        return src[:lp.start] + text + src[lp.end:]
    return None


def as_while(src: str) -> str | None:
    """The first innermost loop without ``continue`` written as a ``while`` loop; None when none."""
    for lp in _loops(src):
        if re.search(r"\bcontinue\b", lp.body):
            continue
        inc = f"{lp.var} += {lp.step};"
        init = f"{lp.init};\n" if lp.init else ""
        text = f"{{\n{init}while ({lp.var} < {lp.bound}) {{{lp.body}\n{inc}\n}}\n}}"
        return src[:lp.start] + text + src[lp.end:]
    return None


def _rewrite_calls(src: str, name: str, fn) -> str | None:
    """Every call ``name(args)`` replaced by ``fn(args)`` (``fn`` returns None to keep one);
    None when nothing changed. Nested calls are rewritten inside out."""
    out, i, changed = [], 0, False
    for m in re.finditer(rf"(?<![\w:]){re.escape(name)}\s*\(", src):
        if m.start() < i:
            continue  # inside a call already rewritten
        p = m.end() - 1
        q = _close(src, p)
        if q < 0:
            return None
        inner = src[p + 1:q]
        inner = _rewrite_calls(inner, name, fn) or inner
        new = fn(_split_top(inner, ","))
        out.append(src[i:m.start()])
        out.append(new if new is not None else f"{name}({inner})")
        changed |= new is not None
        i = q + 1
    return "".join(out) + src[i:] if changed else None


def fma_expand(src: str) -> str | None:
    """``fmaf(a, b, c)`` -> ``((a) * (b) + (c))``; None when there is no ``fmaf``."""
    return _rewrite_calls(src, "fmaf", lambda a: f"(({a[0].strip()}) * ({a[1].strip()}) + ({a[2].strip()}))"
                          if len(a) == 3 else None)


def plain_loads(src: str) -> str | None:
    """``__ldg(&e)`` -> ``(e)``; None when there is none."""
    return _rewrite_calls(src, "__ldg", lambda a: f"({a[0].strip()[1:].strip()})"
                          if len(a) == 1 and a[0].strip().startswith("&") else None)


# ------------------------------------------------------------------ transforms of the computation


def _fresh(src: str, base: str) -> str:
    """A name made from ``base`` that does not occur in ``src``."""
    for i in range(1, 1000):
        name = f"{base}_{i}"
        if not re.search(rf"\b{name}\b", src):
            return name
    raise ValueError(f"no fresh name for {base!r}")


def _call_args(s: str, i: int) -> tuple[list[str], int] | None:
    """The top-level arguments of the call whose ``(`` is at ``s[i]`` and the index after its ``)``."""
    q = _close(s, i)
    return (_split_top(s[i + 1:q], ","), q + 1) if q > 0 else None


_ADD_ACC = re.compile(r"(?<![\w.>])([A-Za-z_]\w*)\s*\+=\s*")
_FMA_ACC = re.compile(r"(?<![\w.>])([A-Za-z_]\w*)\s*=\s*fmaf\s*\(")


def _accumulations(body: str) -> dict[str, int]:
    """Scalar names that ``body`` accumulates into (``a += e;`` or ``a = fmaf(x, y, a);`` with
    ``e``, ``x``, ``y`` not reading ``a``) mapped to how many times those statements name them."""
    uses: dict[str, int] = {}
    bad: set[str] = set()

    def count(name: str, ok: bool, n: int) -> None:
        if ok:
            uses[name] = uses.get(name, 0) + n
        else:
            bad.add(name)

    for m in _ADD_ACC.finditer(body):
        end = body.find(";", m.end())
        e = body[m.end():end]
        count(m.group(1), end > 0 and not re.search(rf"\b{m.group(1)}\b", e) and e.count("(") == e.count(")"), 1)
    for m in _FMA_ACC.finditer(body):
        name, (args, after) = m.group(1), _call_args(body, m.end() - 1) or ([], 0)
        count(name, len(args) == 3 and args[2].strip() == name and re.match(r"\s*;", body[after:]) is not None
              and not re.search(rf"\b{name}\b", args[0] + args[1]), 2)
    return {k: n for k, n in uses.items() if k not in bad}


def split_acc(src: str) -> str | None:
    """Accumulator splitting: the first unrollable innermost loop (``unroll``'s conditions) whose
    body only accumulates into one or more ``float``/``double`` scalars declared before it
    (``a += e;``, ``a = fmaf(x, y, a);``) unrolled by 2, the second copy accumulating into a
    fresh partial sum per accumulator; a remainder loop takes the odd iteration and the partial
    sums are added to the accumulators after it. None when no loop qualifies."""
    for lp in _loops(src):
        if _NO_UNROLL.search(lp.body) or _assigns(lp.body, lp.var):
            continue
        before = src[:lp.start]
        accs = []
        for name, n in _accumulations(lp.body).items():
            decl = re.search(rf"\b(float|double)\s+{name}\s*[=;,]", before)
            if name != lp.var and decl and len(re.findall(rf"(?<![\w.]){name}\b", lp.body)) == n:
                accs.append((name, decl.group(1)))
        if not accs:
            continue
        v, s, taken = lp.var, lp.step, src
        second = _shift(lp.body, v, s)
        inits, merges = [], []
        for name, typ in accs:
            part = _fresh(taken, name)
            taken += f" {part}"
            second = re.sub(rf"(?<![\w.]){name}\b", part, second)
            inits.append(f"{typ} {part} = {'0.0f' if typ == 'float' else '0.0'};")
            merges.append(f"{name} += {part};")
        init = f"{lp.init};\n" if lp.init else ""
        text = (f"{{\n{init}{' '.join(inits)}\n"
                f"for (; {v} + {s} < {lp.bound}; {v} += {2 * s}) {{\n{{{lp.body}}}\n{{{second}}}\n}}\n"
                f"for (; {v} < {lp.bound}; {v} += {s}) {{{lp.body}}}\n{' '.join(merges)}\n}}")
        return src[:lp.start] + text + src[lp.end:]
    return None


_SHFL_DOWN = re.compile(r"(?<![\w.>])([A-Za-z_]\w*)\s*\+=\s*__shfl_down_sync\s*\(")


def _shfl_steps(src: str) -> list[tuple[int, int, int, str, str]]:
    """(start, end, index of the call's name, variable, offset) of every statement
    ``v += __shfl_down_sync(mask, v, off);`` in ``src``."""
    out = []
    for m in _SHFL_DOWN.finditer(src):
        got = _call_args(src, m.end() - 1)
        if not got:
            continue
        args, after = got
        semi = re.match(r"\s*;", src[after:])
        if len(args) == 3 and args[1].strip() == m.group(1) and semi:
            out.append((m.start(), after + semi.end(), src.index("__shfl_down_sync", m.start()), m.group(1),
                        args[2].strip()))
    return out


def _power2(text: str) -> bool:
    return text.isdigit() and 0 < int(text) < 32 and int(text) & (int(text) - 1) == 0


_HALVING = re.compile(r"\bfor\s*\(\s*(?:int\s+)?([A-Za-z_]\w*)\s*=\s*(\d+)\s*;\s*\1\s*(?:>\s*0|>=\s*1)\s*;"
                      r"\s*\1\s*(?:/=\s*2|>>=\s*1|=\s*\1\s*/\s*2|=\s*\1\s*>>\s*1)\s*\)\s*")


def shfl_xor(src: str) -> str | None:
    """Warp reductions ``v += __shfl_down_sync(m, v, off);`` rewritten as the ``__shfl_xor_sync``
    butterfly: every maximal run of such consecutive statements in which each variable's offsets
    are distinct powers of two below 32, and every halving loop
    ``for (int o = P; o > 0; o /= 2) v += __shfl_down_sync(m, v, o);`` (P a power of two, the body
    braced or not, one statement per variable). A lane whose bits at the run's offsets are all
    zero (lane 0 of each group) reads the same partners and ends with the same sum as before;
    with the butterfly every other lane of the group ends with it too. None when there is none."""
    steps = _shfl_steps(src)
    calls: list[int] = []
    run: list[tuple] = []

    def close_run():
        offs: dict[str, list[int]] = {}
        for _s, _e, _c, var, off in run:
            offs.setdefault(var, []).append(int(off) if _power2(off) else -1)
        if run and all(-1 not in o and len(set(o)) == len(o) for o in offs.values()):
            calls.extend(c for _s, _e, c, _v, _o in run)

    for st in steps:
        if run and src[run[-1][1]:st[0]].strip():
            close_run()
            run = []
        run.append(st)
    close_run()
    for m in _HALVING.finditer(src):
        o, start = m.group(1), m.end()
        braced = src[start:start + 1] == "{"
        end = _close(src, start) if braced else start
        inner = [st for st in steps if st[0] >= start and (st[1] <= end if braced else st[0] == start)]
        rest = src[start + 1:end] if braced else ""
        for st in inner:
            rest = rest.replace(src[st[0]:st[1]], "", 1)
        names = [st[3] for st in inner]
        if (_power2(m.group(2)) and inner and all(st[4] == o for st in inner) and not rest.strip()
                and len(set(names)) == len(names)):
            calls.extend(st[2] for st in inner)
    if not calls:
        return None
    out = src
    for c in sorted(set(calls), reverse=True):
        out = out[:c] + "__shfl_xor_sync" + out[c + len("__shfl_down_sync"):]
    return out


def _param_type(src: str, name: str) -> str | None:
    """The element type of the kernel's read-only pointer parameter ``name``; None if it is none."""
    m = re.search(rf"\bconst\s+([A-Za-z_]\w*)\s*\*\s*(?:__restrict__\s+)?{name}\s*[,)]", src)
    return m.group(1) if m else None


def prefetch(src: str) -> str | None:
    """Software pipelining of the first innermost loop (``unroll``'s conditions) that reads
    read-only pointer parameters at the loop variable (``__ldg(&col_idx[k])``, ``vals[k]``): the
    first iteration's elements are loaded before the loop, and each iteration copies them to
    registers and issues the next iteration's loads before its own work, so the index and value
    loads of iteration ``k + S`` are in flight while iteration ``k`` multiplies. None when no
    loop qualifies."""
    for lp in _loops(src):
        if _NO_UNROLL.search(lp.body) or _assigns(lp.body, lp.var):
            continue
        v, s = lp.var, lp.step
        at = rf"\[\s*{re.escape(v)}\s*\]"
        arrays = []
        for m in re.finditer(rf"(?<![\w.])([A-Za-z_]\w*)\s*{at}", lp.body):
            if m.group(1) not in arrays and _param_type(src, m.group(1)):
                arrays.append(m.group(1))
        if not arrays:
            continue
        body, taken, first, nxt, cur = lp.body, src, [], [], []
        for a in arrays:
            typ, nx, here = _param_type(src, a), _fresh(taken, f"{a}_next"), _fresh(taken, f"{a}_here")
            taken += f" {nx} {here}"
            body = re.sub(rf"__ldg\s*\(\s*&\s*{a}\s*{at}\s*\)", here, body)
            body = re.sub(rf"(?<![\w.&]){a}\s*{at}", here, body)
            first.append(f"{typ} {nx} = __ldg(&{a}[{v}]);")
            nxt.append(f"{nx} = __ldg(&{a}[{v} + {s}]);")
            cur.append(f"{typ} {here} = {nx};")
        if re.search(rf"(?<![\w.])({'|'.join(arrays)})\s*{at}", body):
            continue  # an element read some other way (its address taken): left as written
        init = f"{lp.init};\n" if lp.init else ""
        text = (f"{{\n{init}if ({v} < {lp.bound}) {{\n{' '.join(first)}\n"
                f"for (; {v} < {lp.bound}; {v} += {s}) {{\n{' '.join(cur)}\n"
                f"if ({v} + {s} < {lp.bound}) {{\n{' '.join(nxt)}\n}}\n{body}\n}}\n}}\n}}")
        return src[:lp.start] + text + src[lp.end:]
    return None


_APPLY = {"unroll2": lambda s: unroll(s, 2), "unroll4": lambda s: unroll(s, 4), "while": as_while,
          "fma_expand": fma_expand, "plain_loads": plain_loads, "split_acc": split_acc, "shfl_xor": shfl_xor,
          "prefetch": prefetch}


def apply(source: str, transform: str) -> str:
    """``source`` (a whole kernel, header lines included) with ``transform`` (names joined by
    ``+``) applied to its body. ValueError when a name is unknown or does not apply."""
    head, body = _split_header(source)
    for name in filter(None, transform.split("+")):
        if name not in _APPLY:
            raise ValueError(f"transform {name!r}: known transforms are {', '.join(TRANSFORMS)}")
        new = _APPLY[name](body)
        if new is None:
            raise ValueError(f"transform {name!r} does not apply to this kernel (no eligible loop or call)")
        body = new
    return head + reindent(body)


def reindent(body: str) -> str:
    """``body`` with every line indented 4 spaces per open brace (the templates' style), so a
    transformed kernel reads like a hand-written one."""
    out, depth = [], 0
    for line in body.split("\n"):
        text = line.strip()
        if not text:
            continue
        lead = len(text) - len(text.lstrip("}"))
        out.append("    " * max(0, depth - lead) + text)
        depth += text.count("{") - text.count("}")
    return "\n".join(out) + "\n"


def _split_header(source: str) -> tuple[str, str]:
    lines = source.split("\n", 2)
    if len(lines) < 3 or not (lines[0].startswith("//") and lines[1].startswith("//")):
        raise ValueError("a kernel starts with the two contract header lines (// sparserl ..., // launch ...)")
    return lines[0] + "\n" + lines[1] + "\n", lines[2]


def transform_names(source: str, combine: bool = True) -> list[str]:
    """The transforms (single ones, then pairs of a loop transform with another) that apply to
    ``source``, each giving a text different from ``source`` and from the others."""
    singles = [t for t in TRANSFORMS if _applies(source, t)]
    names = list(singles)
    if combine:
        loops = [t for t in singles if t in _LOOP_TRANSFORMS]
        names += [f"{a}+{b}" for a, b in product(loops, singles) if b not in _LOOP_TRANSFORMS]
    seen, out = {source}, []
    for n in names:
        try:
            text = apply(source, n)
        except ValueError:
            continue
        if text not in seen:
            seen.add(text)
            out.append(n)
    return out


def _applies(source: str, name: str) -> bool:
    try:
        apply(source, name)
        return True
    except ValueError:
        return False


def grammar_problems(source: str) -> list[str]:
    """Why ``source`` is outside the kernel language: the grammar's verdict and
    ``language.check``'s violations; [] when it is inside."""
    from sparserl_compile import language

    out = list(language.check(source))
    verdict = language.accepts(source)
    if not verdict.accepted:
        out.append(f"grammar: stopped after {verdict.consumed} bytes: {verdict.error}")
    return out


# ------------------------------------------------------------------ verified variants of records

#: the parameter key a variant adds to its point's parameters (``space.default_render`` reads it)
TRANSFORM_KEY = "transform"


def render(family: str, op: str, dtype: str, params: dict, structure=None) -> str:
    """The source of a point, or of a variant when ``params`` holds ``transform``."""
    from sparserl_compile import kernels

    params = dict(params)
    transform = params.pop(TRANSFORM_KEY, None)
    source = kernels.render(family, op, dtype, params, structure).source
    return source if transform is None else apply(source, str(transform))
