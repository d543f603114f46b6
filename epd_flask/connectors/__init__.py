"""KV connectors: one module each behind the small ``Connector`` interface."""

from __future__ import annotations

from epd_flask.connectors.base import Connector, prime_body
from epd_flask.connectors.nixl import NixlConnector
from epd_flask.connectors.none import NoneConnector

CONNECTORS: dict[str, type] = {
    "nixl": NixlConnector,
    "none": NoneConnector,
}


def get_connector(name: str) -> Connector:
    try:
        return CONNECTORS[name]()
    except KeyError:
        raise ValueError(
            f"connector {name!r} is not available in this build; choose one of "
            + ", ".join(sorted(CONNECTORS))
        ) from None


__all__ = ["CONNECTORS", "Connector", "get_connector", "prime_body"]
