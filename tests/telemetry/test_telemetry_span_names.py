"""docs/observability.md's picture of a request names every span the code starts, and only those.

The names are read from the source, not from a run: a step span like `draft.catch_up` only appears after a
plain stretch under `--speculation auto`, which no short traced run is sure to reach. RPC spans are named after
their method (`_method_name`), which the doc covers by rule; every other name must resolve to a string.
"""

from __future__ import annotations

import ast
import re

from repo_paths import REPO

PACKAGES = ("specdec", "gateway", "draft_service", "target_service")
SPAN_STARTERS = {"span", "start_span", "start_as_current_span"}  # StepSpanSampler's and the OTel tracer's
DOC = REPO / "docs" / "observability.md"
OWN_SPAN = re.compile(r"^(gateway|draft|target)\.\w+$")


def _source_trees() -> list[ast.Module]:
    files = [f for p in PACKAGES for f in sorted((REPO / p).rglob("*.py")) if "v1" not in f.relative_to(REPO).parts]
    return [ast.parse(f.read_text(), str(f)) for f in files]


def _callee(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _constants(trees: list[ast.Module]) -> dict[str, str]:
    """Module-level `NAME = "..."` of every file (a span name may be imported, e.g. PROMPT_EXTEND)."""
    return {target.id: node.value.value for tree in trees for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}  # fmt: skip


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _own_nodes(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """The nodes of `func`'s body, not those of functions defined inside it (they have their own parameters)."""
    nodes, todo = [], list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        nodes.append(node)
        if not isinstance(node, FUNCTIONS):
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def _name_arg(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def code_span_names() -> set[str]:
    """Names passed to the span starters; a name that is a function's parameter is followed to the calls of that
    function (`Scheduler._extend(..., name="draft.extend")`, called with "draft.catch_up" and PROMPT_EXTEND)."""
    trees = _source_trees()
    constants = _constants(trees)
    names: set[str] = set()
    unresolved: list[str] = []
    forwarded: dict[str, tuple[int, str]] = {}  # function -> (position in its calls, parameter) naming a span
    for tree in trees:
        for func in (n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)):
            params = [a.arg for a in func.args.args]
            defaults = dict(zip(params[len(params) - len(func.args.defaults):], func.args.defaults, strict=True))
            body = _own_nodes(func)
            rpc_named = {t.id for n in body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                         and _callee(n.value) == "_method_name" for t in n.targets if isinstance(t, ast.Name)}
            for call in (n for n in body if isinstance(n, ast.Call) and _callee(n) in SPAN_STARTERS):
                arg = _name_arg(call, 0, "name")
                if isinstance(arg, ast.Constant):
                    names.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in constants:
                    names.add(constants[arg.id])
                elif isinstance(arg, ast.Name) and arg.id in params:
                    skip_self = 1 if params[:1] == ["self"] else 0
                    forwarded[func.name] = (params.index(arg.id) - skip_self, arg.id)
                    if isinstance(defaults.get(arg.id), ast.Constant):
                        names.add(defaults[arg.id].value)
                elif not (isinstance(arg, ast.Name) and arg.id in rpc_named):
                    unresolved.append(f"{func.name}: {ast.unparse(call)}")
    passed_on = {param for _, param in forwarded.values()}  # StepSpanSampler.span's `name` -> start_span
    for tree in trees:
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) in forwarded):
            arg = _name_arg(call, *forwarded[_callee(call)])
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in constants:
                names.add(constants[arg.id])
            elif arg is not None and not (isinstance(arg, ast.Name) and arg.id in passed_on):
                unresolved.append(ast.unparse(call))
    assert not unresolved, f"span names this test cannot read: {unresolved}"
    return names


def documented_span_names() -> set[str]:
    """The service-named spans (`gateway.*`, `draft.*`, `target.*`) of the doc's "What a request looks like"."""
    section = DOC.read_text().split("### What a request looks like", 1)[1]
    block = section.split("```", 2)[1]
    return {word for line in block.splitlines() for word in line.split() if OWN_SPAN.match(word)}


def test_the_documented_spans_are_the_ones_the_code_starts():
    code = code_span_names()
    # one of each way a name is given (a literal, a constant, a helper's argument), so the reading itself works
    assert {"gateway.tokenize", "draft.extend_prompt", "draft.catch_up", "target.verify_batch"} <= code
    assert documented_span_names() == code
