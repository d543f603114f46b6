"""gunicorn settings and hooks for epd-flask, shipped inside the package.

Read by the gunicorn master: ``epd-flask`` runs ``gunicorn -c
python:epd_flask.control.gunicorn_config epd_flask.wsgi:app``, and the repository's
``etc/gunicorn.conf.py`` and top-level ``gunicorn.conf.py`` re-export this module. The master
must stay light: nothing here imports ``ssl``, patches with gevent, or opens sockets; workers
patch themselves (gevent worker) before they import the app.

Every value can be overridden from the environment, so a systemd unit or a container only
sets variables; each variable (type, default, check) is declared once in
``epd_flask/control/settings.py``, and a bad value stops start-up with a message naming it.
"""

import logging
import os

# Standard library only (the master must not load ssl); see their docstrings.
from epd_flask.control import metricsdir

# Roster schema, validation and the state directory (pydantic, PyYAML, json; no ssl, no
# gevent): the master validates the roster itself.
from epd_flask.control import reload as _epd_reload
from epd_flask.control.settings import read as _setting

# Listen address: EPD_BIND wins, else HOST/PORT (make run uses PORT).
bind = _setting("EPD_BIND")

# Workers: one per core. A gevent worker is one process running one event loop; it carries
# hundreds of concurrent streams, but only one core's worth of CPU (JSON parsing, relaying
# chunks). Fewer workers than cores leaves CPU idle under load; more only add context
# switches, and multiply what each worker keeps for itself: upstream connection pools, health
# state, and probes (each worker probes every instance: workers x instances probes per
# probe_interval; docs/deploy.md). In a container os.cpu_count() is the node's core count,
# not the CPU limit: set EPD_WORKERS there.
# Our subclass of gunicorn's gevent worker: it bounds the time a client takes to send a
# request's head (EPD_HEADER_TIMEOUT; epd_flask/web/worker.py). `-k gevent` on the command
# line forks the stock one, which gives a head the whole keepalive; post_fork upgrades it.
worker_class = "epd_flask.web.worker.GeventWorker"
#: What ``-k gevent`` names; post_fork upgrades it to ``worker_class``.
STOCK_GEVENT_WORKER = "gunicorn.workers.ggevent.GeventWorker"
workers = _setting("EPD_WORKERS")
# Concurrent client connections per worker: open streams plus idle keep-alive connections
# from nginx (up to its upstream `keepalive` per nginx worker process). A host carries
# workers x worker_connections; beyond that, new connections wait in the listen backlog. Each
# open stream also holds a socket to its decode instance, so file descriptors run at about
# twice this per worker (the systemd unit raises LimitNOFILE).
worker_connections = _setting("EPD_WORKER_CONNECTIONS")

# Timeouts versus minute-long streams:
# - ``timeout`` is a heartbeat, not a request timeout: the gevent worker's own loop refreshes
#   it while streams are open, so a generation of any length is never cut by it. Only a worker
#   whose loop is blocked (a CPU-bound bug) for this long is killed and replaced.
# - How long a stream may go quiet is the roster's decode_timeout (600 s), and nginx's
#   proxy_read_timeout matches it.
timeout = _setting("EPD_WORKER_TIMEOUT")
# On SIGHUP/SIGTERM old workers get this long to finish the streams they carry; an LLM answer
# can stream for minutes, so the default is generous. Whatever stops the master must wait
# longer than this: systemd's TimeoutStopSec (630), Kubernetes' terminationGracePeriodSeconds.
# A stopping worker also waits for its idle keep-alive connections to close, so behind nginx
# a stop or reload ends once the last stream has ended and nginx dropped its idle
# connections (at most 30 s later, its upstream keepalive_timeout).
graceful_timeout = _setting("EPD_GRACEFUL_TIMEOUT")
# Longer than nginx's upstream keepalive_timeout (30 s in etc/nginx.conf) so nginx, not us,
# closes idle connections and never sends a request on one we already closed.
keepalive = _setting("EPD_KEEPALIVE")

# preload_app must stay off: the app is imported in each worker after gevent patched it.
preload_app = False
# Trust X-Forwarded-* only from the local reverse proxy.
forwarded_allow_ips = _setting("FORWARDED_ALLOW_IPS")
accesslog = _setting("EPD_ACCESS_LOG")
loglevel = _setting("EPD_LOG_LEVEL")
# `make reload` and systemd's ExecReload find the master here.
pidfile = _setting("EPD_PIDFILE")


