"""An HTTP/1.1 proxy on 127.0.0.1 between boto3 and an S3 endpoint that injects faults by a seeded schedule.

boto3 talks to :class:`FaultProxy` as to the endpoint (``endpoint_url=proxy.url``). Every request is parsed
(request line, headers, a body by ``Content-Length`` or ``Transfer-Encoding: chunked``), classified by what it
does (:data:`KINDS`), and then either forwarded and answered as the endpoint answered, or hit by one fault
(:data:`FAULTS`). Client connections are kept alive as botocore keeps them; each has its own upstream
connection, also kept alive.

The faults are what real S3 and real networks do; each exists because the library must survive it:

``http_500``
    S3's ``InternalError`` (500). S3 documents that such a request may be retried; here it is answered
    without forwarding (the request did not land). A 500 after the request landed is ``reset_after`` seen
    through a load balancer: same outcome for the client, an error and no answer.
``slow_down_503``
    ``503 SlowDown`` with S3's XML error body: S3's throttling, per prefix, under load. Not forwarded.
    botocore backs off longer for it (a throttling error) than for the others.
``reset_before``
    the connection is reset (RST) before the request is forwarded: a load balancer or NAT dropping an idle
    keep-alive connection, a server restarting. The request did not land.
``reset_after``
    the request is forwarded and lands (the write is done), then the connection is reset before the answer:
    the answer is lost. The client cannot tell this from ``reset_before``; its retry of a conditional write
    meets its own first write (412), which the commit protocol must recognise as its own.
``delay_before`` / ``delay_after``
    the proxy sleeps ``delay`` seconds (set past the client's read timeout) before forwarding, or after the
    endpoint answered and before relaying it, then forwards / answers if the client still listens: a
    congested path, a stalled server. The client times out and retries; with ``delay_before`` its first
    request still lands *after* the retry was sent (a late duplicate), with ``delay_after`` it landed before.
``truncate_keep_length``
    the answer's body is cut in half and the connection closed, its ``Content-Length`` left as it was: a
    connection dropped mid-download. The client must notice the short body (botocore raises).
``truncate_fix_length``
    the answer's body is cut in half and its ``Content-Length`` rewritten to match: the client sees a
    complete, well-formed, *short* body (a buggy middlebox or cache, a bit flip below TLS). Only the
    library's own integrity checks (sizes, SHA-256) can catch it.

``hang`` (not in :data:`FAULTS`, used by the hung-endpoint test) accepts the request and never answers until
the proxy closes: a black-holed endpoint. Only the client's read timeout and retry limit end the wait.

Requests are classified by method, path and query string, path-style addressing (what the library uses with
a custom endpoint): :data:`KINDS`. Conditional PUTs of a head record (``If-Match``/``If-None-Match`` on a key
ending in ``~head.json``, the commit's compare-and-swap) are ``put_head_conditional``, other conditional PUTs
(chunks, trees, manifests created with ``If-None-Match: *``) are ``put_conditional``.

Upload bodies: over plain HTTP (this proxy) botocore 1.44 sends flexible checksums (CRC32) as a header and
the body as it is, with ``Content-Length``; ``aws-chunked`` bodies with checksum trailers are used over HTTPS
only (``botocore.httpchecksum.resolve_request_checksum_algorithm``). Chunked bodies are still parsed and
forwarded verbatim, trailers included. ``Expect: 100-continue`` (botocore sends it for bodies over 1 MiB) is
answered by the proxy itself and stripped from the forwarded request.

The schedule (:class:`FaultSchedule`) decides per request: first the explicit :class:`Rule` s ("the next N
requests of kind K after skipping M get fault F"), then a per-kind probability. The random draw for a request
is seeded by ``(seed, kind, key, how many times this kind/key was seen)``, not by a shared stream, so the
same seed gives the same faults to the same requests even when threads interleave differently (keys with
random parts, such as a commit id, still vary between runs). Counts of requests and injected faults, by
fault and by request kind, are kept for the tests and the docs.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import parse_qs, unquote, urlparse, urlsplit

FAULTS = (
    "http_500",
    "slow_down_503",
    "reset_before",
    "reset_after",
    "delay_before",
    "delay_after",
    "truncate_keep_length",
    "truncate_fix_length",
)
HANG = "hang"
TRUNCATIONS = frozenset({"truncate_keep_length", "truncate_fix_length"})
KINDS = (
    "put_head_conditional",
    "put_conditional",
    "put_object",
    "create_multipart",
    "upload_part",
    "complete_multipart",
    "abort_multipart",
    "get_object",
    "head_object",
    "list_objects",
    "list_multipart_uploads",
    "delete_object",
    "delete_objects",
    "other",
)
BODY_KINDS = frozenset(
    {
        "get_object",
        "list_objects",
        "list_multipart_uploads",
        "create_multipart",
        "complete_multipart",
        "delete_objects",
    }
)
"""Kinds whose successful answer has a body, the only ones a truncation applies to."""

_MAX_LINE = 64 * 1024
_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")


def applicable(kind: str, faults: Iterable[str] = FAULTS) -> tuple[str, ...]:
    """The faults of ``faults`` that mean something for a request of ``kind`` (no truncation of empty bodies)."""
    return tuple(f for f in faults if f not in TRUNCATIONS or kind in BODY_KINDS)


def classify(method: str, target: str, headers: Mapping[str, str]) -> tuple[str, str]:
    """``(kind, key)`` of a path-style S3 request; ``key`` is the object key without the bucket ("" if none).

    :param headers: the request's headers, names in lower case.
    """
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    _bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
    if method == "PUT":
        if "uploadId" in query and "partNumber" in query:
            return "upload_part", key
        if "if-match" in headers or "if-none-match" in headers:
            return ("put_head_conditional" if key.endswith("~head.json") else "put_conditional"), key
        return ("put_object" if key else "other"), key
    if method == "POST":
        if "uploads" in query:
            return "create_multipart", key
        if "uploadId" in query:
            return "complete_multipart", key
        if "delete" in query:
            return "delete_objects", key
        return "other", key
    if method == "GET":
        if key:
            return "get_object", key
        if "uploads" in query:
            return "list_multipart_uploads", key
        return ("list_objects" if "list-type" in query or "prefix" in query else "other"), key
    if method == "HEAD":
        return ("head_object" if key else "other"), key
    if method == "DELETE":
        if "uploadId" in query:
            return "abort_multipart", key
        return ("delete_object" if key else "other"), key
    return "other", key


@dataclass(frozen=True)
class Rule:
    """Explicit faults: of the requests of ``kind`` (whose key ends with ``key_suffix``) seen after the rule
    was added, let ``skip`` through, then give the next ``times`` ones ``fault`` (a ``delay_*`` fault waits
    ``delay`` seconds if given)."""

    kind: str
    fault: str
    skip: int = 0
    times: int = 1
    key_suffix: str = ""
    #: for ``delay_*``: seconds to wait instead of the proxy's ``delay``.
    delay: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown request kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.fault not in (*FAULTS, HANG):
            raise ValueError(f"unknown fault {self.fault!r}; known: {', '.join((*FAULTS, HANG))}")


@dataclass
class _RuleState:
    rule: Rule
    seen: int = 0
    hit: int = 0

    @property
    def spent(self) -> bool:
        return self.hit >= self.rule.times


class FaultSchedule:
    """Which request gets which fault: explicit rules first, then a seeded per-kind probability.

    :param seed: seeds every random draw (see the module docstring: per request, not one shared stream).
    :param rate: probability that a request of any kind gets a fault (``rates`` overrides it per kind).
    :param rates: per request kind, the probability of a fault.
    :param faults: the faults drawn from (uniformly, among those :func:`applicable` to the kind).
    :param rules: explicit :class:`Rule` s, applied in order; more can be added with :meth:`add`.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        rate: float = 0.0,
        rates: Mapping[str, float] | None = None,
        faults: Sequence[str] = FAULTS,
        rules: Iterable[Rule] = (),
    ) -> None:
        unknown = sorted(set(rates or {}) - set(KINDS)) + sorted(set(faults) - set(FAULTS) - {HANG})
        if unknown:
            raise ValueError(f"unknown request kind(s) or fault(s): {', '.join(unknown)}")
        self.seed = seed
        self.rate = rate
        self.rates = dict(rates or {})
        self.faults = tuple(faults)
        self._rules = [_RuleState(rule) for rule in rules]
        self._seen: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self.enabled = True

    def add(self, *rules: Rule) -> None:
        """Arm more explicit rules; their counts start now."""
        with self._lock:
            self._rules.extend(_RuleState(rule) for rule in rules)

    def pending_rules(self) -> list[Rule]:
        """Rules not used up yet (a test asserts its explicit faults really happened)."""
        with self._lock:
            return [state.rule for state in self._rules if not state.spent]

    def decide(self, kind: str, key: str) -> str | None:
        """The fault for this request, or ``None`` to forward it untouched."""
        decision = self.decide_with_delay(kind, key)
        return decision[0] if decision else None

    def decide_with_delay(self, kind: str, key: str) -> tuple[str, float | None] | None:
        """``(fault, delay)`` for this request (``delay``: a rule's own, else ``None``), or ``None``."""
        with self._lock:
            if not self.enabled:
                return None
            for state in self._rules:
                rule = state.rule
                if state.spent or rule.kind != kind or not key.endswith(rule.key_suffix):
                    continue
                state.seen += 1
                if state.seen > rule.skip:
                    state.hit += 1
                    return rule.fault, rule.delay
            rate = self.rates.get(kind, self.rate)
            if rate <= 0:
                return None
            name = _ID.sub("<id>", key)
            self._seen[(kind, name)] += 1
            draw = random.Random(f"{self.seed}|{kind}|{name}|{self._seen[(kind, name)]}")
            if draw.random() >= rate:
                return None
            choices = applicable(kind, self.faults)
            return (draw.choice(choices), None) if choices else None


