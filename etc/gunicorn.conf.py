"""``gunicorn -c etc/gunicorn.conf.py wsgi:app``: the packaged configuration,
``epd_flask/control/gunicorn_config.py``, run afresh each time gunicorn reads this file (at
start and on SIGHUP), so it sees the environment of that moment as a file config should."""

from importlib.util import find_spec as _find_spec

_spec = _find_spec("epd_flask.control.gunicorn_config")
exec(_spec.loader.get_code(_spec.name))
