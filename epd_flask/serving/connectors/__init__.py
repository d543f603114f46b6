"""KV connectors: one module each behind the small ``Connector`` interface.

Adding a connector is a module with a ``SplitConnector`` subclass (or anything satisfying
``Connector``) and a line in ``control/connectorspecs.py`` naming it and the instance fields it
needs; the roster's ``connector`` setting names it. The line lives in control/ because the
gunicorn master validates rosters without importing this package; here the name becomes the
class.
"""

from __future__ import annotations

import importlib

from epd_flask.control.connectorspecs import CONNECTORS
from epd_flask.fleet.policies import Placement
from epd_flask.serving.connectors.base import (
    Body,
    Connector,
    LegRequest,
    Route,
    SplitConnector,
    prime_body,
)


def connector_class(name: str) -> type[SplitConnector]:
    try:
        spec = CONNECTORS[name]
    except KeyError:
        raise ValueError(
            f"connector {name!r} is not available in this build; choose one of "
            + ", ".join(sorted(CONNECTORS))
        ) from None
    module, _, attr = spec.implementation.partition(":")
    cls: type[SplitConnector] = getattr(importlib.import_module(module), attr)
    return cls


def get_connector(name: str) -> Connector:
    return connector_class(name)()


__all__ = ["CONNECTORS", "Body", "Connector", "LegRequest", "Placement", "Route",
           "SplitConnector", "connector_class", "get_connector", "prime_body"]
