#!/usr/bin/env python3
"""End-to-end: `moeinfer serve` against hostile and broken HTTP clients, over raw sockets.

Starts the real server on the demo model (port 0) and checks, one line per check:

  chunked_body_limit   a chunked body is held to the 16 MiB limit while it is read: 17 MiB
                       without the terminating chunk gets its 413 (an OpenAI error object,
                       `Connection: close`) without the end of the body; a whole 40 MiB chunked
                       prompt is 413 without a token counted; a Content-Length over the limit is
                       413 before any body is sent (with `Expect: 100-continue` too); a small
                       chunked body is served
  prompt_bytes         a prompt (completions, chat, /tokenize) longer in bytes than the context
                       could hold is a 400 naming the limit, before tokenizing; a shorter one that
                       still has too many tokens is the tokenized 413
  slow_senders         a server with a 20-thread pool and 2 s read deadlines, 30 clients sending
                       their request line, headers or body a byte a second: each is answered 408
                       (or closed)
                       long before it would have finished, and a normal request made meanwhile
                       completes
  min_rate             --min-request-rate: a body or headers trickled under the minimum rate
                       after the grace period get a 408 naming the rate (not the 60 s deadline)
                       and the connection closes; counted in slow_clients_total and
                       request_rejected_total; a body sent in pieces above the rate is served;
                       with --min-request-rate 0 only the body deadline cuts a trickle
  slow_reader          --send-timeout: a client with a tiny receive buffer that reads a byte now
                       and then gets its stream cut before [DONE]: the request is aborted (its KV
                       blocks back in the pool), counted (slow_clients_total, finished_reason
                       abort) and logged (a server line, and finish=send_timeout in the access
                       line), and the connection reset (the unsent rest dropped)
  pipelining           several requests written back to back on one connection before reading
                       are all answered, in order; after a bad-JSON 400 the connection goes on;
                       after a 401 or a refused body the connection closes cleanly instead of
                       reading the body as a request; so it does after a GET with a body
                       (Content-Length or chunked), which is never read
  malformed            broken request lines, headers, framings and bodies: each a 4xx with an
                       OpenAI error object, each counted in request_rejected_total, and the
                       server keeps serving; a route asked with a method it does not take is a
                       405 naming its methods in Allow (an unknown route stays 404); a
                       Content-Encoding that is not decoded is a 415, those that are are served;
                       a multipart/form-data body is a 415 (it was a 500)
  allowed_hosts        --allowed-hosts: listed names (any case, any port) are served, others
                       421 (host_not_allowed), /health stays open; without the flag any host;
                       an HTTP/1.1 request with no Host header is a 400 (missing_host) either way
  absolute_form        a request target in absolute form ("POST http://host/v1/completions", as
                       sent to a proxy) is routed on its path, and its authority is the host
                       --allowed-hosts checks, not the Host header
  http10_stream        a stream asked over HTTP/1.0 (keep-alive or not) comes as bare SSE events
                       ended by the server closing the connection, never chunked (HTTP/1.0 has no
                       chunked coding); an answer that closes says `Connection: close` once
  shutdown_abort       SIGTERM with --shutdown-grace 0: requests still running end with an error
                       (an SSE error event, or a 503 error object), never finish_reason "abort"

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
No check depends on a tight wall-clock figure: deadlines of 2 s are checked against bounds of a
minute or more.
"""

from __future__ import annotations

import gzip
import json
import signal
import socket
import sys
import threading
import time
import zlib

import e2e_util
from e2e_util import parse_metrics

MIB = 1 << 20
COMPLETION = json.dumps({"prompt": "Once upon a time", "max_tokens": 4,
                         "temperature": 0}).encode()


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> dict:
        return json.loads(self.body)

    def error(self) -> dict:
        """The OpenAI error object of an error answer (asserted to be one)."""
        e = self.json()
        assert set(e) == {"error"}, e
        assert {"message", "type", "param", "code"} <= set(e["error"]), e
        assert e["error"]["message"], e
        return e["error"]


