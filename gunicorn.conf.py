"""gunicorn loads ./gunicorn.conf.py by default, so ``gunicorn -k gevent wsgi:app`` run from the
project root gets the real settings and hooks, which live in etc/gunicorn.conf.py."""

import os as _os

_path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "etc", "gunicorn.conf.py")
with open(_path, encoding="utf-8") as _f:
    exec(compile(_f.read(), _path, "exec"))
