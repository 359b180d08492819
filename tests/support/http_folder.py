"""A folder served over HTTP on 127.0.0.1 for the download tests (no network leaves the
machine): ``served_folder(folder, monkeypatch)`` yields ``(base_url, requested paths)``,
where ``base_url`` names ``folder/files/``."""
import contextlib
import functools
import http.server
import threading


@contextlib.contextmanager
def served_folder(folder, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    requested = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/files/", requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