class Conn:
    """One raw HTTP/1.1 connection: write bytes, read answers one at a time."""

    def __init__(self, port: int, timeout: float = 60.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def read_response(self) -> Response | None:
        """The next answer, or None when the server closed the connection first."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                assert not self.buf, f"connection closed mid-answer: {self.buf[:200]!r}"
                return None
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                while b"\r\n" not in self.buf:
                    assert self._fill(), "closed inside a chunked answer"
                size_line, self.buf = self.buf.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                while len(self.buf) < size + 2:
                    assert self._fill(), "closed inside a chunk"
                body, self.buf = body + self.buf[:size], self.buf[size + 2:]
                if size == 0:
                    break
        else:
            length = int(headers.get("content-length", "0"))
            while len(self.buf) < length:
                assert self._fill(), "closed inside an answer"
            body, self.buf = self.buf[:length], self.buf[length:]
        return Response(status, headers, body)

    def closed_by_server(self) -> bool:
        """True when the server closes (EOF or reset) with nothing more to read."""
        try:
            return not self.buf and not self._fill()
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def one(port: int, raw: bytes) -> Response | None:
    c = Conn(port)
    try:
        c.send(raw)
        return c.read_response()
    finally:
        c.close()


def metrics(port: int) -> dict[str, float]:
    r = one(port, request("GET", "/metrics"))
    assert r and r.status == 200, r and r.status
    return parse_metrics(r.body.decode())


def rejected(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("moeinfer:request_rejected_total"))


def check_chunked_body_limit(s: e2e_util.ServerProcess, ctx: dict) -> None:
    before = metrics(s.port)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"a " * (MIB // 2)
    # 17 MiB and no terminating chunk: only a limit enforced while reading can answer this.
    c = Conn(s.port)
    c.send(head + chunk(b'{"prompt": "'))
    for _ in range(17):
        c.send(chunk(piece))
    r = c.read_response()
    assert r and r.status == 413, r and (r.status, r.body)
    e = r.error()
    assert e["code"] == "payload_too_large" and "16 MiB" in e["message"], e
    assert r.headers.get("connection") == "close", r.headers
    assert "keep-alive" not in r.headers, r.headers
    c.close()

    # 40 MiB, whole: refused before it is parsed or tokenized.
    c = Conn(s.port)
    sender_error = []

    def send_all():
        try:
            c.send(head + chunk(b'{"prompt": "'))
            for _ in range(40):
                c.send(chunk(piece))
            c.send(chunk(b'", "max_tokens": 1}') + b"0\r\n\r\n")
        except OSError as ex:  # the server may close before all of it is sent
            sender_error.append(ex)

    sender = threading.Thread(target=send_all)
    sender.start()
    r = c.read_response()
    sender.join()
    c.close()
    assert r and r.status == 413 and r.error()["code"] == "payload_too_large", r and r.body

    # A Content-Length over the limit: no need to send the body at all.
    r = one(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Length: %d\r\n\r\n" % (17 * MIB))
    assert r and r.status == 413 and r.error()["code"] == "payload_too_large", r and r.body
    r = one(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (17 * MIB))
    assert r and r.status == 413, r and (r.status, r.body)

    after = metrics(s.port)
    assert after["moeinfer:prompt_tokens_total"] == before["moeinfer:prompt_tokens_total"], \
        "a refused body was tokenized"
    got = (after.get('moeinfer:request_rejected_total{status="413"}', 0)
           - before.get('moeinfer:request_rejected_total{status="413"}', 0))
    assert got == 4, f"{got} 413s counted, wanted 4"

    # A small chunked body is an ordinary request, in several chunks.
    r = one(s.port, head + chunk(COMPLETION[:10]) + chunk(COMPLETION[10:]) + b"0\r\n\r\n")
    assert r and r.status == 200 and r.json()["choices"][0]["text"], r and r.body


def check_prompt_bytes(s: e2e_util.ServerProcess, ctx: dict) -> None:
    def post(path: str, body: dict) -> Response:
        r = one(s.port, request("POST", path, json.dumps(body).encode(),
                                {"Content-Type": "application/json"}))
        assert r is not None
        return r

    # Find the limit from the message of a prompt that is surely over it (12 MiB, under the
    # body limit), then check just over and just under it.
    r = post("/v1/completions", {"prompt": "a" * (12 * MIB), "max_tokens": 1})
    assert r.status == 400, (r.status, r.body)
    e = r.error()
    assert e["param"] == "prompt" and e["code"] == "context_length_exceeded", e
    assert "512 tokens" in e["message"] and "not tokenized" in e["message"], e
    limit = int(e["message"].split("at most ")[1].split(" bytes")[0])
    assert 512 <= limit < 12 * MIB, limit
    before = metrics(s.port)
    r = post("/v1/completions", {"prompt": "a" * (limit + 1), "max_tokens": 1})
    assert r.status == 400 and r.error()["param"] == "prompt", (r.status, r.body)
    assert f"at most {limit} bytes" in r.error()["message"], r.body
    # Under the byte bound but far over the context in tokens: tokenized, then the usual 413.
    r = post("/v1/completions", {"prompt": "a b " * (limit // 8), "max_tokens": 1})
    assert r.status == 413 and r.error()["code"] == "context_length_exceeded", (r.status, r.body)
    r = post("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "a" * (limit + 1)}], "max_tokens": 1})
    assert r.status == 400 and r.error()["param"] == "messages", (r.status, r.body)
    r = post("/tokenize", {"prompt": "a" * (limit + 1)})
    assert r.status == 400 and r.error()["param"] == "prompt", (r.status, r.body)
    after = metrics(s.port)
    assert rejected(after) - rejected(before) == 4, (rejected(after), rejected(before))


def check_slow_senders(s: e2e_util.ServerProcess, ctx: dict) -> None:
    # 2 + 2 + 16 = 20 pool threads (docs/serving.md), fewer than the slow clients.
    slow = e2e_util.ServerProcess(ctx["moeinfer"], ["--max-num-seqs", "2", "--max-queue", "2",
                                                    "--header-timeout", "2",
                                                    "--body-timeout", "2"])
    give_up = 90.0  # a slow client stops here; its deadline is 2 s
    results: dict[int, tuple[str, float]] = {}

    def slow_client(i: int) -> None:
        c = Conn(slow.port, timeout=0.5)
        start = time.monotonic()
        if i % 3 == 0:  # the request line a byte at a time
            trickle = b"GET /" + b"a" * 4000
        elif i % 3 == 1:  # the headers a byte at a time
            c.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            trickle = b"X-Slow: " + b"a" * 4000
        else:  # the body a byte at a time
            c.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Length: 4000\r\n\r\n")
            trickle = b"a" * 4000
        try:
            for byte in trickle:
                if time.monotonic() - start > give_up:
                    results[i] = ("gave up", give_up)
                    return
                c.send(bytes([byte]))
                try:
                    r = c.read_response()
                except socket.timeout:
                    continue
                results[i] = (str(r.status if r else "closed"), time.monotonic() - start)
                if r:
                    r.error()
                return
        except OSError:
            results[i] = ("closed", time.monotonic() - start)
        finally:
            c.close()

    try:
        threads = [threading.Thread(target=slow_client, args=(i,)) for i in range(30)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # let them take the pool (not a timing check)
        c = Conn(slow.port, timeout=give_up - 30)
        c.send(request("POST", "/v1/completions", COMPLETION))
        r = c.read_response()
        c.close()
        assert r and r.status == 200 and r.json()["choices"][0]["text"], r and r.body
        for t in threads:
            t.join()
        assert len(results) == 30, results
        outcomes = {outcome for outcome, _ in results.values()}
        assert outcomes <= {"408", "closed"}, results
        assert "408" in outcomes, results
        slowest = max(elapsed for _, elapsed in results.values())
        assert slowest < give_up / 2, f"a slow sender held its connection {slowest:.0f} s"
    finally:
        slow.stop()


def trickle(c: Conn, data: bytes, pause: float, give_up: float = 60.0) -> Response | None:
    """Sends `data` a byte every `pause` s until the server answers or closes; its answer."""
    start = time.monotonic()
    c.sock.settimeout(pause)
    try:
        for byte in data:
            assert time.monotonic() - start < give_up, "no answer to a trickle"
            c.send(bytes([byte]))
            try:
                return c.read_response()
            except socket.timeout:
                continue
    except OSError:
        return None
    c.sock.settimeout(60)
    return c.read_response()


def check_min_rate(s: e2e_util.ServerProcess, ctx: dict) -> None:
    flags = ["--min-request-rate", "1000", "--min-request-rate-grace", "1",
             "--header-timeout", "60", "--body-timeout", "60"]
    rated = e2e_util.ServerProcess(ctx["moeinfer"], flags)
    try:
        before = metrics(rated.port)
        # A body at 20 bytes/s: far under 1000 bytes/s once the second of grace is over.
        c = Conn(rated.port)
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n")
        r = trickle(c, b"a" * 4000, 0.05)
        assert r and r.status == 408, r and (r.status, r.body)
        e = r.error()
        assert "request body arrived slower than 1000 bytes/s" in e["message"], e
        assert r.headers.get("connection") == "close", r.headers
        assert c.closed_by_server(), "the connection stayed open after the 408"
        c.close()
        # Headers at 20 bytes/s, the request line first and then a header.
        c = Conn(rated.port)
        c.send(b"GET /v1/models HTTP/1.1\r\n")
        r = trickle(c, b"X-Slow: " + b"a" * 4000, 0.05)
        assert r and r.status == 408, r and (r.status, r.body)
        assert "line and headers arrived slower than 1000 bytes/s" in r.error()["message"], r.body
        c.close()
        # A request line at 20 bytes/s: answered before cpp-httplib has it.
        c = Conn(rated.port)
        r = trickle(c, b"GET /" + b"a" * 4000, 0.05)
        assert r and r.status == 408, r and (r.status, r.body)
        assert "slower than 1000 bytes/s" in r.error()["message"], r.body
        c.close()
        # A body in pieces of 400 bytes every 0.1 s (4000 bytes/s) keeps above the rate.
        prompt = json.dumps({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
                             "user": "x" * 3000}).encode()
        c = Conn(rated.port)
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(prompt))
        for i in range(0, len(prompt), 400):
            c.send(prompt[i:i + 400])
            time.sleep(0.1)  # pacing the sender, not a timing check
        r = c.read_response()
        assert r and r.status == 200, r and (r.status, r.body)
        c.close()
        after = metrics(rated.port)
        for reason, want in (("body_rate", 1), ("header_rate", 2), ("send_timeout", 0)):
            key = f'moeinfer:slow_clients_total{{reason="{reason}"}}'
            assert after[key] - before[key] == want, (reason, after[key], before[key])
        key = 'moeinfer:request_rejected_total{status="408"}'
        assert after.get(key, 0) - before.get(key, 0) == 3, (after.get(key), before.get(key))
    finally:
        rated.stop()
    # --min-request-rate 0: no minimum, only the (here 3 s) body deadline.
    unrated = e2e_util.ServerProcess(ctx["moeinfer"], ["--min-request-rate", "0",
                                                       "--min-request-rate-grace", "0",
                                                       "--body-timeout", "3"])
    try:
        c = Conn(unrated.port)
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4000\r\n\r\n")
        r = trickle(c, b"a" * 4000, 0.05)
        assert r and r.status == 408, r and (r.status, r.body)
        assert "did not arrive within 3 s" in r.error()["message"], r.body
        c.close()
    finally:
        unrated.stop()


def check_slow_reader(s: e2e_util.ServerProcess, ctx: dict) -> None:
    slow = e2e_util.ServerProcess(ctx["moeinfer"], ["--send-timeout", "1"])
    try:
        before = metrics(slow.port)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window
        sock.connect(("127.0.0.1", slow.port))
        # Eight sequences of 480 tokens: the engine is still at it when the client falls behind.
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 480, "n": 8,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        sock.sendall(request("POST", "/v1/completions", body,
                             {"Content-Type": "application/json"}))
        sock.settimeout(60)
        got = b""
        start = time.monotonic()
        reset = False

        def cut_off() -> bool:
            return any("(--send-timeout)" in line for line in slow.log)

        # A byte now and then (about 50 bytes/s) until the server gives up on the client; then
        # what the client's own buffer still holds, at full speed, up to the reset.
        while not cut_off():
            assert time.monotonic() - start < 120, f"still streaming after {len(got)} bytes"
            try:
                byte = sock.recv(1)
            except ConnectionResetError:
                reset = True
                break
            if not byte:
                break
            got += byte
            time.sleep(0.02)
        while not reset:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                reset = True
                break
            if not data:
                break
            got += data
        sock.close()
        assert reset, "the connection of a client too slow to read was closed, not reset"
        assert got.startswith(b"HTTP/1.1 200"), got[:100]
        assert b"data: [DONE]" not in got, "the stream was not cut"
        e2e_util.wait_for(lambda: idle_kv(slow.port), "the aborted request's KV blocks")
        after = metrics(slow.port)
        key = 'moeinfer:slow_clients_total{reason="send_timeout"}'
        assert after[key] - before[key] == 1, (after[key], before[key])
        key = 'moeinfer:request_success_total{finished_reason="abort"}'
        assert after[key] - before[key] == 1, (after[key], before[key])
        e2e_util.wait_for(lambda: any("finish=send_timeout" in line for line in slow.log),
                          "the access line")
        log = "".join(slow.log)
        assert "(--send-timeout): connection closed, its request aborted" in log, log[-2000:]
        # The server goes on serving.
        r = one(slow.port, request("POST", "/v1/completions", COMPLETION))
        assert r and r.status == 200, r and r.body
    finally:
        slow.stop()


def idle_kv(port: int) -> bool:
    m = metrics(port)
    return m["moeinfer:kv_cache_used_blocks"] == 0 and m["moeinfer:num_requests_running"] == 0


def check_pipelining(s: e2e_util.ServerProcess, ctx: dict) -> None:
    c = Conn(s.port)
    c.send(request("GET", "/health") + request("POST", "/v1/completions", COMPLETION)
           + request("POST", "/v1/completions", b"{not json") + request("GET", "/v1/models")
           + request("POST", "/tokenize", b'{"prompt": "hello"}'))
    answers = [c.read_response() for _ in range(5)]
    assert all(answers), answers
    assert [a.status for a in answers] == [200, 200, 400, 200, 200], [a.status for a in answers]
    assert answers[1].json()["object"] == "text_completion", answers[1].body
    answers[2].error()
    assert answers[3].json()["object"] == "list", answers[3].body
    assert answers[4].json()["count"] >= 1, answers[4].body
    # Still open: one more on the same connection.
    c.send(request("GET", "/health"))
    assert c.read_response().status == 200
    c.close()

    # A body on a GET is never read by cpp-httplib: it must not be taken for the next request
    # (a request smuggled inside it), so the connection closes after the answer.
    inner = request("GET", "/version")
    for framing, raw in (
            ("Content-Length", request("GET", "/health", inner)),
            ("chunked", request("GET", "/health", headers={"Transfer-Encoding": "chunked"})
             + chunk(inner) + b"0\r\n\r\n")):
        c = Conn(s.port)
        c.send(raw)
        r = c.read_response()
        assert r.status == 200 and r.headers.get("connection") == "close", (framing, r.headers)
        assert c.closed_by_server(), f"{framing}: the GET's body was read as a request"
        c.close()
    # Content-Length: 0 is no body: the connection goes on.
    c = Conn(s.port)
    c.send(request("GET", "/health", headers={"Content-Length": "0"}) + request("GET", "/version"))
    assert [c.read_response().status for _ in range(2)] == [200, 200]
    c.close()

    # Answered before its body was read (401): the body must not be taken for a request, so
    # the connection closes after the answer; what was pipelined behind is not answered.
    keyed = e2e_util.ServerProcess(ctx["moeinfer"], ["--api-key", "k"])
    try:
        sneaky = request("GET", "/v1/models", headers={"Authorization": "Bearer k"})
        c = Conn(keyed.port)
        c.send(request("POST", "/v1/completions", sneaky) + request("GET", "/health"))
        r = c.read_response()
        assert r.status == 401 and r.headers.get("connection") == "close", (r.status, r.headers)
        assert c.closed_by_server(), "the server read on after the refused request"
        c.close()
        # A GET without a body keeps its connection after a 401.
        c = Conn(keyed.port)
        c.send(request("GET", "/v1/models") + request("GET", "/health"))
        assert [c.read_response().status for _ in range(2)] == [401, 200]
        c.close()
    finally:
        keyed.stop()


MALFORMED = [
    # (name, raw request, expected status)
    ("garbage request line", b"HELLO\r\n\r\n", 400),
    ("unknown method", b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("request target over 8 KiB", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("request line over 64 KiB, unended", b"GET /" + b"a" * 70000, 431),
    ("headers over 64 KiB",
     b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000)
                                              for i in range(80)) + b"\r\n", 431),
    ("Content-Length not a number",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    ("negative Content-Length",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    ("two Content-Lengths",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n"
     b"\r\n{}", 400),
    ("Content-Length and chunked",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),
    ("unknown Transfer-Encoding",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}", 400),
    ("bad chunk size",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"zz\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk of 2^64 - 1 bytes",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"ffffffffffffffff\r\n{}\r\n0\r\n\r\n", 400),
    ("gzip body that is not gzip",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
     b"Content-Length: 9\r\n\r\nnot gzip!", 400),
    ("unknown Content-Encoding",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: zstd\r\n"
     b"Content-Length: 2\r\n\r\n{}", 415),
    ("Content-Encoding in upper case (cpp-httplib would not decode it)",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: GZIP\r\n"
     b"Content-Length: 2\r\n\r\n{}", 415),
    ("two Content-Encodings",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
     b"Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 415),
    ("multipart/form-data body",
     request("POST", "/v1/completions",
             b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--b--\r\n',
             {"Content-Type": "multipart/form-data; boundary=b"}), 415),
    ("multipart/form-data that is JSON",
     request("POST", "/v1/completions", b'{"prompt": "hi"}',
             {"Content-Type": "multipart/form-data"}), 415),
    ("body not JSON", request("POST", "/v1/completions", b"\x00\xff{"), 400),
    ("prompt not UTF-8", request("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400),
    ("body a JSON list", request("POST", "/v1/chat/completions", b"[1, 2]"), 400),
    ("unknown route with a body", request("POST", "/v1/embeddings", b'{"input": "x"}'), 404),
    ("PUT on a POST route", request("PUT", "/v1/completions", b"{}"), 405),
    ("GET on a POST route", request("GET", "/v1/chat/completions"), 405),
    ("POST on a GET route", request("POST", "/v1/models", b"{}"), 405),
    ("DELETE on a model", request("DELETE", "/v1/models/demo"), 405),
]

# A route asked with another method: the Allow header names the methods it takes.
ALLOW = [(request("GET", "/v1/completions"), "POST"),
         (request("POST", "/health", b"{}"), "GET, HEAD"),
         (request("OPTIONS", "/tokenize"), "POST")]


def check_malformed(s: e2e_util.ServerProcess, ctx: dict) -> None:
    before = rejected(metrics(s.port))
    failures = []
    for name, raw, status in MALFORMED:
        r = one(s.port, raw)
        if r is None or r.status != status:
            failures.append(f"{name}: {r and r.status}, wanted {status}")
            continue
        try:
            r.error()
        except (AssertionError, ValueError) as ex:
            failures.append(f"{name}: not an OpenAI error object: {ex}")
    for raw, allow in ALLOW:
        r = one(s.port, raw)
        if r is None or r.status != 405 or r.headers.get("allow") != allow:
            failures.append(f"{raw[:30]!r}: {r and r.status} {r and r.headers}, wanted 405 "
                            f"with Allow: {allow}")
        elif r.error().get("code") != "method_not_allowed":
            failures.append(f"{raw[:30]!r}: {r.body!r}")
    assert not failures, failures
    after = rejected(metrics(s.port)) - len(ALLOW)
    assert after - before == len(MALFORMED), f"{after - before} rejections counted for " \
                                             f"{len(MALFORMED)} malformed requests"
    r = one(s.port, request("POST", "/v1/completions", COMPLETION))
    assert r and r.status == 200, r and r.body
    # The codings that are decoded are served.
    for coding, body in (("gzip", gzip.compress(COMPLETION)),
                         ("deflate", zlib.compress(COMPLETION)), ("identity", COMPLETION)):
        r = one(s.port, request("POST", "/v1/completions", body, {"Content-Encoding": coding}))
        assert r and r.status == 200, (coding, r and r.body)


def check_allowed_hosts(s: e2e_util.ServerProcess, ctx: dict) -> None:
    def get(port: int, path: str, host: str | None) -> Response:
        head = f"GET {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
        r = one(port, head.encode() + b"\r\n")
        assert r is not None
        return r

    assert get(s.port, "/v1/models", "evil.example").status == 200  # default: off
    # HTTP/1.1 requires a Host header (RFC 9112, 3.2), HTTP/1.0 does not.
    r = get(s.port, "/v1/models", None)
    assert r.status == 400 and r.error()["code"] == "missing_host", (r.status, r.body)
    r = one(s.port, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert r is not None and r.status == 200, r and r.body
    r = one(s.port, b"GET /v1/models HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n")
    assert r is not None and r.status == 400, r and r.body
    h = e2e_util.ServerProcess(ctx["moeinfer"], ["--allowed-hosts", "localhost,api.example,::1"])
    try:
        for host in ("localhost", "LOCALHOST:8000", "api.example", "[::1]:80"):
            r = get(h.port, "/v1/models", host)
            assert r.status == 200, (host, r.status, r.body)
        for host in ("evil.example", "api.example.evil", "127.0.0.1", "[::2]"):
            r = get(h.port, "/v1/models", host)
            assert r.status == 421 and r.error()["code"] == "host_not_allowed", (host, r.status)
        for host in ("", None):  # no host named: malformed before it is foreign
            r = get(h.port, "/v1/models", host)
            assert r.status == 400 and r.error()["code"] == "missing_host", (host, r.status)
        assert get(h.port, "/health", "evil.example").status == 200
        m = parse_metrics(get(h.port, "/metrics", "localhost").body.decode())
        assert m['moeinfer:request_rejected_total{status="421"}'] == 4, m
    finally:
        h.stop()


def check_shutdown_abort(s: e2e_util.ServerProcess, ctx: dict) -> None:
    # One running request at a time: the ones behind it cannot have finished when SIGTERM comes.
    d = e2e_util.ServerProcess(ctx["moeinfer"], ["--shutdown-grace", "0", "--max-num-seqs", "1"])
    long = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True}
    try:
        streams = []
        for _ in range(3):
            c = Conn(d.port)
            c.send(request("POST", "/v1/completions", json.dumps({**long, "stream": True}).encode()))
            streams.append(c)
        # The first stream's answer head: the engine is running (not a timing check).
        first = streams[0]
        while b"\r\n\r\n" not in first.buf:
            assert first._fill(), "no answer"
        # Behind the streams: it has not started (or is refused, 503 too) when SIGTERM comes.
        plain = Conn(d.port)
        plain.send(request("POST", "/v1/completions", json.dumps(long).encode()))
        d.proc.send_signal(signal.SIGTERM)
        endings = []
        for i, c in enumerate(streams):
            r = c.read_response()
            # Only the first is known to be running; the server may not have read the others
            # before SIGTERM, and a request read after it is refused.
            if i > 0 and r and r.status == 503:
                assert r.error()["code"] == "shutting_down", r.body
                endings.append("refused")
                c.close()
                continue
            assert r and r.status == 200, r and r.status
            events = [line[len("data: "):] for line in r.body.decode().split("\n")
                      if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", events[-3:]
            payloads = [json.loads(e) for e in events[:-1]]
            finishes = [ch["finish_reason"] for p in payloads for ch in p.get("choices", [])
                        if ch.get("finish_reason")]
            assert "abort" not in finishes, finishes
            errors = [p["error"] for p in payloads if "error" in p]
            if errors:
                assert errors[0]["code"] == "shutting_down", errors
                endings.append("error")
            else:
                assert finishes == ["length"], finishes
                endings.append("length")
            c.close()
        assert "error" in endings, endings
        r = plain.read_response()
        assert r and r.status == 503 and r.error()["code"] == "shutting_down", r and r.body
        plain.close()
        assert d.proc.wait(timeout=120) == 0
    finally:
        d.stop()


def check_absolute_form(s: e2e_util.ServerProcess, ctx: dict) -> None:
    def post(port: int, target: str, host: str) -> Response:
        raw = request("POST", "/v1/completions", COMPLETION, {"Connection": "close"})
        raw = raw.replace(b"POST /v1/completions ", f"POST {target} ".encode(), 1)
        raw = raw.replace(b"Host: 127.0.0.1\r\n", f"Host: {host}\r\n".encode(), 1)
        r = one(port, raw)
        assert r is not None, target
        return r

    for target in ("http://127.0.0.1/v1/completions", "HTTP://api.example:80/v1/completions?x=1"):
        r = post(s.port, target, "127.0.0.1")
        assert r.status == 200 and r.json()["object"] == "text_completion", (target, r.body)
    r = post(s.port, "http://127.0.0.1/v1/models", "127.0.0.1")
    assert r.status == 405, r.status
    # The target's authority is the host --allowed-hosts checks; the Host header is ignored.
    h = e2e_util.ServerProcess(ctx["moeinfer"], ["--allowed-hosts", "api.example"])
    try:
        assert post(h.port, "http://api.example/v1/completions", "evil.example").status == 200
        r = post(h.port, "http://evil.example/v1/completions", "api.example")
        assert r.status == 421, (r.status, r.body)
    finally:
        h.stop()


def check_http10_stream(s: e2e_util.ServerProcess, ctx: dict) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    for keep_alive in ({}, {"Connection": "keep-alive"}):
        c = Conn(s.port)
        c.send(request("POST", "/v1/completions", body, keep_alive)
               .replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))
        while c._fill():  # the answer ends when the server closes the connection
            pass
        c.close()
        head, _, events = c.buf.partition(b"\r\n\r\n")
        head = head.decode("latin-1").lower()
        assert head.startswith("http/1.1 200"), head
        assert "transfer-encoding" not in head and "\r\nconnection: close" in head, head
        assert events.endswith(b"data: [DONE]\n\n"), events[-200:]
        chunks = [json.loads(e[len(b"data: "):]) for e in events.split(b"\n\n")[:-2]]
        assert chunks[-1]["usage"]["completion_tokens"] == 4, chunks[-1]
        assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]), chunks
    # An answer that closes its connection says so once (cpp-httplib added a second header).
    c = Conn(s.port)
    c.send(request("POST", "/v1/models", b"{}", {"Connection": "close"}))
    while c._fill():
        pass
    c.close()
    head = c.buf.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.count("\r\nconnection:") == 1, head


CHECKS = [check_chunked_body_limit, check_prompt_bytes, check_slow_senders, check_min_rate,
          check_slow_reader, check_pipelining, check_malformed, check_allowed_hosts,
          check_absolute_form, check_http10_stream, check_shutdown_abort]


def main() -> int:
    args = e2e_util.parse_args()
    ctx = {"moeinfer": args.moeinfer}
    return e2e_util.summary(*e2e_util.serve_and_run(
        args.moeinfer, [], e2e_util.selected(CHECKS, args.only),
        lambda server, check: check(server, ctx)))

if __name__ == "__main__":
    sys.exit(main())
