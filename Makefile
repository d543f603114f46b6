# epd-flask: the verbs a newcomer guesses. Everything runs from a local virtualenv (.venv)
# that the first target to need it creates.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
# The simulated fleet's ports are the ones etc/roster.yaml names.
PREFILL_PORT := 8100
DECODE_PORT := 8200
TOKEN_DELAY_MS ?= 30
EPD_ROSTER ?= etc/roster.yaml
EPD_PIDFILE ?= $(VENV)/gunicorn.pid
PYTEST_ARGS ?=
# The test processes `make test` runs at once (the suite waits more than it computes: with
# two, a 2-core machine still sat ~30 % idle; three took a clean clone's tests from 356 s to
# 285-292 s there).
TEST_JOBS ?= 3
# The benchmark's peers (vllm-router; vLLM's EPD proxy and the libraries it runs on) live in
# their own virtualenv outside the source tree: never a dependency of epd-flask, never shipped.
BENCH_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/epd-flask/bench-venv
VLLM_ROUTER_VERSION ?= 0.1.17
EPD_PROXY_PEER_LIBS ?= fastapi==0.165.0 uvicorn==0.54.0 aiohttp==3.14.5 uvloop==0.23.0
# vLLM's examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py (Apache-2.0), copied
# here by hand (docs/benchmarks.md says from which commit); without it the bench skips that peer.
EPD_PROXY_COPY ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/epd-flask/peers/disagg_epd_proxy.py
BENCH_ARGS ?=
# bench-fleet's production trace (Mooncake's format; default: tests/bench/traces' copy), its
# speed-up, how many of its first requests to replay, and where to write its rows as JSON.
TRACE ?=
TRACE_SPEED ?=
TRACE_LIMIT ?=
BENCH_JSON ?=
# The real-vLLM tier keeps its ~4 GB venv, tiny models, logs and pid files out of the tree.
VLLM_HOME ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/epd-flask/vllm
VLLM_TIMEOUT ?= 1800
# install-service: where the service lives and who it runs as
PREFIX ?= /opt/epd-flask
CONF_DIR ?= /etc/epd-flask
UNIT_DIR ?= /etc/systemd/system
SERVICE_USER ?= epd-flask

export EPD_ROSTER

.PHONY: run test test-vllm chaos lint bench bench-fleet bench-tenants bench-micro soak reload check-roster install-service service-unit clean

$(STAMP): setup.cfg setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

## run: a simulated prefill + decode fleet and the proxy under gunicorn on 127.0.0.1:$(PORT)
run: $(STAMP)
	@trap 'kill $$(jobs -p) 2>/dev/null; wait' EXIT INT TERM; \
	$(BIN)/epd-flask-sim --role prefill --port $(PREFILL_PORT) & \
	$(BIN)/epd-flask-sim --role decode --port $(DECODE_PORT) --token-delay-ms $(TOKEN_DELAY_MS) & \
	$(BIN)/python -m epd_flask.sim.waitfor http://127.0.0.1:$(PREFILL_PORT)/health \
	    http://127.0.0.1:$(DECODE_PORT)/health || exit 1; \
	echo; echo "epd-flask on http://127.0.0.1:$(PORT). Try:"; \
	echo "  curl -N http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"; \
	echo "    -d '{\"model\": \"tiny-llama\", \"stream\": true, \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'"; \
	echo; \
	$(BIN)/epd-flask --port $(PORT) --pidfile $(EPD_PIDFILE)

## test: the whole suite, with gevent patching everything before pytest imports anything, in
## TEST_JOBS processes that share the test files (tests/shards.py; TEST_JOBS=1: one pytest).
## The sources are byte-compiled first: the suite starts hundreds of Python processes (gunicorn
## workers, simulators), each of which would compile them again where PYTHONDONTWRITEBYTECODE
## is set or before the first has written them.
test: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 epd_flask tests
	$(if $(filter 1,$(TEST_JOBS)),,$(BIN)/python tests/shards.py $(TEST_JOBS)) \
	    $(BIN)/python -m gevent.monkey --module pytest $(PYTEST_ARGS)

