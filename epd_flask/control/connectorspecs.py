"""Which KV connectors this build has and what each needs from the roster: the one line that
adds a connector.

The gunicorn master validates every roster (at start and on SIGHUP) and must not import the
serving path, so a connector is declared here as data: where its implementation lives
(``module:Class``, imported only by workers, the way gunicorn's ``SUPPORTED_WORKERS`` names
worker classes so its master never loads gevent) and the instance fields it needs per role.
The roster checks both; ``serving.connectors`` turns the name into the class. Imports nothing
of ours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Need:
    """An instance field the connector cannot work without on instances of these roles."""

    field: str
    roles: tuple[str, ...]
    message: str  # for the operator, after "instance <url>: "


@dataclass(frozen=True)
class ConnectorSpec:
    implementation: str  # "package.module:Class"
    needs: tuple[Need, ...] = ()


_HERE = "epd_flask.serving.connectors"

CONNECTORS: dict[str, ConnectorSpec] = {
    "nixl": ConnectorSpec(f"{_HERE}.nixl:NixlConnector"),
    "none": ConnectorSpec(f"{_HERE}.none:NoneConnector"),
    "mooncake": ConnectorSpec(f"{_HERE}.mooncake:MooncakeConnector", needs=(
        Need("bootstrap_url", ("prefill",),
             "the mooncake connector needs bootstrap_url on every prefill (its Mooncake "
             "bootstrap server, e.g. http://host:8998)"),
    )),
    "p2p_nccl": ConnectorSpec(f"{_HERE}.p2p_nccl:P2pNcclConnector", needs=(
        Need("kv_zmq_addr", ("prefill", "decode"),
             "the p2p_nccl connector needs kv_zmq_addr (host:port of its P2pNcclConnector) on "
             "every prefill and decode"),
    )),
}


def expected() -> str:
    """The names as pydantic words a choice (``'a', 'b' or 'c'``), for the unknown-name error."""
    names = [repr(n) for n in CONNECTORS]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
