"""``make bench-fleet``'s production trace: Mooncake's rows as requests the simulator counts
exactly, the load point's arithmetic and the rows the JSON gets. The replay itself is not run
here (tests/serving/test_bench_oracle.py runs its oracle)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fleet
import mooncaketrace
import tracereplay
from mooncaketrace import Row

from epd_flask.sim import textgen


def _write(tmp_path: Path, docs: list[dict[str, Any]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_each_block_is_512_tokens_of_the_simulator_and_shared_ids_share_exactly() -> None:
    one = Row(0.0, 1024, 8, (0, 1))
    two = Row(0.0, 1300, 8, (0, 1, 2))
    other = Row(0.0, 1024, 8, (0, 3))
    ids = [textgen.token_ids(mooncaketrace.prompt_text(r)) for r in (one, two, other)]
    assert [len(i) for i in ids] == [1024, 1300, 1024]
    assert textgen.count_tokens(mooncaketrace.prompt_text(two)) == 1300
    assert ids[1][:1024] == ids[0]  # the same two blocks: the same 1024 tokens
    assert ids[2][:512] == ids[0][:512] and ids[2][512] != ids[0][512]
    # A prompt that ends inside a block holds that block's first tokens.
    part = textgen.token_ids(mooncaketrace.prompt_text(Row(0.0, 700, 8, (0, 1))))
    assert part == ids[0][:700]


def test_load_keeps_the_first_rows_and_divides_their_arrivals(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 512, "output_length": 9, "hash_ids": [0]},
        {"timestamp": 9000, "input_length": 10, "output_length": 1, "hash_ids": [4]}])
    rows = mooncaketrace.load(path, limit=2, speed=4.0)
    assert rows == [Row(0.0, 600, 3, (0, 1)), Row(0.5, 512, 9, (0,))]
    assert len(mooncaketrace.load(path)) == 3
    body = mooncaketrace.body(rows[1], "m", max_tokens=4)
    assert body["max_tokens"] == 4 and body["stream"] is True
    assert textgen.count_tokens(body["prompt"]) == 512


def test_a_row_whose_length_does_not_fit_its_blocks_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"timestamp": 0, "input_length": 513, "output_length": 1,
                              "hash_ids": [0]}])
    with pytest.raises(ValueError, match="does not fit 1 blocks"):
        mooncaketrace.load(path)


def test_the_repository_carries_the_whole_conversation_trace() -> None:
    rows = mooncaketrace.load(mooncaketrace.DEFAULT)
    assert len(rows) == 12031 and rows[0].hash_ids[0] == 0
    assert round(sum(r.input_length for r in rows) / len(rows)) == 12035


def test_offline_work_counts_round_robin_caches_apart() -> None:
    rows = [Row(0.0, 1024, 1, (0, 1)), Row(0.1, 1024, 1, (0, 2)), Row(0.2, 1536, 1, (0, 1, 5))]
    one = tracereplay.offline(rows, instances=1)
    assert one["prompt_tokens"] == 3584
    # One infinite cache: block 0 once, block 1 once, then only block 5.
    assert one["oracle"] == 1024 + 512 + 512
    assert one["round_robin"] == one["oracle"]
    # Two instances: the third request is on the first instance again and finds 0 and 1 there.
    assert tracereplay.offline(rows, instances=2)["round_robin"] == 1024 + 1024 + 512
    assert tracereplay.offline(rows, instances=3)["round_robin"] == 3584


def test_one_factor_scales_prefill_and_decode_to_the_load_point() -> None:
    figures = {"prefill_tokens_per_s": 10000.0, "token_delay": 0.01,
               "token_delay_per_stream": 0.001, "kv_cache_blocks": 100, "ttft": 0.0}
    # 64,000 tokens in 2 s is 32,000/s: 4 prefills 80 % busy need 10,000/s each.
    factor = tracereplay.time_factor(64000, 2.0, figures, 0.8, instances=4)
    assert factor == pytest.approx(1.0)
    fast = tracereplay.scaled(figures, tracereplay.time_factor(128000, 2.0, figures, 0.8, 4))
    assert fast == {"prefill_tokens_per_s": 20000.0, "token_delay": 0.005,
                    "token_delay_per_stream": 0.0005, "kv_cache_blocks": 100, "ttft": 0.0}


def _result(*answers: tuple[bool, int, float]) -> dict[str, Any]:
    return {"requests": [{"ok": ok, "status": status, "ttft": ttft, "error": "" if ok else "x"}
                         for ok, status, ttft in answers]}


def test_rows_count_refusals_apart_from_errors_and_json_has_the_contract_keys() -> None:
    variant = fleet.Variant("epd kv_aware", "epd")
    result = _result((True, 200, 0.1), (True, 200, 0.3), (False, 503, 0.0), (False, 502, 0.0),
                     (False, 429, 0.0))
    row = tracereplay.summarize(variant, result, [
        {"prefix_computed_tokens": 70, "prefix_cached_tokens": 30},
        {"prefix_computed_tokens": 5}], oracle=60)
    assert (row["requests"], row["errors"], row["shed"]) == (5, 1, 2)
    assert row["ttft_p50_ms"] == 300.0 and row["prefill_computed_tokens"] == 75
    [doc] = tracereplay.json_rows([row])
    assert list(doc) == ["target", "requests", "errors", "shed", "ttft_p50_ms", "ttft_p90_ms",
                         "ttft_p99_ms", "prefill_computed_tokens", "oracle_prefill_tokens"]
    assert doc["oracle_prefill_tokens"] == 60


def _row(name: str, p50: float, p90: float, computed: int, errors: int = 0) -> dict[str, Any]:
    return {"target": name, "kind": "router" if name.startswith("vllm") else "epd",
            "ttft_p50_ms": p50, "ttft_p90_ms": p90, "prefill_computed_tokens": computed,
            "errors": errors, "shed": 0}


def test_targets_compare_kv_aware_with_the_oracle_and_the_best_router() -> None:
    lines = tracereplay.targets([
        _row("oracle", 100.0, 200.0, 1000), _row("epd kv_aware", 110.0, 260.0, 1050),
        _row("vllm-router round_robin", 150.0, 300.0, 1200),
        _row("vllm-router kv_aware", 120.0, 250.0, 1100),
        _row("epd round_robin", 200.0, 400.0, 1200, errors=2)])
    assert lines[0] == (
        "- `epd kv_aware`: TTFT p50 1.10x and p90 1.30x the oracle's (target ≤ 1.2x: not met);"
        " prefill computed 1.05x the oracle's (target ≤ 1.1x: met); p50/p90 110/260 ms "
        "against vllm-router's best `vllm-router kv_aware` 120/250 ms (target ≤ it: not met).")
    assert lines[-1] == ("- Errors and shed requests for every epd-flask target: not met "
                         "(epd round_robin).")


def test_a_targets_stages_split_its_time_to_the_first_byte(tmp_path: Path) -> None:
    """``--proxy-log-level info``: the prefill leg, decode's first byte and the proxy's own
    rest, from the request lines of a target's logs; other lines ignored."""
    log = tmp_path / "epd-1.log"
    log.write_text(
        "2026-01-01 00:00:00,000 [1] [INFO] gunicorn: Booting worker\n"
        + "".join(f'x [1] [INFO] epd_flask.requests: request_id=r{i} routing="decode:a b" '
                  f"prefill_ms={100 + i} decode_first_byte_ms=20 first_byte_ms={150 + i} "
                  f"total_ms=300\n" for i in range(10)))
    got = tracereplay.stages([log])
    assert got == {"prefill": (105.0, 109.0), "decode_first_byte": (20.0, 20.0),
                   "proxy": (30.0, 30.0)}
    assert tracereplay.stages([]) == {}