def on_starting(server):
    """Route the proxy's own loggers to stderr next to gunicorn's, and give the workers an
    empty metrics directory to share; workers inherit both through fork. (Only at start: a
    reload keeps the directory, so counters keep counting across it.)"""
    log = logging.getLogger("epd_flask")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(_setting("EPD_LOG_LEVEL").upper())
    requests_log = logging.getLogger("epd_flask.requests")
    if _setting("EPD_LOG_FORMAT") == "json" and not requests_log.handlers:
        # One bare JSON document per line (it carries its own timestamp).
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        requests_log.addHandler(handler)
        requests_log.propagate = False
    metricsdir.prepare()
    # Validate the roster before listening; a bad one stops start-up with the reason.
    reloader = _epd_reload.start(server)
    _own_control_socket(server, str(reloader.state.path))


#: gunicorn's control socket (for ``gunicornc``) is one path per user by default
#: ($XDG_RUNTIME_DIR/gunicorn.ctl, else ~/.gunicorn/gunicorn.ctl): a second master of the
#: same user unlinks the first's socket and binds its own there, and whichever stops first
#: removes the other's. Each master's lives in its own state directory instead, unless
#: ``--control-socket`` names one.
CONTROL_SOCKET = "gunicorn.ctl"


def _own_control_socket(server, state_dir):
    """gunicorn starts the control server after the first workers, on the path this sets,
    and keeps it there for the master's life."""
    setting = server.cfg.settings.get("control_socket")
    if setting is not None and setting.value == setting.default:
        server.cfg.set("control_socket", os.path.join(state_dir, CONTROL_SOCKET))


def when_ready(server):
    # Re-read the roster as soon as SIGHUP arrives, even while gunicorn still waits for the
    # old workers of an earlier reload to finish their streams.
    reloader = _epd_reload.of(server)
    if reloader is not None:
        reloader.install_hup_handler()


def on_reload(server):
    """SIGHUP: re-read the roster. A bad one is logged and the last good one stays; gunicorn
    then starts new workers from the good copy and lets the old ones finish their streams."""
    reloader = _epd_reload.of(server)
    if reloader is not None:
        reloader.on_reload()
        _own_control_socket(server, str(reloader.state.path))  # the configuration read anew


def post_fork(server, worker):
    """The new worker keeps the roster its master validated last (it boots from it when the
    state directory's copy is gone or older).

    ``gunicorn -k gevent wsgi:app`` overrides ``worker_class`` above with gunicorn's stock
    gevent worker, which has no bound on the time a client takes to send a request's head;
    upgrade it to ours in the fresh child. Both are named, not imported: gunicorn loads worker
    classes itself, and this module stays free of gevent."""
    from gunicorn.util import load_class

    _epd_reload.inherit(server)

    stock = type(worker)
    if f"{stock.__module__}.{stock.__qualname__}" == STOCK_GEVENT_WORKER:
        load_class(worker_class).adopt(worker)


def post_worker_init(worker):
    """Start each worker's background greenlets once gevent has patched it, and its drain
    watcher: when the worker is told to stop (SIGTERM, or an old worker of a reload), running
    streams get until shortly before ``graceful_timeout`` and are then ended with an in-band
    error event instead of being cut when the master's SIGKILL comes. The worker then sets its
    garbage collector up before it serves (``web/collector.py``)."""
    services = getattr(worker.wsgi, "extensions", {}).get("epd_flask")
    if services is not None:
        services.listening_on(s.getsockname() for s in worker.sockets)
        services.start()
        services.drain.watch(lambda: worker.alive, worker.cfg.graceful_timeout)


def child_exit(server, worker):
    """A dead worker's live gauges (in-flight calls) and its requests per instance
    (fleet/loadboard.py) must not be summed any more."""
    metricsdir.mark_process_dead(worker.pid)
    reloader = _epd_reload.of(server)
    if reloader is not None:
        reloader.state.forget_worker(worker.pid)


def on_exit(server):
    metricsdir.cleanup()
    reloader = _epd_reload.of(server)
    if reloader is not None:
        reloader.cleanup()


def worker_exit(server, worker):
    services = getattr(getattr(worker, "wsgi", None), "extensions", {}).get("epd_flask")
    if services is not None:
        services.stop()
