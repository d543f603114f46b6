"""``epd-flask-sim``: run one simulated vLLM server in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import gevent

from .batch import POLICIES as SCHEDULING_POLICIES
from .config import DEFAULT_KV_CACHE_BLOCKS, EC_METADATA_MODES, KV_CONNECTORS, ROLES, SimConfig
from .kvcache import DEFAULT_BLOCK_SIZE
from .server import SimServer

logger = logging.getLogger(__name__)

MS = 1000.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epd-flask-sim",
        description="A simulated vLLM 0.32 OpenAI server (no GPU) in an EPD role. Runtime "
        "control: GET /sim/stats, GET /sim/requests?limit=N, POST /sim/config, "
        "POST /sim/faults, POST /sim/reset.",
    )
    p.add_argument("--role", choices=ROLES, default="prefill_decode",
                   help="what the server plays: encoder-only, KV producer, KV consumer or a "
                   "plain server (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to bind; 0 picks a free one (default: %(default)s)")
    p.add_argument("--model", "--served-model-name", dest="model", default="tiny-llama",
                   help="served model name; other names get vLLM's 404 (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=512,
                   help="context length; longer requests get vLLM's 400 (default: %(default)s)")
    p.add_argument("--ttft-ms", type=float, default=0.0,
                   help="milliseconds before the first token (default: %(default)s)")
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="milliseconds between tokens (default: %(default)s)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=0.0,
                   help="cost model: prefill throughput in uncached tokens/s, shared by "
                   "concurrent prefills; 0 = off (default: %(default)s)")
    p.add_argument("--token-delay-per-stream-ms", type=float, default=0.0,
                   help="cost model: milliseconds added to --token-delay-ms per other running "
                   "stream (default: %(default)s)")
    p.add_argument("--token-delay-per-context-token-us", type=float, default=0.0,
                   help="cost model: microseconds added to --token-delay-ms per token of "
                   "context the other running streams hold (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="requests the engine runs at once, the others wait, as vLLM's "
                   "--max-num-seqs; 0 = no bound (default: %(default)s)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="the order waiting requests run in, as vLLM's: fcfs, or priority "
                   "(lowest `priority` first) (default: %(default)s)")
    p.add_argument("--kv-cache-blocks", type=int, default=DEFAULT_KV_CACHE_BLOCKS,
                   help="prefix cache size in blocks, LRU (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per prefix-cache block, as vLLM's (default: %(default)s)")
    p.add_argument("--kv-events-config", default=None,
                   help="publish KV-cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": "
                   "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5558\", \"topic\": "
                   "\"kv\"}'; tcp://*:PORT binds (tcp://*:0: a free port, see GET "
                   "/kv_event_sources), tcp://HOST:PORT connects (default: no events)")
    p.add_argument("--output-tokens", type=int, default=16,
                   help="tokens in a full answer; max_tokens cuts it (default: %(default)s)")
    p.add_argument("--secret", default="epd-sim",
                   help="fleet secret that signs KV handles; prefill and decode must share it "
                   "(default: %(default)s)")
    p.add_argument("--engine-id", default=None,
                   help="engine id; default: a new uuid4 on every start, as real vLLM")
    p.add_argument("--dp-size", type=int, default=1,
                   help="data-parallel ranks; x-data-parallel-rank must be below it "
                   "(default: %(default)s)")
    p.add_argument("--bootstrap-port", type=int, default=None,
                   help="prefill only: run a Mooncake bootstrap server (GET /query) on this "
                   "port (0: any free port) and imitate MooncakeConnector instead of NIXL")
    p.add_argument("--kv-timeout-ms", type=float, default=30000.0,
                   help="Mooncake decode: milliseconds to wait for the prefill's KV before "
                   "answering 500 (default: %(default)s)")
    p.add_argument("--kv-connector", choices=KV_CONNECTORS, default=None,
                   help="the KV connector to imitate: nixl (prefill returns handles), "
                   "mooncake (the router builds them), example (no handles: KV is found by "
                   "prompt). Default: mooncake with --bootstrap-port, else nixl")
    p.add_argument("--prompt-tokens-details", action="store_true",
                   help="report prefix-cache hits in usage.prompt_tokens_details, as vLLM "
                   "does with --enable-prompt-tokens-details (default: null, as vLLM)")
    p.add_argument("--ec-metadata", choices=EC_METADATA_MODES, default="grid",
                   help="encoder metadata per item: a plausible image grid, or {} as real "
                   "LLaVA sends (default: %(default)s)")
    p.add_argument("--record-limit", type=int, default=200,
                   help="recent requests kept for GET /sim/requests (default: %(default)s)")
    p.add_argument("--keepalive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open after a response, "
                   "as vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE; 0 keeps it forever "
                   "(default: %(default)s)")
    p.add_argument("--tls-cert", default=None,
                   help="serve https with this PEM certificate chain (needs --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", default=None,
                   help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--fail-next", type=int, default=0,
                   help="fail the first N completion requests with HTTP 500")
    p.add_argument("--health-fail", action="store_true",
                   help="start unhealthy: GET /health answers 503")
    p.add_argument("--profiler", action="store_true",
                   help="serve POST /start_profile and /stop_profile (vLLM with a profiler "
                   "configured); without it both are 404")
    p.add_argument("--log-level", default="INFO",
                   help="logging level (default: %(default)s)")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        role=args.role, host=args.host, port=args.port, model=args.model,
        max_model_len=args.max_model_len, ttft=args.ttft_ms / MS,
        token_delay=args.token_delay_ms / MS, output_tokens=args.output_tokens,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        token_delay_per_stream=args.token_delay_per_stream_ms / MS,
        token_delay_per_context_token=args.token_delay_per_context_token_us / 1e6,
        max_num_seqs=args.max_num_seqs, scheduling_policy=args.scheduling_policy,
        kv_cache_blocks=args.kv_cache_blocks, block_size=args.block_size,
        kv_events_config=args.kv_events_config,
        secret=args.secret, engine_id=args.engine_id, dp_size=args.dp_size,
        bootstrap_port=args.bootstrap_port, record_limit=args.record_limit,
        ec_metadata=args.ec_metadata, kv_timeout=args.kv_timeout_ms / MS,
        keepalive_timeout=args.keepalive_timeout,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        profiler=args.profiler, kv_connector=args.kv_connector,
        prompt_tokens_details=args.prompt_tokens_details,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"epd-flask-sim: {exc}", file=sys.stderr)
        return 2
    server = SimServer(config)
    server.state.inject(fail_next=args.fail_next, health_fail=args.health_fail)
    try:
        server.start()
    except (OSError, ValueError) as exc:
        print(f"epd-flask-sim: cannot listen: {exc}", file=sys.stderr)
        return 1
    print(f"epd-flask-sim {config.role} on {server.url}"
          + (f" (bootstrap {server.bootstrap_url})" if server.bootstrap_url else ""),
          flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(signum, server.stop)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
