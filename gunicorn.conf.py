"""gunicorn loads ./gunicorn.conf.py by default, so ``gunicorn -k gevent wsgi:app`` run from the
project root gets the real settings and hooks: the packaged configuration,
``epd_flask/control/gunicorn_config.py``, run afresh each time gunicorn reads this file."""

from importlib.util import find_spec as _find_spec

_spec = _find_spec("epd_flask.control.gunicorn_config")
exec(_spec.loader.get_code(_spec.name))
