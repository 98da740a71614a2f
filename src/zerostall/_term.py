"""Text output for the CLI and the bench: the one console they print rich tables and lines through.

Never interprets text as markup or emoji codes: a key, a path or a hint such as
``pip install 'zerostall[uring]'`` prints as written; styles come only from
:class:`rich.text.Text` objects the caller builds. Control characters in text from outside (a
checkpoint, a path) are shown as escapes by :func:`safe`. Off a terminal lines are never
wrapped or cropped, so one record stays one line of the log. Imports nothing from zerostall;
rich is imported when a console is made.
"""

from __future__ import annotations

import sys
from typing import Any

NO_WRAP_WIDTH = 1 << 20  # wide enough that no record is wrapped; tables take their content's width


def safe(text: Any) -> str:
    """``text`` with control characters (ESC, BEL, bidi overrides, ...) shown as escapes."""
    s = str(text)
    return s if s.isprintable() else "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in s)


def console(*, stderr: bool = False) -> Any:
    """A :class:`rich.console.Console` on stdout (``stderr=True``: stderr) that prints literally,
    to the stream current when it prints (so a test's captured stdout works)."""
    from rich.console import Console
    c = Console(stderr=stderr, markup=False, emoji=False, highlight=False)
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without one, or closed
        tty = False
    if not tty:  # a log: full lines, whatever COLUMNS or FORCE_COLOR say
        c.width = NO_WRAP_WIDTH
        c.soft_wrap = True
    return c


def table(title: str, columns: list[str] | tuple[str, ...], *, right: tuple[str, ...] = (),
          fold: bool = False) -> Any:
    """A :class:`rich.table.Table` with these columns (those in ``right`` right-justified;
    ``fold``: long cells wrap within their column on a narrow terminal instead of being cut)."""
    from rich.table import Table
    t = Table(title=safe(title))
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold" if fold else "ellipsis")
    return t
