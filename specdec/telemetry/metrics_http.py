"""The HTTP endpoint of a service's metrics: always the Prometheus text format 0.0.4.

prometheus_client negotiates OpenMetrics when a scraper asks for it (Prometheus 2.x's default Accept header does),
and its OpenMetrics output with the default name escaping renames every sample `specdec:x` -> `specdec_x` while its
HELP and TYPE lines keep `specdec:x`: a strict parser refused the gateway's and the draft's output ("Clashing
name"), and where it parsed, the stored names were not the documented ones (QA, prometheus_client 0.26). The text
format carries everything these metrics have (no exemplars), and every Prometheus takes it, so the endpoint
ignores the Accept header; compression (Accept-Encoding: gzip) and `name[]` filters are prometheus_client's.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        """No access line per scrape on stderr (the services log their own way)."""


def serve_text_metrics(port: int, addr: str, registry: CollectorRegistry) -> ThreadingWSGIServer:
    """Serve `registry` at http://addr:port/ (any path, as prometheus_client does) from a daemon thread; raises
    OSError when the port cannot be had. Call `.shutdown()` on the result to stop it."""
    app = make_wsgi_app(registry)

    def text_only(environ, start_response):
        environ.pop("HTTP_ACCEPT", None)  # -> text/plain; version=0.0.4
        return app(environ, start_response)

    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    httpd = make_server(sockaddr[0], port, text_only, server_class, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
