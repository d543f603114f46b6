"""KV connectors: one module each behind the small ``Connector`` interface.

Adding a connector is a module with a ``SplitConnector`` subclass (or anything satisfying
``Connector``) and a line in ``CONNECTORS``; the roster's ``connector`` setting names it.
"""

from __future__ import annotations

from collections.abc import Callable

from epd_flask.serving.connectors.base import (
    Connector,
    LegRequest,
    PickPrefill,
    Placement,
    Readiness,
    Route,
    SplitConnector,
    prime_body,
)
from epd_flask.serving.connectors.mooncake import MooncakeConnector
from epd_flask.serving.connectors.nixl import NixlConnector
from epd_flask.serving.connectors.none import NoneConnector
from epd_flask.serving.connectors.p2p_nccl import P2pNcclConnector

CONNECTORS: dict[str, type[SplitConnector]] = {
    "nixl": NixlConnector,
    "none": NoneConnector,
    "mooncake": MooncakeConnector,
    "p2p_nccl": P2pNcclConnector,
}


def connector_class(name: str) -> type[SplitConnector]:
    try:
        return CONNECTORS[name]
    except KeyError:
        raise ValueError(
            f"connector {name!r} is not available in this build; choose one of "
            + ", ".join(sorted(CONNECTORS))
        ) from None


def get_connector(name: str, pick_prefill: PickPrefill,
                  readiness: Callable[[], Readiness] | None = None) -> Connector:
    return connector_class(name)(pick_prefill, readiness)


__all__ = ["CONNECTORS", "Connector", "LegRequest", "PickPrefill", "Placement", "Readiness",
           "Route", "SplitConnector", "connector_class", "get_connector", "prime_body"]
