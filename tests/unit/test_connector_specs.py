"""The master's connector declarations and the connector modules agree: every declared name
resolves to its class, and every connector module is declared."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from epd_flask.control.connectorspecs import CONNECTORS
from epd_flask.control.roster import ROLES, Instance, RosterError, parse
from epd_flask.serving import connectors
from epd_flask.serving.connectors import SplitConnector, connector_class


@pytest.mark.parametrize("name", sorted(CONNECTORS))
def test_each_declared_connector_is_its_class_and_needs_real_fields(name: str) -> None:
    cls = connector_class(name)
    assert issubclass(cls, SplitConnector) and cls.name == name
    for need in CONNECTORS[name].needs:
        assert need.field in Instance.model_fields
        assert set(need.roles) <= set(ROLES)
        assert need.message.startswith(f"the {name} connector needs {need.field}")


def test_every_connector_module_is_declared() -> None:
    found = set()
    for info in pkgutil.iter_modules(connectors.__path__):
        module = importlib.import_module(f"{connectors.__name__}.{info.name}")
        found |= {cls.name for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, SplitConnector) and cls.name
                  and cls.__module__ == module.__name__}
    assert found == set(CONNECTORS)


@pytest.mark.parametrize(("connector", "instances", "message"), [
    ("carrier", [], "settings field 'connector': Input should be 'nixl', 'none', 'mooncake' "
                    "or 'p2p_nccl'"),
    (5, [], "settings field 'connector': Input should be 'nixl', 'none', 'mooncake' or "
            "'p2p_nccl'"),
    ("mooncake", [{"role": "prefill", "url": "http://p:1"}],
     "instance http://p:1: the mooncake connector needs bootstrap_url on every prefill (its "
     "Mooncake bootstrap server, e.g. http://host:8998)"),
    ("p2p_nccl", [{"role": "prefill", "url": "http://p:1", "kv_zmq_addr": "p:1"},
                  {"role": "decode", "url": "http://d:1"}],
     "instance http://d:1: the p2p_nccl connector needs kv_zmq_addr (host:port of its "
     "P2pNcclConnector) on every prefill and decode"),
])
def test_the_master_refuses_a_roster_its_connector_cannot_serve(
        connector: object, instances: list[dict], message: str) -> None:
    with pytest.raises(RosterError) as info:
        parse({"settings": {"connector": connector}, "instances": instances}, "roster.yaml")
    assert str(info.value) == f"roster.yaml: {message}"


def test_an_unknown_name_in_a_worker_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'carrier' is not available in this build; choose "
                                         "one of mooncake, nixl, none, p2p_nccl"):
        connector_class("carrier")
