"""The ``epd-flask`` command: start the server, check rosters, reload a running server.

Its options are generated from the declarations in ``settings.py``: each one sets its
environment variable, so ``--workers 4`` and ``EPD_WORKERS=4`` are the same thing and the
gunicorn configuration reads both alike. After checking every setting and the roster (so a
bad one is reported before anything binds), the process becomes the gunicorn master through
``exec``: its pid is the master's, which is what systemd and ``kill -HUP`` want. Standard
library plus the roster schema, like everything the master imports.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import epd_flask
from epd_flask.control import settings
from epd_flask.control.roster import RosterError, load, roster_path
from epd_flask.control.roster import main as check_roster_main

#: gunicorn's configuration and the WSGI application, both inside the package.
CONFIG = "python:epd_flask.control.gunicorn_config"
APP = "epd_flask.wsgi:app"
#: Everything after this argument goes to gunicorn unchanged.
PASSTHROUGH = "--"
#: Commands that run apart from the server, named as data (``module:function``) because
#: they live above control/ and the master must not import them.
COMMANDS = {"register": "epd_flask.fleet.registrant:main"}

_GROUPS = {
    settings.GUNICORN: "server (gunicorn)",
    settings.MASTER: "roster, state and logs",
    settings.APP: "proxy (each worker)",
}
_METAVARS = {int: "N", float: "SECONDS", tuple: "A,B,..."}


class CommandError(Exception):
    """A command could not do what it was asked; the message says why."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-flask",
        usage="epd-flask [OPTIONS] [-- GUNICORN-OPTIONS]\n"
              "       epd-flask [OPTIONS] check-roster [FILE ...]\n"
              "       epd-flask [OPTIONS] reload\n"
              "       epd-flask register --etcd URL --prefix P --role R --url URL [...]",
        description="OpenAI-compatible proxy for disaggregated vLLM serving. With no "
                    "command, start the server (gunicorn with gevent workers) on the roster. "
                    "Every option is also its environment variable; an option wins.",
        epilog="Options for gunicorn itself go after `--`. Keys ("
               + ", ".join(v.name for v in settings.ENV.values() if v.flag is None)
               + ") are environment variables only: a command line is visible to every "
                 "user of the host.",
    )
    parser.add_argument("--version", action="version",
                        version=f"epd-flask {epd_flask.__version__}")
    groups = {reader: parser.add_argument_group(title) for reader, title in _GROUPS.items()}
    for var in settings.ENV.values():
        if var.flag is None:
            continue
        # argparse formats help with %: a literal one is written twice.
        help_text = f"{var.help} (env {var.name}; default: {_shown(var)})".replace("%", "%%")
        group = groups[var.read_by[0]]
        if var.type is bool:
            group.add_argument(var.flag, dest=var.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(var.flag, dest=var.name, default=None, help=help_text,
                               metavar=_metavar(var))
    commands = parser.add_subparsers(dest="command", title="commands (default: serve)",
                                     metavar="COMMAND")
    check = commands.add_parser(
        "check-roster", help="validate roster files (default: the roster above) and exit",
        description="Validate roster files; exit 1 naming the file and field of each error.")
    check.add_argument("files", nargs="*", metavar="FILE")
    reload = commands.add_parser(
        "reload", help="SIGHUP the running server named by --pidfile (EPD_PIDFILE)",
        description="Send SIGHUP to the gunicorn master whose pid is in the pidfile: it "
                    "re-reads the roster (one that fails validation is logged and the last "
                    "good one kept) and replaces its workers while open streams finish.")
    reload.add_argument("--pidfile", dest="EPD_PIDFILE", default=argparse.SUPPRESS,
                        metavar="FILE", help="the pidfile the server writes (env EPD_PIDFILE)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        module, _, function = COMMANDS[args[0]].partition(":")
        return int(getattr(importlib.import_module(module), function)(args[1:]))
    extra: list[str] = []
    if PASSTHROUGH in args:
        cut = args.index(PASSTHROUGH)
        args, extra = args[:cut], args[cut + 1:]
    parser = build_parser()
    opts = parser.parse_args(args)
    if extra and opts.command is not None:
        parser.error(f"arguments after `--` are for gunicorn; `{opts.command}` takes none")
    _apply(parser, opts)
    try:
        if opts.command == "check-roster":
            return check_roster_main(opts.files)
        if opts.command == "reload":
            pid = reload()
            print(f"epd-flask: SIGHUP sent to the master (pid {pid}); it re-reads the roster "
                  "and replaces its workers, open streams finish")
            return 0
        serve(extra)
    except CommandError as exc:
        print(f"epd-flask: {exc}", file=sys.stderr)
        return 1
    return 0  # not reached: serve() replaces this process


def _apply(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Options become their environment variables; then every variable in effect (given
    here or inherited) is checked, so a bad one is reported as a usage error now rather
    than by a gunicorn master or, worse, by each worker."""
    for var in settings.ENV.values():
        value = getattr(opts, var.name, None)
        if value is None:
            continue
        if var.type is bool:
            value = "1" if value else "0"
        os.environ[var.name] = value
    # Those given here first: a bad --port is reported as that flag, not through the
    # default of EPD_BIND, which is made of it.
    given = [v for v in settings.ENV.values() if getattr(opts, v.name, None) is not None]
    for var in [*given, *settings.ENV.values()]:
        try:
            var.read()
        except ValueError as exc:
            parser.error(f"argument {var.flag}: {exc}" if var in given and var.flag
                         else str(exc))


def serve(gunicorn_args: Sequence[str] = ()) -> None:
    """Check the roster, then become gunicorn with the packaged configuration.

    gunicorn's own ``on_starting`` hook validates the roster again (it must, for plain
    ``gunicorn`` starts); checking here too gives one clean line instead of a traceback.
    """
    path = roster_path()
    try:
        load(path)
    except RosterError as exc:
        raise CommandError(f"cannot start: {exc}") from None
    argv = [sys.executable, "-m", "gunicorn", "-c", CONFIG, *gunicorn_args, APP]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def reload() -> int:
    """SIGHUP to the master named by the pidfile; its pid. Refuses a pidfile that is missing,
    unreadable, or names a process that is gone, is this command, is no gunicorn running
    epd-flask, or is one of its workers (a stale file: the pid may belong to something else
    by now, and SIGHUP stops most processes, a gunicorn worker included)."""
    pidfile = settings.read("EPD_PIDFILE")
    if not pidfile:
        raise CommandError("reload: no pidfile named; start the server with --pidfile FILE "
                           "(EPD_PIDFILE) and pass the same one here")
    try:
        text = Path(pidfile).read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise CommandError(f"reload: no server running: {pidfile} does not exist") from None
    except OSError as exc:
        raise CommandError(f"reload: cannot read {pidfile}: {exc.strerror}") from None
    if not text.isdigit() or int(text) <= 0:
        raise CommandError(f"reload: {pidfile} holds no pid: {text[:40]!r}")
    pid = int(text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise CommandError(f"reload: no server running: pid {pid} in {pidfile} has "
                           "exited (stale pidfile)") from None
    except PermissionError:
        raise CommandError(f"reload: pid {pid} in {pidfile} belongs to another user; "
                           "run as the server's user") from None
    if pid == os.getpid():
        raise CommandError(f"reload: pid {pid} in {pidfile} is this command; stale pidfile?")
    argv = _command_line(pid)
    if argv is not None and not _is_ours(argv):
        raise CommandError(f"reload: pid {pid} in {pidfile} is not an epd-flask master "
                           f"({' '.join(argv)[:60]!r}); stale pidfile?")
    parent = _parent(pid)
    above = _command_line(parent) if parent is not None else None
    if above is not None and _is_ours(above):
        raise CommandError(f"reload: pid {pid} in {pidfile} is a worker of the epd-flask "
                           f"master {parent}, which SIGHUP would stop; stale pidfile?")
    os.kill(pid, signal.SIGHUP)
    return pid


def _is_ours(argv: list[str]) -> bool:
    """A gunicorn running our configuration or application: what ``serve`` executes
    (``python -m gunicorn -c python:epd_flask... epd_flask.wsgi:app``), ``gunicorn ...
    epd_flask.wsgi:app``, or either retitled by setproctitle (``gunicorn: master
    [epd_flask.wsgi:app]``). A name that merely contains "gunicorn" (another server, a
    shell whose arguments name the pidfile) is not."""
    runs_gunicorn = bool(argv) and (
        os.path.basename(argv[0]) == "gunicorn" or argv[0].startswith("gunicorn: ")
        or ("-m", "gunicorn") in itertools.pairwise(argv))
    return runs_gunicorn and any("epd_flask" in a for a in argv)


def _command_line(pid: int) -> list[str] | None:
    """The process's arguments where /proc shows them (Linux), else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _shown(var: settings.EnvVar) -> str:
    """The README's default, plus the value itself where that says more (the roster's path
    in this installation)."""
    shown = var.shown_default().replace("`", "") or "unset"
    if isinstance(var.default, str) and var.default and var.default not in shown:
        shown += f": {var.default}"
    return shown


def _metavar(var: settings.EnvVar) -> str:
    if var.choices:
        return "{" + ",".join(var.choices) + "}"
    return var.metavar or _METAVARS.get(var.type, "VALUE")


if __name__ == "__main__":
    sys.exit(main())
