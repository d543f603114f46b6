"""Roster documents the tests give a proxy (in process, or written to a file for gunicorn): one
builder for split prefill/decode, combined instances, encoders, settings and the extra fields
an instance may carry (bootstrap_url, kv_events, models)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: An instance: a server (anything with ``url``), a URL, or either with its extra fields.
Member = Any


def roster(prefills: Iterable[Member] = (), decodes: Iterable[Member] = (), *,
           encoders: Iterable[Member] = (), combined: Iterable[Member] = (),
           **settings: Any) -> dict[str, Any]:
    """A roster document: encoders, prefills, decodes, then combined (prefill_decode)
    instances, each in the order given; ``settings`` are the roster's settings. A member
    written ``(server, {"bootstrap_url": ...})`` carries those fields too."""
    by_role = (("encode", encoders), ("prefill", prefills), ("decode", decodes),
               ("prefill_decode", combined))
    return {"settings": settings,
            "instances": [instance(role, member) for role, members in by_role
                          for member in members]}


def instance(role: str, member: Member) -> dict[str, Any]:
    """One instance record of ``role``: see ``roster``."""
    fields: dict[str, Any] = {}
    if isinstance(member, tuple):
        member, fields = member
    url = member if isinstance(member, str) else member.url
    return {"role": role, "url": url, **fields}