## chaos: kill, stall and break instances under a mixed load through real gunicorn (~40 s)
chaos: $(STAMP)
	$(BIN)/python -m gevent.monkey --module pytest -m chaos -s tests/chaos $(PYTEST_ARGS)

## test-vllm: the proxy against real vLLM (CPU build, tiny models built here) under gunicorn.
## The first run builds $(VLLM_HOME) (~1.5 min, ~4 GB); every process it starts is stopped on
## exit, and the whole run is cut after $(VLLM_TIMEOUT) s. --foreground keeps pytest in the
## terminal's process group, so Ctrl-C reaches it and its fixtures stop the servers.
test-vllm: $(STAMP)
	tests/vllm/venv.sh $(VLLM_HOME)/venv
	$(VLLM_HOME)/venv/bin/python tests/vllm/tiny_models.py $(VLLM_HOME)/models
	@trap '$(BIN)/python tests/vllm/reap.py $(VLLM_HOME)/run' EXIT INT TERM; \
	EPD_VLLM_HOME=$(VLLM_HOME) timeout --foreground -k 30 $(VLLM_TIMEOUT) \
	    $(BIN)/python -m gevent.monkey --module pytest -m vllm -p no:cacheprovider \
	    tests/vllm $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check \
	    vllm-router==$(VLLM_ROUTER_VERSION) $(EPD_PROXY_PEER_LIBS) py-spy
	touch $@

## bench: epd-flask vs direct-to-decode vs vllm-router vs vLLM's EPD proxy on loopback; replaces
## its block of docs/benchmarks.md (a partial run, e.g. BENCH_ARGS=--only a32, writes none)
bench: $(STAMP) $(BENCH_VENV)/.installed
	$(BIN)/python tests/bench/run.py --router $(BENCH_VENV)/bin/vllm-router \
	    --epd-proxy $(EPD_PROXY_COPY) --epd-proxy-python $(BENCH_VENV)/bin/python $(BENCH_ARGS)

## bench-fleet: routing policies on a simulated 4 prefill + 4 decode fleet with a cost model,
## epd-flask's policies vs vllm-router's, light and at 80 % of prefill capacity, and a production
## trace (TRACE, TRACE_SPEED, TRACE_LIMIT; BENCH_JSON=path writes its rows); writes
## docs/benchmarks.md (~18 minutes; BENCH_ARGS=--short: ~4, writes none). One target while
## iterating, e.g. kv_aware on 2 hosts x 2 workers (with and without their load store) beside
## the oracle on the trace (~3 minutes, writes none):
## BENCH_ARGS='--scenario trace --only "2 hosts x 2 workers,oracle"'
bench-fleet: $(STAMP) $(BENCH_VENV)/.installed
	$(BIN)/python tests/bench/fleet.py --router $(BENCH_VENV)/bin/vllm-router \
	    $(if $(TRACE),--trace $(TRACE)) $(if $(TRACE_SPEED),--trace-speed $(TRACE_SPEED)) \
	    $(if $(TRACE_LIMIT),--trace-limit $(TRACE_LIMIT)) \
	    $(if $(BENCH_JSON),--bench-json $(BENCH_JSON)) $(BENCH_ARGS)

## bench-tenants: an interactive tenant's time to first token beside a batch tenant flooding at
## 10x its share: epd-flask with admission control, without it, and vllm-router's concurrency
## limit, on two simulated engines; replaces its block of docs/benchmarks.md (~11 minutes)
bench-tenants: $(STAMP) $(BENCH_VENV)/.installed
	$(BIN)/python tests/bench/tenants.py --router $(BENCH_VENV)/bin/vllm-router $(BENCH_ARGS)

