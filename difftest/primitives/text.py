"""Text from files and plug-ins, made safe to print on one line.

Case names, case ids and backend names come from case files, reports and plug-ins; a newline
or a terminal escape in one would print a line difftest never wrote (a fake ``GATE PASSED``
verdict) or rewrite the terminal. :func:`printable` escapes every character that is not
printable (``\\n``, ``\\x1b``, ...) as Python writes it in a string literal; printable text,
non-ASCII letters included, is unchanged.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with each non-printable character escaped (``"a\\nb"`` -> ``a\\\\nb``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
