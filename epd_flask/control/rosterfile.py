"""Registering and removing instances in the roster file itself (the admin API's storage).

The file is re-read for every change, edited with ruamel.yaml so the operator's comments and
layout survive, validated exactly as a reload would validate it, and replaced atomically.
Only workers import this (ruamel.yaml stays out of the gunicorn master).
"""

from __future__ import annotations

import errno
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError as RuamelError
from ruamel.yaml.scalarstring import DoubleQuotedScalarString

from epd_flask.control import settings as declared
from epd_flask.control.roles import PREFILL_DECODE
from epd_flask.control.roster import (
    Instance,
    RoleConflict,
    Roster,
    RosterError,
    RosterTooLarge,
    mixes_roles,
    parse,
    parse_text,
    read_text,
    yaml_error,
)
from epd_flask.control.statedir import atomic_write


class RosterFileError(RosterError):
    """The roster file on disk is unreadable or invalid, so it cannot be edited safely."""


class RosterWriteError(RosterError):
    """The edited roster could not be written (read-only mount, full disk)."""

    def __init__(self, message: str, read_only: bool = False) -> None:
        super().__init__(message)
        self.read_only = read_only


@dataclass(frozen=True)
class Change:
    status: str  # "registered" | "updated" | "unchanged" | "removed"
    roster: Roster
    instance: Instance | None = None


def register(path: str | os.PathLike[str], inst: Instance) -> Change:
    """Add ``inst`` to the file, or update the record with the same URL and role.

    An identical record is left alone (re-registering is a no-op, docs/behaviour.md#roster).
    A URL already listed in another role, or a role that would mix combined and split
    serving, is a RoleConflict.
    """
    target = _real(path)
    current, doc = _read(target)
    existing = next((i for i in current.instances if i.url == inst.url), None)
    if existing is not None and existing.role != inst.role:
        raise RoleConflict(
            f"instance {inst.url} is registered as {existing.role}; an instance cannot change "
            f"role in place: DELETE it first, then register it as {inst.role}")
    if existing == inst:
        return Change("unchanged", current, existing)
    if mixes_roles(inst.role, (i.role for i in current.instances)):
        serving = "split prefill/decode" if inst.role == PREFILL_DECODE \
            else "combined prefill_decode"
        raise RoleConflict(f"cannot register {inst.url} as {inst.role}: the roster serves "
                           f"{serving} instances, and the two are never mixed")
    entries = _instances(doc)
    record = _flow(inst.record())
    if existing is None:
        entries.append(record)
        status = "registered"
    else:
        entries[_index(entries, inst.url)] = record
        status = "updated"
    return Change(status, _write(target, doc), inst)


def unregister(path: str | os.PathLike[str], url: str) -> Change:
    """Remove the instance with ``url``; a KeyError when the file does not list it."""
    target = _real(path)
    current, doc = _read(target)
    existing = next((i for i in current.instances if i.url == url), None)
    if existing is None:
        raise KeyError(url)
    entries = _instances(doc)
    del entries[_index(entries, url)]
    return Change("removed", _write(target, doc), existing)


def _real(path: str | os.PathLike[str]) -> Path:
    # A symlinked roster (configuration management, a mounted volume) keeps its link: the
    # file it points to is the one replaced.
    return Path(os.path.realpath(path))


def _yaml() -> YAML:
    y = YAML()  # round-trip mode: comments, key order and flow style are kept
    y.preserve_quotes = True
    y.indent(mapping=2, sequence=4, offset=2)
    y.width = 4096
    return y


def _read(target: Path) -> tuple[Roster, Any]:
    """The file as a reload reads it (same limits, same errors, which never quote it),
    then once more with ruamel.yaml for editing."""
    try:
        text = read_text(target)
        current = parse_text(text, str(target))
    except RosterError as exc:
        raise RosterFileError(f"the roster file is invalid, fix it before changing instances "
                              f"through the API: {exc}") from None
    try:
        doc = _yaml().load(text)
    except (RuamelError, RecursionError) as exc:
        raise RosterFileError(f"{target}: not valid YAML{yaml_error(exc)}") from None
    if doc is None:
        doc = CommentedMap()
    return current, doc


def _instances(doc: Any) -> CommentedSeq:
    entries = doc.get("instances")
    if entries is None:
        entries = doc["instances"] = CommentedSeq()
    return entries


def _index(entries: CommentedSeq, url: str) -> int:
    for n, entry in enumerate(entries):
        if isinstance(entry, dict) and str(entry.get("url", "")).strip().rstrip("/") == url:
            return n
    raise KeyError(url)


def _flow(record: dict[str, Any]) -> CommentedMap:
    """One instance per line, like the shipped roster."""
    entry = CommentedMap()
    for key, value in record.items():
        if isinstance(value, list):
            value = CommentedSeq(_quoted(v) for v in value)
            value.fa.set_flow_style()
        entry[key] = _quoted(value)
    entry.fa.set_flow_style()
    return entry


def _quoted(value: Any) -> Any:
    """Addresses in double quotes, as the shipped roster writes them."""
    return DoubleQuotedScalarString(value) if isinstance(value, str) and ":" in value else value


def _write(target: Path, doc: Any) -> Roster:
    """Validate the edited document exactly as a reload would read it, then replace."""
    out = io.StringIO()
    _yaml().dump(doc, out)
    text = out.getvalue()
    limit = declared.read("EPD_ROSTER_MAX_BYTES")
    if len(text.encode("utf-8")) > limit:
        raise RosterTooLarge(f"{target}: the edited roster would be larger than "
                             f"EPD_ROSTER_MAX_BYTES ({limit})")
    roster = parse(yaml.safe_load(text), str(target))
    try:
        atomic_write(target, text.encode("utf-8"))
    except OSError as exc:
        read_only = exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        raise RosterWriteError(
            f"{target}: cannot write the roster file: {exc.strerror or exc}"
            + ("; it is read-only here, so the admin API cannot change it (edit the file "
               "where it comes from and send SIGHUP)" if read_only else ""),
            read_only) from None
    return roster
