"""Which routing policies this build has: the one line that adds a policy
(docs/behaviour.md#routing-policies).

The gunicorn master validates the roster's ``routing:`` setting and must not import the fleet
package, so a policy is declared here as data: its name and where its class lives
(``module:Class``, imported only by workers), as connectors are in ``connectorspecs.py``.
``fleet.policies.build`` turns a name into an instance. Imports nothing of ours.
"""

from __future__ import annotations

_HERE = "epd_flask.fleet"

POLICIES: dict[str, str] = {
    "round_robin": f"{_HERE}.policies:RoundRobin",
    "least_loaded": f"{_HERE}.policies:LeastLoaded",
    "prefix": f"{_HERE}.policies:Prefix",
    "session": f"{_HERE}.policies:Session",
    "kv_aware": f"{_HERE}.kvaware:KVAware",
}
#: A role the roster's ``routing:`` leaves out routes by this one.
DEFAULT = "round_robin"


def expected() -> str:
    """The names as pydantic words a choice (``'a', 'b' or 'c'``), for the unknown-name error."""
    names = [repr(n) for n in POLICIES]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
