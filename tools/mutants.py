"""Mutation testing for one module: does the suite notice when the code is broken?

    python tools/mutants.py rnnlm/core/sampled.py tests/test_sampled_softmax.py [more tests ...]
    python tools/mutants.py rnnlm/exchange/frames.py tests/test_channel.py --lines 160-260
    python tools/mutants.py rnnlm/server/wire.py tests/test_wire.py --survivors old.log   # again, with new tests

Copies the tracked tree into a scratch directory (the checkout is never touched), then, one at a
time, makes each small change below to MODULE and runs the given tests against it (``pytest -x``):
an arithmetic or boolean operator swapped (+ -, * /, // *, % //, and or), a comparison moved by
one (< <=, > >=, == !=), a number changed (0 -> 1, 1 -> 0, n -> n + 1, x -> 2x), a bool flipped, a
``not`` or a unary minus dropped. Error messages, ``raise`` and ``assert`` lines are left alone.
A change the tests pass on "survived": either the tests miss a behaviour, or the change cannot be
seen (a tuning constant, a shift a softmax cancels); each survivor is for a person to judge.
Prints one line per mutant and, last, ``survived=<n> of <total>``.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
        ast.Mod: ast.FloorDiv, ast.And: ast.Or, ast.Or: ast.And, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
        ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
QUIET = (ast.Raise, ast.Assert, ast.JoinedStr)      # no mutants inside these


def sites(tree):
    """(node, kind) of every place a mutant can go, in a fixed order."""
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}

    def quiet(n):
        while n in parents:
            n = parents[n]
            if isinstance(n, QUIET):
                return True
        return False
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.BinOp, ast.AugAssign, ast.BoolOp)) and type(n.op) in SWAP:
            kind = "op"
        elif isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in SWAP:
            kind = "cmp"
        elif isinstance(n, ast.Constant) and type(n.value) in (int, float, bool):
            kind = "const"
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub)):
            kind = "unary"
        else:
            continue
        if not quiet(n):
            out.append((n, kind, parents.get(n)))
    return out


def mutate(node, kind, parent) -> str:
    """Change ``node`` in place (its tree); return what changed."""
    if kind == "op":
        new = SWAP[type(node.op)]
        was, node.op = type(node.op).__name__, new()
        return f"{was} -> {new.__name__}"
    if kind == "cmp":
        new = SWAP[type(node.ops[0])]
        was, node.ops = type(node.ops[0]).__name__, [new()]
        return f"{was} -> {new.__name__}"
    if kind == "const":
        v = node.value
        if isinstance(v, bool):
            node.value = not v
        elif isinstance(v, int):
            node.value = 1 if v == 0 else 0 if v == 1 else v + 1
        else:
            node.value = v * 2 if v else 1.0
        return f"{v!r} -> {node.value!r}"
    for field, value in ast.iter_fields(parent):                      # unary: the operand replaces it
        if value is node:
            setattr(parent, field, node.operand)
        elif isinstance(value, list):
            setattr(parent, field, [node.operand if v is node else v for v in value])
    return f"drop {type(node.op).__name__}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", help="the file to mutate, relative to the repository root")
    ap.add_argument("tests", nargs="+", help="the test files to run against each mutant")
    ap.add_argument("--lines", default=None, help="only mutants on lines A-B")
    ap.add_argument("--survivors", default=None, metavar="LOG",
                    help="only the mutants this script's output LOG says survived (their line and change)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (a run past it counts as caught)")
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    source = open(os.path.join(root, a.module)).read()
    lo, hi = map(int, a.lines.split("-")) if a.lines else (0, 10 ** 9)
    wanted = survivors(a.survivors) if a.survivors else None

    def chosen(node, kind, parent) -> bool:
        if not lo <= node.lineno <= hi:
            return False
        return wanted is None or (node.lineno, mutate(node, kind, parent)) in wanted     # a throwaway tree's node
    count = sum(chosen(*site) for site in sites(ast.parse(source)))
    print(f"# {count} mutants of {a.module}; tests: {' '.join(a.tests)}", flush=True)
    survived = done = 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        for f in files:
            os.makedirs(os.path.join(scratch, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(root, f), os.path.join(scratch, f))
        env = {**os.environ, "PYTHONPATH": scratch}

        def passes() -> bool:
            try:
                return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *a.tests],
                                      cwd=scratch, env=env, capture_output=True, timeout=a.timeout).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        if not passes():
            raise SystemExit(f"mutants: the tests fail on the unchanged copy: {' '.join(a.tests)}")
        for i, site in enumerate(sites(ast.parse(source))):
            node = site[0]
            if not chosen(*site):
                continue
            tree = ast.parse(source)                                 # a fresh tree: its i-th site is this one
            n, k, p = sites(tree)[i]
            change = mutate(n, k, p)
            with open(os.path.join(scratch, a.module), "w") as out:
                out.write(ast.unparse(tree))
            t0 = time.perf_counter()
            caught = not passes()
            survived += not caught
            done += 1
            line = source.splitlines()[node.lineno - 1].strip()
            print(f"{'caught  ' if caught else 'SURVIVED'} line {node.lineno:<4d} {change:18s} "
                  f"{time.perf_counter() - t0:5.1f} s | {line[:100]}", flush=True)
    print(f"survived={survived} of {done}")


def survivors(path: str) -> set:
    """``{(line, change)}`` of the mutants an earlier run's output at ``path`` reported as survivors."""
    found = set()
    for text in open(path):
        m = re.match(r"SURVIVED line (\d+)\s+(.+?)\s+[\d.]+ s \|", text)
        if m:
            found.add((int(m.group(1)), m.group(2)))
    return found


if __name__ == "__main__":
    main()