# -- HTTP/1.1 parsing -----------------------------------------------------------------------------------------
class _Closed(Exception):
    """The peer closed the connection (or it broke) where a message was expected."""


@dataclass
class _Message:
    start: str  # request line or status line
    headers: list[tuple[str, str]]
    body: bytes = b""
    raw_body: bytes = b""  # as it was on the wire (chunked framing and trailers included)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def without(self, *names: str) -> list[tuple[str, str]]:
        drop = {n.lower() for n in names}
        return [(k, v) for k, v in self.headers if k.lower() not in drop]


def _readline(reader: BinaryIO) -> bytes:
    line = reader.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise _Closed("line too long")
    return line


def _read_head(reader: BinaryIO) -> _Message | None:
    """Start line and headers; ``None`` on a clean end of stream before a message."""
    line = _readline(reader)
    while line in (b"\r\n", b"\n"):  # tolerated between messages
        line = _readline(reader)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise _Closed("connection closed inside a start line")
    headers: list[tuple[str, str]] = []
    while True:
        raw = _readline(reader)
        if not raw.endswith(b"\n"):
            raise _Closed("connection closed inside the headers")
        if raw in (b"\r\n", b"\n"):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return _Message(start=line.decode("latin-1").rstrip("\r\n"), headers=headers)


