import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from orbit_dagster.runtime.notices import NoticeWatcher

NOTICE = json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}).encode()


class _Metadata(BaseHTTPRequestHandler):
    """A stand-in for the instance metadata endpoint; subclasses say what it answers."""

    def _reply(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _serve(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_watcher_reads_the_aws_instance_action_endpoint():
    state = {"notice": False}

    class H(_Metadata):
        def do_GET(self):
            if self.path == "/latest/meta-data/spot/instance-action" and state["notice"]:
                self._reply(200, NOTICE)
            else:
                self._reply(404, b"Not Found")

    server, url = _serve(H)
    seen = []
    w = NoticeWatcher(url, poll_s=0.05, on_notice=seen.append)
    assert w.poll_once() is False  # 404: no notice yet
    w.start()
    time.sleep(0.2)
    assert not w.pending
    state["notice"] = True
    deadline = time.time() + 5
    while not w.pending and time.time() < deadline:
        time.sleep(0.02)
    server.shutdown()
    assert w.pending and seen and seen[0]["source"] == "metadata"
    assert seen[0]["deadline"] == 1893456120.0


def test_unreachable_endpoint_is_not_a_notice():
    w = NoticeWatcher("http://127.0.0.1:9", poll_s=0.05)
    assert w.poll_once() is False and not w.pending


def test_watcher_uses_an_imdsv2_token_where_the_endpoint_requires_one():
    seen_tokens = []

    class H(_Metadata):
        def do_PUT(self):
            ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            self._reply(200 if ok else 400, b"tok-123" if ok else b"")

        def do_GET(self):
            token = self.headers.get("X-aws-ec2-metadata-token")
            seen_tokens.append(token)
            if token != "tok-123":
                return self._reply(401, b"Unauthorized")
            self._reply(200, NOTICE)

    server, url = _serve(H)
    w = NoticeWatcher(url)
    assert w.poll_once() is True
    server.shutdown()
    assert seen_tokens == ["tok-123"] and w.notice["source"] == "metadata"
