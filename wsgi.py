"""The WSGI entry point gunicorn serves: ``gunicorn -k gevent wsgi:app``."""

from epd_flask.app import create_app

app = create_app()
