"""gunicorn settings and hooks for epd-flask.

Read by the gunicorn master (``gunicorn -c etc/gunicorn.conf.py wsgi:app``, or through the
top-level ``gunicorn.conf.py`` that gunicorn loads by default). The master must stay light:
nothing here imports ``ssl``, patches with gevent, or opens sockets; workers patch themselves
(gevent worker) before they import ``wsgi:app``.

Every value can be overridden from the environment, so a systemd unit or a container only
sets variables.
"""

import logging
import os

# Listen address: EPD_BIND wins, else HOST/PORT (make run uses PORT).
bind = os.environ.get("EPD_BIND") or (
    f"{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '8000')}"
)

# gevent: one worker per core carries hundreds of concurrent streams; more workers than cores
# only add context switches.
worker_class = "gevent"
workers = int(os.environ.get("EPD_WORKERS", os.cpu_count() or 1))
# Concurrent connections per worker (open client streams count here).
worker_connections = int(os.environ.get("EPD_WORKER_CONNECTIONS", "1000"))

# For the gevent worker, ``timeout`` is a heartbeat: the worker's own loop refreshes it while
# streams are open, so a minutes-long generation is never cut by it. Only a worker whose loop
# is blocked (a CPU-bound bug) is killed.
timeout = int(os.environ.get("EPD_WORKER_TIMEOUT", "60"))
# On SIGHUP/SIGTERM old workers get this long to finish the streams they carry; an LLM answer
# can stream for minutes, so the default is generous.
graceful_timeout = int(os.environ.get("EPD_GRACEFUL_TIMEOUT", "600"))
# Longer than nginx's upstream keepalive_timeout (60 s by default) so nginx, not us, closes
# idle connections and never reuses one we already closed.
keepalive = int(os.environ.get("EPD_KEEPALIVE", "75"))

# preload_app must stay off: the app is imported in each worker after gevent patched it.
preload_app = False
# Trust X-Forwarded-* only from the local reverse proxy.
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")
accesslog = os.environ.get("EPD_ACCESS_LOG") or None
loglevel = os.environ.get("EPD_LOG_LEVEL", "info")


def on_starting(server):
    """Route the proxy's own loggers to stderr next to gunicorn's; workers inherit this."""
    log = logging.getLogger("epd_flask")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(os.environ.get("EPD_LOG_LEVEL", "info").upper())


def post_worker_init(worker):
    """Start each worker's background greenlets once gevent has patched it."""
    services = getattr(worker.wsgi, "extensions", {}).get("epd_flask")
    if services is not None:
        services.start()


def worker_exit(server, worker):
    services = getattr(getattr(worker, "wsgi", None), "extensions", {}).get("epd_flask")
    if services is not None:
        services.stop()
