"""An HTTP/1.1 proxy between ckptd and the S3 gateway that injects faults
(issue 36's fault suite): 503 SlowDown bursts, connections reset after the
request, bodies cut short, bodies stalled mid-way, and bodies with a byte
flipped. Requests are forwarded byte for byte (the Host header is the
proxy's, which is what the client signed), one upstream connection per
client connection, keep-alive on both sides.

    proxy = FaultProxy(upstream_port)
    proxy.plan("GET", ["slowdown", "slowdown", None])  # the next three GETs
    ... point AWS_ENDPOINT_URL at http://127.0.0.1:{proxy.port} ...
    proxy.seen["GET"], proxy.faults  # what passed through, what was injected
    proxy.delay_s = 0.2; proxy.max_inflight["HEAD"]  # latency; the most requests at once
"""
import collections
import socket
import threading
import time

SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
            b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n")
SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")


def _read_head(sock, buf):
    """Reads up to the end of an HTTP head; returns (head bytes, rest) or (None, buf)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None, buf
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _headers(head):
    out = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            out[k.strip().lower()] = v.strip()
    return out


def _read_chunked(sock, buf):
    """A chunked body as it came (raw bytes, for forwarding), and what follows."""
    out = b""
    while True:
        while b"\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("peer closed mid-body")
            buf += chunk
        line, _, buf = buf.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        data, buf = _read_exact(sock, buf, size + 2)  # the data and its CRLF
        out += line + b"\r\n" + data
        if size == 0:
            return out, buf


def _read_exact(sock, buf, n):
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)) or 1)
        if not chunk:
            raise ConnectionError("peer closed mid-body")
        buf += chunk
    return buf[:n], buf[n:]


class FaultProxy:
    def __init__(self, upstream_port, host="127.0.0.1"):
        self.upstream = (host, upstream_port)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind((host, 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.plans = collections.defaultdict(collections.deque)  # method -> faults
        self.seen = collections.Counter()   # method -> requests forwarded or faulted
        self.faults = collections.Counter()  # fault -> times injected
        self.stall_s = 3.0
        self.delay_s = 0.0  # added before forwarding every request (a far-away store)
        self.inflight = collections.Counter()      # method -> requests being answered now
        self.max_inflight = collections.Counter()  # method -> the most at once
        self.inflight_all = 0      # requests of any method being answered now
        self.max_inflight_all = 0  # the most at once (from a request's arrival to its answer's head)
        # method -> (start, end) of each request answered, in the order they ended
        self.spans = collections.defaultdict(list)
        threading.Thread(target=self._accept, daemon=True).start()

    def plan(self, method, faults):
        """The next len(faults) requests of `method` get these faults (None: none)."""
        with self.lock:
            self.plans[method].extend(faults)

    def clear(self):
        with self.lock:
            self.plans.clear()

    def _next_fault(self, method):
        with self.lock:
            self.seen[method] += 1
            q = self.plans.get(method)
            f = q.popleft() if q else None
            if f:
                self.faults[f] += 1
            return f

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, client):
        up = None
        buf = b""
        try:
            up = socket.create_connection(self.upstream)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ubuf = b""
            while True:
                head, buf = _read_head(client, buf)
                if head is None:
                    return
                method = head.split(b" ", 1)[0].decode()
                n = int(_headers(head).get(b"content-length", b"0"))
                body, buf = _read_exact(client, buf, n)
                fault = self._next_fault(method)
                if fault == "slowdown":
                    client.sendall(SLOWDOWN % len(SLOWDOWN_BODY) + SLOWDOWN_BODY)
                    continue
                if fault == "reset":
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    return
                with self.lock:
                    self.inflight[method] += 1
                    self.max_inflight[method] = max(self.max_inflight[method],
                                                    self.inflight[method])
                    self.inflight_all += 1
                    self.max_inflight_all = max(self.max_inflight_all, self.inflight_all)
                started = time.monotonic()
                try:
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    up.sendall(head + body)
                    rhead, ubuf = _read_head(up, ubuf)
                finally:
                    with self.lock:
                        self.inflight[method] -= 1
                        self.inflight_all -= 1
                        self.spans[method].append((started, time.monotonic()))
                if rhead is None:
                    return
                status = int(rhead.split(b" ", 2)[1])
                while status == 100:  # "Expect: 100-continue" answered: the real answer follows
                    client.sendall(rhead)
                    rhead, ubuf = _read_head(up, ubuf)
                    if rhead is None:
                        return
                    status = int(rhead.split(b" ", 2)[1])
                h = _headers(rhead)
                if method == "HEAD" or status in (204, 304):
                    rbody = b""
                elif h.get(b"transfer-encoding", b"").lower() == b"chunked":
                    rbody, ubuf = _read_chunked(up, ubuf)
                else:
                    rbody, ubuf = _read_exact(up, ubuf, int(h.get(b"content-length", b"0")))
                if fault == "truncate" and len(rbody) > 1:
                    client.sendall(rhead + rbody[:len(rbody) // 2])
                    return  # closed with the body cut short
                if fault == "stall" and len(rbody) > 1:
                    client.sendall(rhead + rbody[:len(rbody) // 2])
                    time.sleep(self.stall_s)
                    return
                if fault == "flip" and len(rbody) > 0:
                    i = len(rbody) // 2
                    rbody = rbody[:i] + bytes([rbody[i] ^ 0x5A]) + rbody[i + 1:]
                client.sendall(rhead + rbody)
        except (OSError, ConnectionError, ValueError):
            return
        finally:
            for s in (client, up):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