## bench-micro: the hot path's pieces in one process each (the proxy's own work per request,
## one upstream call, one relayed event), kv_aware's memory per block and the fleet model's
## many traces; replaces their blocks of docs/benchmarks.md (~4 minutes, nothing to install)
bench-micro: $(STAMP)
	$(BIN)/python -m gevent.monkey tests/bench/hotpath.py --multiprocess --report docs/benchmarks.md
	$(BIN)/python tests/bench/upstream_call.py --report docs/benchmarks.md
	$(BIN)/python -m gevent.monkey --module tests.bench.relaycost --report docs/benchmarks.md
	$(BIN)/python -m tests.bench.kvpicture --report docs/benchmarks.md
	$(BIN)/python tests/bench/fleetmodel.py --seeds 30 --report docs/benchmarks.md
	$(BIN)/python tests/bench/fleetmodel.py --seeds 30 --utilisation 0 --duration 15 --rate 3 \
	    --report docs/benchmarks.md

## soak: the proxy for ten minutes under a mixed load with abandoned streams, a SIGHUP a minute
## and admin changes; checks nothing is lost, leaked or logged as an error; replaces the soak
## block of docs/benchmarks.md (~11 minutes; SOAK_ARGS="--seconds 120" for a shorter run, which
## writes nothing; SOAK_ARGS="--proxy-root DIR:PYTHON ..." compares checkouts side by side)
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/python -m gevent.monkey tests/bench/soak.py $(or $(SOAK_ARGS),--report)

check-roster: $(STAMP)
	$(BIN)/epd-flask-check-roster $(EPD_ROSTER)

## reload: validate the roster, then ask the running master to re-read it (a roster that
## fails validation never reaches the master; if one does, the master logs it and keeps serving)
reload: check-roster
	$(BIN)/epd-flask --pidfile $(EPD_PIDFILE) reload

## install-service: as root, build the wheel and install it under $(PREFIX) (own virtualenv;
## the wheel is kept in $(PREFIX)/wheels), roster in $(CONF_DIR), a systemd unit running
## `epd-flask` as $(SERVICE_USER). Re-running upgrades; an existing roster is kept.
install-service:
	@test "$$(id -u)" = 0 || { echo "install-service: run it as root (sudo make install-service)"; exit 1; }
	id -u $(SERVICE_USER) >/dev/null 2>&1 || useradd --system --user-group --no-create-home \
	    --home-dir /nonexistent --shell /usr/sbin/nologin $(SERVICE_USER)
	install -d -m 0755 $(PREFIX)
	test -x $(PREFIX)/venv/bin/pip || $(PYTHON) -m venv $(PREFIX)/venv
	rm -rf $(PREFIX)/wheels
	$(PREFIX)/venv/bin/pip wheel --quiet --disable-pip-version-check --no-deps \
	    -w $(PREFIX)/wheels .
	$(PREFIX)/venv/bin/pip install --quiet --disable-pip-version-check $(PREFIX)/wheels/*.whl
	# this very build, also when the version did not change
	$(PREFIX)/venv/bin/pip install --quiet --disable-pip-version-check --force-reinstall \
	    --no-deps $(PREFIX)/wheels/*.whl
	install -d -o $(SERVICE_USER) -g $(SERVICE_USER) -m 0750 $(CONF_DIR)
	test -e $(CONF_DIR)/roster.yaml || install -o $(SERVICE_USER) -g $(SERVICE_USER) -m 0640 \
	    etc/roster.yaml $(CONF_DIR)/roster.yaml
	$(PREFIX)/venv/bin/epd-flask check-roster $(CONF_DIR)/roster.yaml
	$(MAKE) --no-print-directory service-unit UNIT_OUT=$(UNIT_DIR)/epd-flask.service
	if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "installed. Edit $(CONF_DIR)/roster.yaml, then: systemctl enable --now epd-flask"

## service-unit: write etc/epd-flask.service with this PREFIX, CONF_DIR and SERVICE_USER to $(UNIT_OUT)
service-unit:
	@test -n "$(UNIT_OUT)" || { echo "service-unit: set UNIT_OUT=path"; exit 1; }
	sed -e 's|/opt/epd-flask|$(PREFIX)|g' -e 's|/etc/epd-flask|$(CONF_DIR)|g' \
	    -e 's|^User=.*|User=$(SERVICE_USER)|' -e 's|^Group=.*|Group=$(SERVICE_USER)|' \
	    etc/epd-flask.service > $(UNIT_OUT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
