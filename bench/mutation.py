"""Mutation testing: how much of a module's behaviour its tests pin down.

Applies one AST mutation at a time (comparison flips, and/or swaps, +1/-1 on constants,
min/max swaps, conditions forced True/False, a statement replaced by ``pass``, ...) to a copy
of the checkout, runs the given tests with ``-x`` in a forked child (heavy imports are done
once in the parent) and prints the mutants no test killed. A survivor is either equivalent
(no behaviour changes) or behaviour no test holds. Needs the dev virtualenv:

    .venv/bin/python bench/mutation.py --module fastshare/controller/ledger.py \
        --tests tests/controller/test_ledger.py --out /tmp/ledger.json

Slow by nature (one test run per mutant): run it under ``nice``, per module.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

CMP_SWAPS = {ast.Lt: [ast.LtE, ast.GtE], ast.LtE: [ast.Lt, ast.Gt], ast.Gt: [ast.GtE, ast.LtE],
             ast.GtE: [ast.Gt, ast.Lt], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq],
             ast.In: [ast.NotIn], ast.NotIn: [ast.In], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
BIN_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
             ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr}


def _docstring_ids(tree):
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                ids.add(id(body[0]))
                ids.add(id(body[0].value))
    return ids


def _annotation_ids(tree):
    ids = set()
    for node in ast.walk(tree):
        for field in ("annotation", "returns"):
            sub = getattr(node, field, None)
            if isinstance(sub, ast.AST):
                ids.update(id(n) for n in ast.walk(sub))
        if isinstance(node, ast.AnnAssign) and node.value is None:
            ids.add(id(node))
    return ids


def sites(tree):
    """Yield (lineno, description, apply) in a deterministic order; apply() mutates the tree."""
    docs = _docstring_ids(tree)
    ann = _annotation_ids(tree)
    in_func = set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(f):
                in_func.add(id(n))
    for parent in ast.walk(tree):
        if id(parent) in ann:
            continue
        for field, value in ast.iter_fields(parent):
            children = value if isinstance(value, list) else [value]
            for idx, node in enumerate(children):
                if not isinstance(node, ast.AST) or id(node) in ann or id(node) in docs:
                    continue
                yield from _node_sites(parent, field, idx, node, isinstance(value, list), id(node) in in_func)


def _replace(parent, field, idx, is_list, new):
    def apply():
        if is_list:
            getattr(parent, field)[idx] = new
        else:
            setattr(parent, field, new)
    return apply


def _node_sites(parent, field, idx, node, is_list, in_func):
    ln = getattr(node, "lineno", getattr(parent, "lineno", 0))
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in CMP_SWAPS.get(type(op), []):
                def apply(node=node, i=i, new=new):
                    node.ops[i] = new()
                yield ln, f"cmp {type(op).__name__}->{new.__name__}", apply
    if isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        def apply(node=node, new=new):
            node.op = new()
        yield ln, f"boolop ->{new.__name__}", apply
        for i in range(len(node.values)):
            def drop(node=node, i=i):
                node.values.pop(i)
            yield ln, f"boolop drop operand {i}", drop
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield ln, "drop not", _replace(parent, field, idx, is_list, node.operand)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        yield ln, "drop unary minus", _replace(parent, field, idx, is_list, node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in BIN_SWAPS:
        new = BIN_SWAPS[type(node.op)]
        def apply(node=node, new=new):
            node.op = new()
        yield ln, f"binop {type(node.op).__name__}->{new.__name__}", apply
    if isinstance(node, ast.AugAssign) and type(node.op) in BIN_SWAPS:
        new = BIN_SWAPS[type(node.op)]
        def apply(node=node, new=new):
            node.op = new()
        yield ln, f"augassign {type(node.op).__name__}->{new.__name__}", apply
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            yield ln, f"const {v}->{not v}", _replace(parent, field, idx, is_list, ast.Constant(not v))
        elif isinstance(v, (int, float)):
            yield ln, f"const {v}->{v + 1}", _replace(parent, field, idx, is_list, ast.Constant(v + 1))
            yield ln, f"const {v}->{v - 1}", _replace(parent, field, idx, is_list, ast.Constant(v - 1))
        elif isinstance(v, str) and field not in ("names",):
            yield ln, f"const str {v[:30]!r}->'XX'", _replace(parent, field, idx, is_list, ast.Constant("XX"))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        new = "max" if node.func.id == "min" else "min"
        def apply(node=node, new=new):
            node.func = ast.Name(new, ast.Load())
        yield ln, f"call {node.func.id}->{new}", apply
    if field in ("test",) and isinstance(parent, (ast.If, ast.While, ast.IfExp)):
        yield ln, "cond->True", _replace(parent, field, idx, is_list, ast.Constant(True))
        yield ln, "cond->False", _replace(parent, field, idx, is_list, ast.Constant(False))
    if field == "ifs" and isinstance(parent, ast.comprehension):
        def apply(parent=parent, idx=idx):
            parent.ifs.pop(idx)
        yield ln, "drop comprehension if", apply
    if is_list and in_func and isinstance(node, ast.stmt) and field in ("body", "orelse", "finalbody") \
            and not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Pass, ast.Global, ast.Nonlocal)):
        yield ln, f"stmt {type(node).__name__} -> pass", _replace(parent, field, idx, is_list, ast.Pass())


def mutant_source(src, k):
    tree = ast.parse(src)
    for i, (ln, desc, apply) in enumerate(sites(tree)):
        if i == k:
            apply()
            ast.fix_missing_locations(tree)
            return ln, desc, ast.unparse(tree)
    raise IndexError(k)


def run_tests(work, tests, timeout, extra):
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(work)
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest
            code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                "--hypothesis-seed=0", *extra, *tests])
            os._exit(int(code))
        except BaseException:
            os._exit(99)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent), help="the checkout")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "fastshare-mutation"),
                   help="where the mutated copy lives (replaced)")
    p.add_argument("--module", required=True)
    p.add_argument("--tests", nargs="+", required=True)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--only", type=str, default="")
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args()
    src = (Path(a.repo) / a.module).read_text()
    n = sum(1 for _ in sites(ast.parse(src)))
    if a.list:
        for k in range(n):
            ln, desc, _ = mutant_source(src, k)
            print(k, ln, desc)
        return
    shutil.rmtree(a.work, ignore_errors=True)
    shutil.copytree(a.repo, a.work, ignore=shutil.ignore_patterns(".git", "__pycache__", ".hypothesis",
                                                                   ".venv", "node_modules"))
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTHONPATH"] = a.work
    sys.path.insert(0, a.work)
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401  pre-import heavy third-party modules in the parent
    try:
        import grpc  # noqa: F401
        import yaml  # noqa: F401
    except ImportError:
        pass
    target = Path(a.work) / a.module
    ks = [int(x) for x in a.only.split(",")] if a.only else range(n)
    # baseline: unparsed original must pass
    target.write_text(ast.unparse(ast.parse(src)))
    base = run_tests(a.work, a.tests, a.timeout * 3, [])
    print(f"baseline rc={base} mutants={n}", flush=True)
    if base != 0:
        sys.exit("baseline fails")
    results = []
    t0 = time.monotonic()
    try:
        for k in ks:
            ln, desc, msrc = mutant_source(src, k)
            target.write_text(msrc)
            rc = run_tests(a.work, a.tests, a.timeout, [])
            status = "killed" if rc not in (0, 5) else ("survived" if rc == 0 else "no-tests")
            if rc == "timeout":
                status = "timeout"
            results.append({"k": k, "line": ln, "desc": desc, "status": status, "rc": rc})
            if status != "killed":
                print(f"{k} L{ln} {desc}: {status}", flush=True)
    finally:
        target.write_text(src)
    killed = sum(r["status"] in ("killed", "timeout") for r in results)
    print(f"total={len(results)} killed={killed} survived={len(results) - killed} "
          f"in {time.monotonic() - t0:.0f}s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
