"""The WSGI application gunicorn serves in each worker: ``epd_flask.wsgi:app``.

Imported only in a worker, after gevent patched it (``preload_app`` stays off), never by the
master.
"""

from epd_flask.app import create_app

app = create_app()
