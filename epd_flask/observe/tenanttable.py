"""The ``/status`` page's tenant table (docs/behaviour.md#admission): per tenant its class and
weight from the roster, what admission did with its requests from the metrics (summed over
the workers, over the page's window, like the rest of the page), and its rate-limit buckets
as the store holds them now; and whether the shared store answers. Shown while admission is
on; statuspage.py places the HTML.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epd_flask.observe.families import Families, sample
from epd_flask.observe.history import Snapshot
from epd_flask.observe.statuspage import Latency, _latency, _ms, _rate, buckets, delta, summed


@dataclass
class TenantRow:
    name: str
    priority: str
    weight: float
    waiting: float
    admitted: float
    #: Of the admitted, those that waited for capacity: how many, and how long.
    wait: Latency
    rejected: dict[str, float]
    tokens: float
    #: The buckets now, by kind (``requests``, ``tokens``): ``limit``, ``remaining``,
    #: ``reset``; empty for a tenant without limits.
    limits: Mapping[str, Mapping[str, float]]


@dataclass
class Tenants:
    rows: list[TenantRow]
    #: The shared rate-limit store: True answering, False not (each host counts its own),
    #: None when the roster names none.
    store_up: bool | None
    #: Seconds the counts cover (None: since the worker started).
    window: float | None


def build(m: Families, now: Snapshot, then: Snapshot | None,
          gate: Mapping[str, Any]) -> Tenants:
    """The table from two snapshots of the app's metrics and the gate's ``snapshot()``
    (which tenants, their records and buckets, the store as this worker last saw it)."""
    a = m.admission
    waiting: dict[tuple[str, ...], float] = {}
    admitted: dict[tuple[str, ...], float] = {}
    tokens: dict[tuple[str, ...], float] = {}
    rejected: dict[tuple[str, ...], float] = {}
    waits: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    if a is not None:
        waiting = summed(list(now.series(sample(a.queue_depth))), ["tenant"])
        admitted = summed(delta(now, then, sample(a.admitted)), ["tenant"])
        tokens = summed(delta(now, then, sample(a.tokens)), ["tenant"])
        rejected = summed(delta(now, then, sample(a.rejected)), ["tenant", "reason"])
        waits = buckets(delta(now, then, sample(a.wait_seconds, "_bucket")), ["tenant"])
    rows = []
    for name, t in gate["tenants"].items():
        key = (name,)
        rows.append(TenantRow(
            name, t["priority"], t["weight"], waiting.get(key, 0.0), admitted.get(key, 0.0),
            _latency("wait", waits.get(key, [])),
            {reason: n for (tenant, reason), n in sorted(rejected.items())
             if tenant == name and n > 0},
            tokens.get(key, 0.0), t.get("limits", {})))
    store_up = gate.get("store_up")
    if store_up is not None and a is not None and a.store_up.gauge is not None:
        lowest = [v for _, v in now.series(sample(a.store_up.gauge))]  # the lowest worker
        if lowest:
            store_up = min(lowest) >= 1
    return Tenants(rows, store_up, None if then is None else now.taken - then.taken)


def render(table: Tenants) -> str:
    e = html.escape
    if table.store_up is None:
        store = "none: each host counts its tenants' rate limits on its own"
    elif table.store_up:
        store = "shared, <span class=\"live\">UP</span>"
    else:
        store = ("shared, <span class=\"evicted\">DOWN</span>: each host counts on its own "
                 "until it answers")
    out = ["<h2>Tenants</h2>", f"<p>Rate-limit store: {store}.</p>",
           "<table><tr><th class=\"l\">tenant</th><th class=\"l\">priority</th>"
           "<th>weight</th><th>waiting</th><th>admitted</th><th>per second</th>"
           "<th>waited</th><th>wait p50</th><th>wait p99</th><th class=\"l\">rejected</th>"
           "<th>tokens</th><th>requests/min (left)</th><th>tokens/min (left)</th></tr>"]
    for t in table.rows:
        refused = ", ".join(f"{reason} {n:.0f}" for reason, n in t.rejected.items()) or "0"
        out.append(
            f"<tr><td class=\"l\">{e(t.name)}</td><td class=\"l\">{e(t.priority)}</td>"
            f"<td>{t.weight:g}</td><td>{t.waiting:.0f}</td><td>{t.admitted:.0f}</td>"
            f"<td>{_rate(t.admitted, table.window)}</td><td>{t.wait.count:.0f}</td>"
            f"<td>{_ms(t.wait.p50)}</td><td>{_ms(t.wait.p99)}</td>"
            f"<td class=\"l\">{e(refused)}</td><td>{t.tokens:.0f}</td>"
            f"<td>{_limit(t.limits.get('requests'))}</td>"
            f"<td>{_limit(t.limits.get('tokens'))}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _limit(level: Mapping[str, float] | None) -> str:
    """``600 (412)``: the limit and what is left of it now."""
    if level is None:
        return "-"
    return f"{level['limit']:.0f} ({max(0.0, level['remaining']):.0f})"
