"""POSTs to the two completion routes, served without Flask's dispatch.

Flask spends ~37 us of CPU per request around a view (its request and app contexts, URL
matching, the ``request`` proxy, finalizing the response) on top of what werkzeug's own
``Request`` and ``Response`` cost (docs/benchmarks.md#the-proxys-own-work-per-request-hotpathpy).
For the routes every completion takes, this WSGI layer builds Flask's own request class
straight from the environ and calls the same view function as Flask's route
(``api.completion``): the edge checks, validation, request ids, log line and metrics are that
function's, and the response is the same ``Response`` object, written by werkzeug as Flask
would write it. A view that raises is answered by Flask itself, in a request context made
for the occasion, so the error handlers, the 500 and its logging are Flask's and exist once.
Every other request goes to Flask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask, Response

from epd_flask.web import api
from epd_flask.web.services import EXTENSION, Services

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

ROUTES = frozenset(api.COMPLETION_ROUTES)


class FastPath:
    """WSGI middleware in front of Flask's ``wsgi_app`` (``flask``): completion POSTs are
    served here, anything else passes to ``inner``."""

    def __init__(self, flask: Flask, inner: WSGIApp) -> None:
        self.flask = flask
        self.inner = inner

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") not in ROUTES or environ.get("REQUEST_METHOD") != "POST":
            return self.inner(environ, start_response)
        flask = self.flask
        # Not kept in the environ (werkzeug's default): the two would hold each other, and a
        # request that lived long (a stream, a wait in the admission queue) would then be
        # freed only by a full garbage collection, which under a flood took 100-240 ms.
        req = flask.request_class(environ, populate_request=False)
        req.max_content_length = flask.config["MAX_CONTENT_LENGTH"]
        svc: Services = flask.extensions[EXTENSION]
        try:
            response = api.completion(req, svc)
        except Exception as exc:
            response = self._failed(environ, exc)
        return response(environ, start_response)

    def _failed(self, environ: dict[str, Any], exc: Exception) -> Response:
        """What Flask's ``full_dispatch_request`` answers when the view raises ``exc``: its
        error handler's response (app.error_response, app.http_error_response), or for
        anything unhandled its logged 500."""
        flask = self.flask
        try:
            with flask.request_context(environ):
                try:
                    return flask.finalize_request(flask.handle_user_exception(exc))
                except Exception as unhandled:
                    return flask.handle_exception(unhandled)
        finally:
            environ.pop("werkzeug.request", None)  # Flask's request for the occasion: see above
