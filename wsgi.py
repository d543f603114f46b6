"""``gunicorn -k gevent wsgi:app`` from the project root: the packaged ``epd_flask.wsgi``."""

from epd_flask.wsgi import app

__all__ = ["app"]
