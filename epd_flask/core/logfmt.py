"""The one way text from outside (a client's path or id, an instance's model names, engine ids
or error text) is written into a log: as a logfmt value, plain when it can be, else a JSON
string. A newline can then never start a forged line, nor an ANSI escape colour or rewrite a
terminal, nor a space or ``=`` add a field of its own. Imports nothing of ours."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence

_NEEDS_QUOTES = re.compile(r'[ "=\\]')


def quote(value: object) -> str:
    """A logfmt value: plain when it can be, else a JSON string (ASCII: every control or
    separator character escaped). Numbers are always plain (digits, sign, point, exponent,
    inf, nan)."""
    if value.__class__ is int or value.__class__ is float:
        return str(value)
    text = "" if value is None else str(value)
    if text and _NEEDS_QUOTES.search(text) is None and text.isprintable():
        return text
    return json.dumps(text)


#: How many names of a list from outside a log line shows.
NAMES_SHOWN = 10


def names(values: Sequence[str], limit: int = NAMES_SHOWN) -> str:
    """Up to ``limit`` of ``values``, each quoted, then how many more: a list from outside
    never makes a line longer than its first few names."""
    shown = ", ".join(quote(v) for v in values[:limit])
    more = len(values) - limit
    return f"{shown}, and {more} more" if more > 0 else shown


def change(before: Collection[str] | None, after: Collection[str],
           limit: int = NAMES_SHOWN) -> str:
    """What changed from one list of names to the next, for a log line of bounded length:
    the first list in full (up to ``limit`` names), then only what was added and removed."""
    if before is None:
        return f"{len(after)}: {names(sorted(after), limit)}" if after else "none"
    added, removed = sorted(set(after) - set(before)), sorted(set(before) - set(after))
    parts = [f"{len(after)} now"]
    if added:
        parts.append(f"added {len(added)}: {names(added, limit)}")
    if removed:
        parts.append(f"removed {len(removed)}: {names(removed, limit)}")
    return "; ".join(parts)
