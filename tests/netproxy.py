"""A TCP forwarder on 127.0.0.1 that a test can cut, to take a real endpoint "down" for a while.

boto3 talks to the proxy as to the endpoint. While the proxy is down, every connection (new or open) is
closed at once, exactly what a client sees when a network path or a load balancer drops it: the real client
retries, times out and reports a real connection error. Up again, traffic flows as before.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlparse

_CHUNK = 64 * 1024

PROXIES: dict[str, TcpProxy] = {}
"""Proxies a test shares with task code running in the same process (``dag.test()``), by name."""


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``http://host:port``) until :meth:`close`."""

    def __init__(self, target: str) -> None:
        parsed = urlparse(target)
        assert parsed.hostname and parsed.port, f"need http://host:port, not {target!r}"
        self.target = (parsed.hostname, parsed.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)  # so the accept loop sees close() promptly
        self.port = int(self._listener.getsockname()[1])
        self._up = threading.Event()
        self._up.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        """Drop every open connection and every new one until :meth:`up`."""
        self._up.clear()
        with self._lock:
            sockets, self._open = set(self._open), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def up(self) -> None:
        self._up.set()

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self.down()
        try:
            yield
        finally:
            self.up()

    def close(self) -> None:
        self._closed.set()
        self.down()
        self._listener.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            if not self._up.is_set():
                self.refused += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        pair = {client: upstream, upstream: client}
        try:
            while self._up.is_set():
                readable, _, _ = select.select(list(pair), [], [], 0.2)
                for sock in readable:
                    data = sock.recv(_CHUNK)
                    if not data:
                        return
                    pair[sock].sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._open.discard(client)
                self._open.discard(upstream)
            for sock in (client, upstream):
                sock.close()
