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
PYTEST_ARGS ?=
# The benchmark's peer (vllm-router) lives in its own virtualenv outside the source tree: it is
# never a dependency of epd-flask.
BENCH_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/epd-flask/bench-venv
VLLM_ROUTER_VERSION ?= 0.1.17
BENCH_ARGS ?=

export EPD_ROSTER

.PHONY: run test lint bench reload check-roster clean

$(STAMP): setup.cfg setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

## run: a simulated prefill + decode fleet and the proxy under gunicorn on 127.0.0.1:$(PORT)
run: $(STAMP)
	@trap 'kill $$(jobs -p) 2>/dev/null; wait' EXIT INT TERM; \
	$(BIN)/epd-flask-sim --role prefill --port $(PREFILL_PORT) & \
	$(BIN)/epd-flask-sim --role decode --port $(DECODE_PORT) --token-delay-ms $(TOKEN_DELAY_MS) & \
	$(BIN)/python -m epd_flask.waitfor http://127.0.0.1:$(PREFILL_PORT)/health \
	    http://127.0.0.1:$(DECODE_PORT)/health || exit 1; \
	echo; echo "epd-flask on http://127.0.0.1:$(PORT). Try:"; \
	echo "  curl -N http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"; \
	echo "    -d '{\"model\": \"tiny-llama\", \"stream\": true, \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'"; \
	echo; \
	PORT=$(PORT) $(BIN)/gunicorn -c etc/gunicorn.conf.py wsgi:app

## test: the whole suite, with gevent patching everything before pytest imports anything
test: $(STAMP)
	$(BIN)/python -m gevent.monkey --module pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check \
	    vllm-router==$(VLLM_ROUTER_VERSION)
	touch $@

## bench: epd-flask vs direct-to-decode vs vllm-router on loopback; writes docs/benchmarks.md
bench: $(STAMP) $(BENCH_VENV)/.installed
	$(BIN)/python tests/bench/run.py --router $(BENCH_VENV)/bin/vllm-router $(BENCH_ARGS)

check-roster: $(STAMP)
	$(BIN)/epd-flask-check-roster $(EPD_ROSTER)

## reload: validate the roster, then ask the running master to re-read it
reload: check-roster
	pkill -HUP -f 'gunicorn.*wsgi:app' -o

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
