"""``make bench-fleet``'s arithmetic: the loaded scenario's capacity, round_robin's work, and
the target lines it writes into docs/benchmarks.md. The bench itself is not run here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import chattrace
import fleet


def _item(t: float, session: int, system: str, user: str) -> dict[str, Any]:
    return {"t": t, "session": session, "turn": 0, "body": {
        "model": "tiny-llama", "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}}


def test_round_robin_work_counts_each_instance_cache_apart() -> None:
    system = "the cache " * 400
    trace = [_item(0.0, 0, system, "one"), _item(0.1, 1, system, "two")]
    _, oracle = fleet.oracle_computed(trace)
    # One instance: the second request finds the system prompt, as the oracle does.
    assert fleet.round_robin_computed(trace, instances=1) == oracle
    # Two: the second request lands on the other instance and computes it again.
    assert fleet.round_robin_computed(trace, instances=2) > oracle + 900


def test_loaded_figures_put_round_robin_at_the_asked_utilisation() -> None:
    figures = fleet.loaded_figures(fleet.FIGURES, computed=64000, duration=10.0,
                                   utilisation=0.8, instances=4)
    assert figures["prefill_tokens_per_s"] == 2000.0  # 6400 tokens/s over 4 x 0.8
    assert {k: v for k, v in figures.items() if k != "prefill_tokens_per_s"} == {
        k: v for k, v in fleet.FIGURES.items() if k != "prefill_tokens_per_s"}
    assert fleet.FIGURES["prefill_tokens_per_s"] == 15000.0


def test_the_trace_is_the_same_for_every_target() -> None:
    spec = chattrace.TraceSpec(seed=3, duration=4.0, rate=2.0)
    assert chattrace.generate(spec) == chattrace.generate(spec)
    assert chattrace.generate(spec) != chattrace.generate(
        chattrace.TraceSpec(seed=4, duration=4.0, rate=2.0))


def _row(name: str, p50: float, p99: float, computed: int = 100, cached: int = 100,
         oracle: float = 1.0) -> dict[str, Any]:
    return {"target": name, "kind": "router" if name.startswith("vllm") else "epd",
            "combined": name.endswith("(PD)"), "workers": 4 if "hosts" in name else 1,
            "sent": 10, "completed": 10, "ttft_p50": p50, "ttft_p99": p99,
            "computed": computed, "cached": cached, "vs_oracle": oracle}


def test_targets_report_each_figure_against_its_bound() -> None:
    loaded = fleet.Scenario("loaded", 10.0, 1.0, 0.8)
    rows = [_row("epd round_robin", 1.0, 2.0, oracle=2.0),
            _row("epd prefix", 0.4, 2.1, computed=60, cached=140, oracle=1.1),
            _row("epd least_loaded", 0.9, 2.4, oracle=2.0),
            _row("epd prefix, 2 hosts x 2 workers", 0.1, 9.0, computed=70, cached=130),
            _row("vllm-router round_robin", 1.0, 2.0),
            _row("vllm-router cache_aware", 0.5, 2.0)]
    lines = "\n".join(fleet.targets(loaded, rows))
    assert "best epd-flask policy `epd prefix` 400 ms, 0.40x" in lines  # not the 4-worker row
    assert "target ≤ 0.5x: met" in lines
    assert "vllm-router's best `vllm-router cache_aware` 500 ms (target ≤ it: met)" in lines
    assert "`epd prefix`, 1.10x the oracle (target ≤ 1.2x: met)" in lines
    assert "`epd prefix` 70.0 %, `epd prefix, 2 hosts x 2 workers` 65.0 %" in lines
    assert "largest gap 5.0 points (target ≤ 5: met)" in lines
    assert "`epd prefix` 1.05x" in lines and "`epd least_loaded` 1.20x" in lines
    assert "no epd-flask policy above 1.10x: not met" in lines


def test_the_light_scenario_has_no_capacity_line() -> None:
    light = fleet.Scenario("light", 10.0, 1.0)
    rows = [_row("epd round_robin", 1.0, 2.0), _row("epd prefix", 0.7, 5.0)]
    lines = "\n".join(fleet.targets(light, rows))
    assert "0.70x" in lines and "not met" in lines
    assert "of capacity" not in lines
    assert light.label == "fleet-light" and fleet.Scenario("loaded", 1.0, 1.0, 0.8).label == \
        "fleet-loaded"


def test_the_model_routes_through_the_proxy_decisions_and_the_sim_costs() -> None:
    import fleetmodel

    trace = chattrace.generate(chattrace.TraceSpec(seed=14, duration=6.0, rate=3.0))
    rr = fleetmodel.replay(trace, "round_robin", rate=1000.0)
    assert rr["computed"] == fleet.round_robin_computed(trace)
    assert len(rr["ttfts"]) == len(trace) and min(rr["ttfts"]) > 0
    prefix = fleetmodel.replay(trace, "prefix", rate=1000.0)
    assert prefix["computed"] < rr["computed"]
    assert fleetmodel.replay(trace, "ideal", rate=1000.0)["computed"] <= rr["computed"]


def test_vllm_router_counters_say_how_its_cache_aware_policies_decided() -> None:
    text = ('# TYPE vllm_router_kv_routing_inputs_total counter\n'
            'vllm_router_prefix_routing_decisions_total{policy="kv_aware",stage="prefill",'
            'outcome="load_fallback"} 6\n'
            'vllm_router_kv_routing_inputs_total{transport="pd",result="tokenize"} 12\n'
            'vllm_router_kv_routing_inputs_total{transport="http",result="tokenize"} 3\n'
            'vllm_router_policy_decisions_total{policy="round_robin",worker="x"} 6\n')
    assert fleet.parse_router_counters(text) == {"prefill:load_fallback": 6.0,
                                                 "inputs:tokenize": 15.0}
