"""The README's command blocks, read as a user would type them, for tests that run them as written."""
from __future__ import annotations

import re

from tests.support.cluster import REPO_ROOT


def readme_block(*markers: str, doc: str = "README.md") -> list[str]:
    """The commands of the README's (or another `doc`'s) first ```sh block that contains every
    marker: comments and comment-only lines dropped, backslash continuations joined."""
    text = (REPO_ROOT / doc).read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        if all(m in block for m in markers):
            joined = re.sub(r"\\\n\s*", " ", block)
            lines = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in joined.splitlines())
            return [line for line in lines if line]
    raise AssertionError(f"{doc} has no ```sh block with all of {markers}")


def readme_line(block: list[str], start: str) -> str:
    """The one command of `block` that starts with `start`."""
    (line,) = [c for c in block if c.startswith(start)] or [None]
    assert line is not None, f"the README block has no command starting with {start!r}: {block}"
    return line