def _read_exact(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise _Closed(f"connection closed after {len(data)} of {size} body bytes")
    return data


def _read_chunked(reader: BinaryIO) -> tuple[bytes, bytes]:
    """``(body, raw)`` of a chunked body: the data, and the bytes as sent (sizes, extensions, trailers)."""
    body, raw = bytearray(), bytearray()
    while True:
        line = _readline(reader)
        if not line.endswith(b"\n"):
            raise _Closed("connection closed inside a chunk size")
        raw += line
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            break
        data = _read_exact(reader, size + 2)
        raw += data
        body += data[:-2]
    while True:  # trailers (botocore's aws-chunked checksums travel here over HTTPS), then the empty line
        line = _readline(reader)
        if not line.endswith(b"\n"):
            raise _Closed("connection closed inside the trailers")
        raw += line
        if line in (b"\r\n", b"\n"):
            return bytes(body), bytes(raw)


def _read_body(reader: BinaryIO, message: _Message, *, until_close: bool = False) -> None:
    if (message.header("transfer-encoding") or "").lower().endswith("chunked"):
        message.body, message.raw_body = _read_chunked(reader)
        return
    length = message.header("content-length")
    if length is not None:
        message.body = message.raw_body = _read_exact(reader, int(length))
    elif until_close:
        message.body = message.raw_body = reader.read()


def _serialize(start: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    head = start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1") + body


def _s3_error(status: int, reason: str, code: str, message: str, *, with_body: bool) -> bytes:
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>{request_id}</RequestId><HostId>fault-proxy</HostId></Error>"
    ).encode()
    headers = [
        ("Content-Type", "application/xml"),
        ("Content-Length", str(len(body))),
        ("x-amz-request-id", request_id),
        ("Connection", "keep-alive"),
    ]
    return _serialize(f"HTTP/1.1 {status} {reason}", headers, body if with_body else b"")


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass
class FaultStats:
    """What went through a proxy: requests by kind, and faults injected by (fault, request kind)."""

    requests: Counter[str] = field(default_factory=Counter)
    injected: Counter[tuple[str, str]] = field(default_factory=Counter)

    def by_fault(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for (fault, _kind), n in self.injected.items():
            counts[fault] += n
        return dict(sorted(counts.items()))

    def by_request_kind(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for (_fault, kind), n in self.injected.items():
            counts[kind] += n
        return dict(sorted(counts.items()))

    @property
    def total_faults(self) -> int:
        return sum(self.injected.values())

    def table(self) -> str:
        """A Markdown table: one row per request kind, one column per fault (for docs/reliability.md)."""
        faults = [f for f in (*FAULTS, HANG) if any(f == g for g, _ in self.injected)]
        rows = ["| request kind | requests | " + " | ".join(faults) + " |"]
        rows.append("|" + " --- |" * (len(faults) + 2))
        for kind in KINDS:
            if self.requests[kind]:
                cells = [str(self.injected[(f, kind)] or "") for f in faults]
                rows.append(f"| {kind} | {self.requests[kind]} | " + " | ".join(cells) + " |")
        return "\n".join(rows)


class FaultProxy:
    """An HTTP/1.1 proxy on ``127.0.0.1:<port>`` to ``target`` applying ``schedule``, until :meth:`close`.

    :param target: the endpoint, ``http://host:port``.
    :param schedule: which request gets which fault.
    :param delay: seconds a ``delay_*`` fault waits: set it past the client's read timeout.
    :param key_prefix: stripped from object keys before the schedule sees them (a test's random prefix), so a
        seed picks the same requests in every run.
    """

    def __init__(
        self, target: str, schedule: FaultSchedule, *, delay: float = 2.0, key_prefix: str = ""
    ) -> None:
        parsed = urlparse(target)
        assert parsed.hostname and parsed.port, f"need http://host:port, not {target!r}"
        self.target = (parsed.hostname, parsed.port)
        self.schedule = schedule
        self.delay = delay
        self.key_prefix = key_prefix.strip("/") + "/" if key_prefix.strip("/") else ""
        self.stats = FaultStats()
        self._busy = 0  # exchanges between reading a request and answering it
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)  # the accept loop sees close() promptly
        self.port = int(self._listener.getsockname()[1])
        self._accepting = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop accepting, drop every connection, and wait for the connection threads."""
        self._closed.set()
        self._listener.close()
        self._accepting.join(timeout=5)
        with self._lock:
            sockets, self._open = set(self._open), set()
            threads = list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------------------
    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._open.add(sock)
        return sock

    def _forget(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._open.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self._track(client)
            thread = threading.Thread(
                target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True
            )
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _count(self, kind: str, fault: str | None) -> None:
        with self._lock:
            self.stats.requests[kind] += 1
            if fault is not None:
                self.stats.injected[(fault, kind)] += 1

    def _sleep(self, seconds: float) -> None:
        self._closed.wait(seconds)

    def _serve(self, client: socket.socket) -> None:
        upstream: list[socket.socket | None] = [None]
        reader = client.makefile("rb")
        try:
            while not self._closed.is_set():
                if not self._one_exchange(client, reader, upstream):
                    return
        except (_Closed, OSError, ValueError):
            return
        finally:
            reader.close()
            self._forget(client)
            self._forget(upstream[0])

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is being held or forwarded (delayed requests have landed); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._busy == 0:
                    return True
            time.sleep(0.02)
        return False

    def _one_exchange(
        self, client: socket.socket, reader: BinaryIO, upstream: list[socket.socket | None]
    ) -> bool:
        """Read one request, apply the schedule, answer (or not). False when the connection is done."""
        request = _read_head(reader)
        if request is None:
            return False
        with self._lock:
            self._busy += 1
        try:
            return self._exchange(request, client, reader, upstream)
        finally:
            with self._lock:
                self._busy -= 1

    def _exchange(
        self,
        request: _Message,
        client: socket.socket,
        reader: BinaryIO,
        upstream: list[socket.socket | None],
    ) -> bool:
        method, target, _version = request.start.split(" ", 2)
        if (request.header("expect") or "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        _read_body(reader, request)
        lower = {k.lower(): v for k, v in request.headers}
        kind, key = classify(method, target, lower)
        if self.key_prefix and key.startswith(self.key_prefix):
            key = key[len(self.key_prefix) :]
        decision = self.schedule.decide_with_delay(kind, key)
        fault, delay = decision if decision else (None, None)
        delay = self.delay if delay is None else delay
        if fault in TRUNCATIONS and kind not in BODY_KINDS:
            fault = None  # an explicit rule on a kind without a body: nothing to cut
        self._count(kind, fault)
        head_request = method == "HEAD"

        if fault == HANG:
            self._closed.wait()
            return False
        if fault == "http_500":
            client.sendall(
                _s3_error(
                    500,
                    "Internal Server Error",
                    "InternalError",
                    "We encountered an internal error. Please try again.",
                    with_body=not head_request,
                )
            )
            return True
        if fault == "slow_down_503":
            client.sendall(
                _s3_error(
                    503,
                    "Slow Down",
                    "SlowDown",
                    "Please reduce your request rate.",
                    with_body=not head_request,
                )
            )
            return True
        if fault == "reset_before":
            _reset(client)
            return False
        if fault == "delay_before":
            self._sleep(delay)
            if self._closed.is_set():
                return False

        response = self._forward(request, upstream, head_request=head_request)
        if fault == "reset_after":
            _reset(client)
            return False
        if fault == "delay_after":
            self._sleep(delay)
            with contextlib.suppress(OSError):
                client.sendall(_serialize(response.start, response.headers, response.body))
            return False
        if fault in TRUNCATIONS and len(response.body) >= 2:
            cut = response.body[: len(response.body) // 2]
            if fault == "truncate_keep_length":
                client.sendall(_serialize(response.start, response.headers, cut))
                _reset(client)
                return False
            headers = [*response.without("content-length"), ("Content-Length", str(len(cut)))]
            client.sendall(_serialize(response.start, headers, cut))
            return True
        client.sendall(_serialize(response.start, response.headers, response.body))
        closing = (response.header("connection") or "").lower() == "close"
        return not closing and (request.header("connection") or "").lower() != "close"

    def _forward(
        self, request: _Message, upstream: list[socket.socket | None], *, head_request: bool
    ) -> _Message:
        """Send ``request`` upstream (on the kept-alive connection, or a new one) and read the whole answer.

        The answer comes back with a ``Content-Length`` body (a chunked one is de-chunked), so a fault can cut
        it exactly.
        """
        wire = _serialize(request.start, request.without("expect"), request.raw_body)
        sock = upstream[0]
        if sock is not None and _stale(sock):
            self._forget(sock)
            sock = None
        if sock is None:
            sock = self._track(socket.create_connection(self.target, timeout=60))
            upstream[0] = sock
        sock.sendall(wire)
        reader = sock.makefile("rb")
        try:
            while True:
                response = _read_head(reader)
                if response is None:
                    raise _Closed("the endpoint closed the connection without answering")
                status = int(response.start.split(" ", 2)[1])
                if status >= 200:
                    break  # a 1xx (100 Continue) is skipped; the final answer follows
            if not (head_request or status in (204, 304)):
                _read_body(reader, response, until_close=True)
        finally:
            reader.close()
        keep = (response.header("connection") or "").lower() != "close" and (
            response.header("content-length") is not None
            or (response.header("transfer-encoding") or "").lower().endswith("chunked")
            or head_request
            or status in (204, 304)
        )
        if response.header("transfer-encoding") is not None:
            response.headers = [
                *response.without("transfer-encoding", "content-length"),
                ("Content-Length", str(len(response.body))),
            ]
        if not keep:
            self._forget(sock)
            upstream[0] = None
            response.headers = [*response.without("connection"), ("Connection", "close")]
        return response


def _stale(sock: socket.socket) -> bool:
    """Whether an idle kept-alive upstream connection was closed by the endpoint (readable at EOF)."""
    import select

    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
