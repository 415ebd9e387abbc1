"""Serve moto's S3 on 127.0.0.1, threaded as ``moto_server`` does or serialized (atomic conditional writes).

Run as ``python -m airflow_stateful.testing.moto_launcher [--serialized]``; :class:`~.s3_server.MotoServer`
starts it in a subprocess. It binds port 0 itself and writes the port it got as one line on stdout, so no
other process can take the port between choosing and binding it.

Why "serialized": moto checks ``If-Match`` / ``If-None-Match`` and then stores the object without a lock, and
its server runs every request on its own thread. Two conditional writes of one key can both pass the check
and both succeed (a lost update), which real S3 never allows. The window is widest when moto writes the new
value to its spill file (objects above ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``, 5 MiB by default), because the
file write releases the GIL between the check and the store.

``--serialized`` wraps moto's WSGI app in one lock, so moto handles one request at a time and every
request (conditional writes included) is atomic. The lock is held only while moto itself runs, never while
waiting on a client: the request body is read before the lock is taken, and the response is written to the
socket after it is released (moto builds its response body in memory; it is collected under the lock so
nothing of moto's state is read outside it). Connections are accepted and parsed on their own threads, which
is why this is a lock and not a single-threaded server (both were measured):

* werkzeug answers ``Expect: 100-continue`` before it calls the app, so a client waiting behind the lock
  gets its ``100 Continue`` at once and never runs into botocore's 1 s fallback;
* a client that stalls halfway through a request body, or keeps a large GET body half read while it sends
  another request, blocks no one (a single-threaded server cannot accept the next request meanwhile:
  botocore's read timeout fired);
* parallel multipart part uploads are received in parallel and stored one by one; none waits for another.

This module imports only moto and werkzeug (``moto[server]``), never Airflow.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class SerializedApp:
    """A WSGI app that runs the wrapped app for one request at a time, never holding the lock on I/O."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        _read_body_first(environ)  # a slow or stalled client must not hold everyone else up
        with self.lock:
            body = self.app(environ, start_response)
            try:
                # Collected under the lock: the iterable may still read moto's state. For moto's responses
                # this is a list of bytes already, so no copy is made.
                return list(body)
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()


def _read_body_first(environ: dict[str, Any]) -> None:
    """Replace ``wsgi.input`` with the whole request body, read now (moto reads it whole anyway).

    A body cut short by the client stays short: the app then sees the same disconnect it would have seen.
    """
    stream = environ["wsgi.input"]
    length = environ.get("CONTENT_LENGTH")
    if length:
        data = stream.read(int(length))
    elif environ.get("wsgi.input_terminated"):  # chunked: werkzeug's stream ends with the body
        data = stream.read()
    else:
        data = b""
    environ["wsgi.input"] = io.BytesIO(data)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--serialized", action="store_true", help="one request at a time (atomic CAS)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    args = parser.parse_args(argv)

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    moto_app = DomainDispatcherApplication(create_backend_app)
    app: WSGIApp = SerializedApp(moto_app) if args.serialized else moto_app
    # Loopback only, never moto's default 0.0.0.0. threaded=True in both modes: see the module docstring.
    server = make_server("127.0.0.1", args.port, app, threaded=True, request_handler=MotoRequestHandler)
    port = server.server_port
    os.environ["MOTO_PORT"] = str(port)  # moto builds some URLs from it, as moto_server sets it
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    # Nothing else goes to stdout: the parent stops reading it once it has the port.
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), sys.stdout.fileno())
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
