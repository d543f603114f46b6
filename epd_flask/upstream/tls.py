"""Trust and identity for https:// instances (docs/behaviour.md#transport): which CAs we
believe, which certificate we show, re-read when the files on disk change.

Imported by the transport only (inside workers): loading ``ssl`` in the gunicorn master is not
allowed, and gevent must have patched it first.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_TLS_VERSION = ssl.TLSVersion.TLSv1_2


class TLSConfigError(ValueError):
    """A CA bundle or client certificate that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TLSFiles:
    """Paths an operator configured; all optional (no CA bundle: the system trust store)."""

    ca_bundle: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    def labelled(self) -> tuple[tuple[str, str], ...]:
        pairs = (("CA bundle", self.ca_bundle), ("client certificate", self.client_cert),
                 ("client key", self.client_key))
        return tuple((label, path) for label, path in pairs if path)


def _identity(label: str, path: str) -> tuple[int, ...]:
    # os.stat follows symlinks, so a Kubernetes secret update (an atomic swap of the ..data
    # symlink) shows up as a new inode, and an in-place rewrite as a new mtime/size.
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TLSConfigError(f"{label} {path} does not exist") from None
    except OSError as exc:
        raise TLSConfigError(f"{label} {path} cannot be read: {exc.strerror or exc}") from None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def build_context(files: TLSFiles) -> ssl.SSLContext:
    """A client context that trusts exactly the configured bundle (or the system store when
    none is configured), speaks TLS >= 1.2 and checks host names."""
    try:
        if files.ca_bundle:
            # create_default_context(cafile=...) loads only that file, no system CAs.
            context = ssl.create_default_context(cafile=files.ca_bundle)
            if not context.get_ca_certs():
                raise TLSConfigError(
                    f"CA bundle {files.ca_bundle} holds no CA certificate")
        else:
            context = ssl.create_default_context()
    except FileNotFoundError:
        raise TLSConfigError(f"CA bundle {files.ca_bundle} does not exist") from None
    except (ssl.SSLError, OSError) as exc:
        raise TLSConfigError(
            f"CA bundle {files.ca_bundle} is not a usable PEM CA bundle: {exc}") from None
    context.minimum_version = MIN_TLS_VERSION
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    if files.client_cert:
        try:
            context.load_cert_chain(files.client_cert, files.client_key or None)
        except FileNotFoundError:
            raise TLSConfigError(
                f"client certificate {files.client_cert} or key {files.client_key} "
                "does not exist") from None
        except (ssl.SSLError, OSError) as exc:
            raise TLSConfigError(
                f"client certificate {files.client_cert} / key {files.client_key} cannot "
                f"be loaded (PEM certificate and matching unencrypted key needed): {exc}"
            ) from None
    elif files.client_key:
        raise TLSConfigError("a client key was configured without a client certificate")
    return context


class TrustStore:
    """The current client ``SSLContext``, rebuilt when any configured file changes.

    ``current()`` costs one ``stat`` per configured file, so it can run on every https
    request: a rotated bundle is trusted from the next request on, without a restart. A file
    that becomes unusable fails closed (``TLSConfigError``) rather than falling back to an
    older or wider trust; the failure is cached per file identity so a broken file is not
    re-parsed on every request.
    """

    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self._key: tuple[tuple[int, ...], ...] | None = None
        self._context: ssl.SSLContext | None = None
        self._error: TLSConfigError | None = None
        self.generation = 0
        self.current()

    def current(self) -> ssl.SSLContext:
        """Load now; raises ``TLSConfigError`` with an operator-facing message."""
        key = tuple(_identity(label, path) for label, path in self.files.labelled())
        if key == self._key:
            if self._error is not None:
                raise self._error
            assert self._context is not None
            return self._context
        self._key = key
        try:
            context = build_context(self.files)
        except TLSConfigError as exc:
            self._error, self._context = exc, None
            logger.error("upstream TLS: %s", exc)
            raise
        if self._context is not None or self._error is not None:
            logger.warning("upstream TLS files changed; new connections use them from now on")
        self._context, self._error = context, None
        self.generation += 1
        return context
