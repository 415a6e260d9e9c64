"""Source-text helpers for the generated module: string literals, docstrings, wrapped calls."""

from __future__ import annotations

import json
from collections.abc import Sequence

LINE_LENGTH = 88
"""Longest line the generated code aims for (ruff's and black's default)."""


def quoted(text: str) -> str:
    """A double-quoted Python string literal (the quotes ruff format keeps)."""
    return json.dumps(text, ensure_ascii=False)


def assignment(name: str, literal: str, width: int = 88) -> str:
    """``NAME = literal`` as ruff format writes it: in parentheses on its own line when the
    line is longer than ``width`` but the literal fits there, else on one line."""
    line = f"{name} = {literal}"
    if len(line) > width and len(literal) + 4 <= width:
        return f"{name} = (\n    {literal}\n)"
    return line


def docstring_safe(text: str) -> str:
    """Text that is safe inside a triple-quoted docstring."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def call_lines(indent: int, head: str, args: Sequence[str], tail: str = "") -> list[str]:
    """``head(args)tail`` on one line, or one argument per line with a trailing comma."""
    pad = " " * indent
    one = f"{pad}{head}({', '.join(args)}){tail}"
    if len(one) <= LINE_LENGTH or not args:
        return [one]
    target, equals, call = head.partition(" = ")
    if equals and len(f"{pad}{head}(") > LINE_LENGTH:  # the call in parentheses, as ruff does
        return [f"{pad}{target} = (", *call_lines(indent + 4, call, args, tail), f"{pad})"]
    lines = [f"{pad}{head}("]
    for arg in args:
        inner = arg[1:-1]
        flat = not any(c in inner for c in "()[]{}\"'")
        if len(arg) + indent + 5 > LINE_LENGTH and arg[:1] + arg[-1:] in ("[]", "()") and flat:
            items = [i.strip() for i in inner.split(",") if i.strip()]  # a long list of names
            lines += [f"{pad}    {arg[0]}", *(f"{pad}        {i}," for i in items)]
            lines.append(f"{pad}    {arg[-1]},")
        else:
            lines.append(f"{pad}    {arg},")
    return [*lines, f"{pad}){tail}"]


def joined(*lines: str) -> str:
    """The lines as one text, newline-separated."""
    return "\n".join(lines)


def counted(n: int, noun: str) -> str:
    """``"1 device"``, ``"3 devices"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def block_span(blocks: Sequence[str]) -> str:
    """``"conv1 … layer3.0"``: a stage's first and last block (one name for one block)."""
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} … {blocks[-1]}"
