#!/usr/bin/env python3
"""Count the code lines of the four packages (api/, operator/, trainer/, cli/): lines that hold a
token of code, so no blank line, comment or docstring counts. The generated typed spec
(api/ddpjob_api/specgen.py) is counted apart.

    hack/codelines.py [REV] [-v]     REV: a commit (default: the work tree); -v: the largest files
"""
from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize

ROOTS = ("api/", "operator/", "trainer/", "cli/")
GENERATED = "api/ddpjob_api/specgen.py"
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def files(rev: str | None) -> list[str]:
    listing = (_git("ls-tree", "-r", "--name-only", rev, *ROOTS) if rev
               else _git("ls-files", "--cached", "--others", "--exclude-standard", *ROOTS))
    return [f for f in listing.split() if f.endswith(".py")]


def source(rev: str | None, path: str) -> str:
    if rev:
        return _git("show", f"{rev}:{path}")
    with open(path) as f:
        return f.read()


def code_lines(text: str) -> int:
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in NOT_CODE:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines)


def main(argv: list[str]) -> int:
    rev = next((a for a in argv if not a.startswith("-")), None)
    counts = {path: code_lines(source(rev, path)) for path in files(rev)}
    generated = sum(n for path, n in counts.items() if path == GENERATED)
    written = sum(counts.values()) - generated
    print(f"{rev or 'work tree'}: hand-written {written}, generated {generated}, all {written + generated}")
    if "-v" in argv:
        for path, n in sorted(counts.items(), key=lambda item: -item[1])[:40]:
            print(f"{n:6} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
