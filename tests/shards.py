"""``make test`` on every core: the suite spends most of its time waiting (on gunicorn, on
timeouts a test provokes), using about 0.6 of one core, so two pytest processes share it.

``python tests/shards.py N COMMAND...`` runs COMMAND (a pytest invocation) N times at once.
Each process collects the whole suite and runs the test files it claims: a file is claimed
by creating a marker in a directory they share, first come first served in collection order,
so a process that finished a long file takes the next one and none waits for a slow peer
(the long gunicorn files come first). A file's tests run in one process, in their order,
with its fixtures set up once. The first process writes as it goes, the others' outputs
follow at the end; the exit status is the first failure's (a process that claimed nothing
counts as passed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

#: The directory the processes claim files in; set by the runner, unset outside it.
CLAIMS = "EPD_TEST_CLAIMS"
NO_TESTS = pytest.ExitCode.NO_TESTS_COLLECTED


def claim(directory: str, path: str) -> bool:
    marker = Path(directory) / hashlib.sha1(path.encode()).hexdigest()
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> object:
    """Runs the claimed files' tests (pytest's own loop, less the files another process
    claimed); outside ``shards.py`` pytest's loop runs as usual."""
    directory = os.environ.get(CLAIMS)
    if not directory or session.config.option.collectonly or not session.items:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    files: dict[str, list[pytest.Item]] = {}
    for item in session.items:
        files.setdefault(item.location[0], []).append(item)
    for path, items in files.items():
        if not claim(directory, path):
            continue
        for i, item in enumerate(items):
            nextitem = items[i + 1] if i + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
    return True


def main(argv: list[str]) -> int:
    jobs, command = int(argv[0]), argv[1:]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="epd-claims-") as claims, ExitStack() as stack:
        env = {**os.environ, CLAIMS: claims}
        command = [*command, "-p", "tests.shards"]
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(1, jobs)]
        procs = [subprocess.Popen(command, env=env)]
        procs += [subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                  for log in logs]
        codes = [p.wait() for p in procs]
        for n, log in enumerate(logs, start=2):
            log.seek(0)
            sys.stdout.write(f"\n===== tests, process {n} of {jobs} =====\n")
            sys.stdout.write(log.read().decode(errors="replace"))
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    print(f"\n{jobs} processes, {time.monotonic() - started:.1f} s, exit codes {codes}")
    if failed:
        return failed[0]
    return 0 if 0 in codes else NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
