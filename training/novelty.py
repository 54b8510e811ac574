"""Whether a kernel is new: not a point of the hand-written kernel space, up to form.

A kernel is **novel** for (op, dtype) when its *normal form* equals the normal form of no
rendered point of ``sparserl_compile.kernels.space(op, dtype)``. The normal form removes what
does not change the program a kernel is:

- comments (the two contract header lines included: they restate launch parameters that the
  body's literals already carry, so two points that differ only there are one kernel);
- whitespace: the source is split into C tokens and joined with single spaces;
- identifier names: every name that is not a keyword, a type, a built-in of the kernel language
  (``language.BUILTINS``), a CUDA variable (``threadIdx`` ...), a qualified ``nvcuda::wmma``
  name or a member after ``.`` is replaced by ``v0``, ``v1``, ... in order of first appearance.

So renaming ``acc`` to ``sum`` or re-indenting a template is not novel; changing a literal
(an unroll factor, a block size the family does not declare), an expression or the statement
order is. The space's normal forms are rendered once per (op, dtype) and cached; the families
whose text depends on the matrix (``Family.needs_structure``: the baked kernels) are rendered
for the matrix given, cached per matrix fingerprint.
"""

from __future__ import annotations

import re
from functools import lru_cache

#: names the normal form keeps: C keywords and types of the kernel language, CUDA variables
_KEEP = frozenset(
    """
    const extern __global__ __device__ __forceinline__ __shared__ __restrict__ void int unsigned long bool
    float double __half __nv_bfloat16 float2 float4 int2 int4 __half2 __nv_bfloat162
    if else for while do break continue return sizeof reinterpret_cast switch case default true false
    threadIdx blockIdx blockDim gridDim warpSize sparserl_kernel
    """.split()
)

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*|\d[\w.]*(?:[eE][+-]?\d+)?[fFuUlL]*|\.\d[\w]*'
                    r"|<<=|>>=|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|\S")


def _keep() -> frozenset[str]:
    from sparserl_compile.language import BUILTINS

    return _KEEP | BUILTINS


def tokens(source: str) -> list[str]:
    """The C tokens of ``source`` without its comments."""
    return _TOKEN.findall(_COMMENT.sub(" ", source))


def normal_form(source: str) -> str:
    """``source``'s normal form (module docstring): tokens without comments, identifiers renamed
    in order of first appearance, joined by single spaces."""
    keep = _keep()
    names: dict[str, str] = {}
    out: list[str] = []
    prev = ""
    for t in tokens(source):
        if (t[0].isalpha() or t[0] == "_") and t not in keep and "::" not in t and prev != ".":
            t = names.setdefault(t, f"v{len(names)}")
        out.append(t)
        prev = t
    return " ".join(out)


@lru_cache(maxsize=None)
def space_forms(op: str, dtype: str) -> frozenset[str]:
    """The normal forms of every structure-independent point of the space for (op, dtype)
    (every dense width: a point's text does not depend on ``n``)."""
    from sparserl_compile import kernels

    return frozenset(normal_form(c.source) for c in kernels.space(op, dtype))


@lru_cache(maxsize=64)
def _structure_forms(op: str, dtype: str, fingerprint: str, matrix_box: tuple) -> frozenset[str]:
    (matrix,) = matrix_box
    return frozenset(normal_form(f.render(op, dtype, p, matrix).source)
                     for f in _structure_families(op, dtype, int(matrix.indptr[-1])) for p in f.space(op, dtype))


def _structure_families(op: str, dtype: str, nnz: int) -> list:
    """The families whose text depends on the matrix that serve (op, dtype) at ``nnz`` nonzeros."""
    from sparserl_compile import kernels

    return [f for f in kernels.FAMILIES if f.needs_structure and op in f.ops and f.applies(op, dtype, n=None, nnz=nnz)]


class _Box(tuple):
    """A one-element tuple hashed by identity: the matrix travels to the cache, the key is its
    fingerprint."""

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Box)


def is_novel(source: str, op: str, dtype: str, matrix=None) -> bool:
    """Whether ``source`` is no point of the kernel space for (op, dtype) after normalising
    whitespace, comments and identifier names; ``matrix`` (a CSR matrix): also compare against
    the points rendered for it (the baked kernels). Unknown op or dtype: ValueError."""
    from sparserl_compile import contract

    if op not in contract.OPS or dtype not in contract.DTYPES:
        raise ValueError(f"op={op!r}, dtype={dtype!r}: expected an op of {contract.OPS} and a dtype of "
                         f"{tuple(contract.DTYPES)}")
    form = normal_form(source)
    if form in space_forms(op, dtype):
        return False
    if matrix is None or not _structure_families(op, dtype, int(matrix.indptr[-1])):
        return True
    from sparserl_compile.structure import fingerprint

    fp = fingerprint(matrix.indptr, matrix.indices, matrix.shape)
    return form not in _structure_forms(op, dtype, fp, _Box((matrix,)))


def novel_rate(sources: list[str], op: str, dtype: str, matrix=None) -> float | None:
    """The fraction of ``sources`` that are novel (``is_novel``); None for no sources."""
    if not sources:
        return None
    return sum(is_novel(s, op, dtype, matrix) for s in sources) / len(sources)
