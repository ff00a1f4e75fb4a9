"""Bugs put into real code on purpose, one at a time, as SWE-smith makes its tasks: each a small
change of one expression in one function (a comparison's boundary, an arithmetic or boolean
operator, a negation dropped, an integer off by one, a returned truth value flipped), found on the
function's syntax tree and written back into the file's text in place, so the rest of the file
(comments, layout) stays as it was."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass

COMPARISONS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
ARITHMETIC: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
    ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
BOOLEAN: dict[type[ast.boolop], type[ast.boolop]] = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Mutation:
    path: str  # the file's, relative to the repository
    function: str  # qualified name: Class.method or function
    line: int
    kind: str  # comparison, arithmetic, boolean, negation, constant or return
    before: str  # the expression as written
    after: str  # as mutated
    text: str  # the whole file, mutated


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions and methods of module-level classes, with their qualified names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


@dataclass(frozen=True)
class Site:
    """One place a mutation could go, before the file is rewritten (cheap to list)."""

    function: str
    node: ast.AST
    kind: str
    mutated: ast.expr


def sites(text: str) -> list[Site]:
    """Every single-expression mutation of every function in the file, in the file's order; none
    for a file that does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    # Nothing inside an f-string: `f"{a+1=}"` prints its own text, which a mutation would change too.
    formatted = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for inner in ast.walk(node)}
    return [Site(name, node, kind, mutated) for name, function in functions(tree) for node in ast.walk(function)
            if id(node) not in formatted for kind, mutated in _mutants(node)]


def apply(path: str, text: str, site: Site) -> Mutation | None:
    """The file with the site mutated; None where the site has no place in the text, the mutant
    reads the same, or the result does not parse."""
    starts = [0]
    for line in text.encode("utf-8").splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    try:
        found = _rewritten(text, starts, site.node, site.mutated)
    except (RecursionError, MemoryError):  # an expression nested too deep to write back
        return None
    if found is None:
        return None
    before, after, rewritten = found
    return Mutation(path, site.function, getattr(site.node, "lineno", 0), site.kind, before, after, rewritten)


def mutations(path: str, text: str) -> Iterator[Mutation]:
    """Every mutation of the file that can be written, in the file's order."""
    for site in sites(text):
        mutation = apply(path, text, site)
        if mutation is not None:
            yield mutation


def _mutants(node: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARISONS:
        yield "comparison", ast.Compare(node.left, [COMPARISONS[type(node.ops[0])]()], node.comparators)
    elif isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        yield "arithmetic", ast.BinOp(node.left, ARITHMETIC[type(node.op)](), node.right)
    elif isinstance(node, ast.BoolOp) and type(node.op) in BOOLEAN:
        yield "boolean", ast.BoolOp(BOOLEAN[type(node.op)](), node.values)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "negation", node.operand
    elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 1000:
        yield "constant", ast.Constant(node.value + 1)
    elif isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and type(node.value.value) is bool:
        flipped = copy.copy(node.value)
        flipped.value = not node.value.value
        yield "return", flipped


def _rewritten(text: str, starts: list[int], node: ast.AST, mutated: ast.expr) -> tuple[str, str, str] | None:
    """The node's text, the mutant's, and the file with one for the other; None where the node has
    no place in the text or the result does not parse."""
    if isinstance(node, ast.Return):
        assert node.value is not None
        node = node.value
    line, col = getattr(node, "lineno", None), getattr(node, "col_offset", None)
    end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if line is None or col is None or end_line is None or end_col is None:
        return None
    data = text.encode("utf-8")
    begin = starts[line - 1] + col
    end = starts[end_line - 1] + end_col
    before = data[begin:end].decode("utf-8")
    after = ast.unparse(mutated)
    if "\n" in before or ast.unparse(node) == after:
        return None
    if isinstance(node, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp)) or isinstance(mutated, ast.BoolOp):
        after = f"({after})"  # the operator's precedence in its place stays the original's
    rewritten = (data[:begin] + after.encode("utf-8") + data[end:]).decode("utf-8")
    try:
        ast.parse(rewritten)
    except SyntaxError:
        return None
    return before, after, rewritten
