"""Elasticsearch-compatible servers for the ``es`` tests.

Default: each fixture starts ``noida-db`` (an Elasticsearch-API server) on a free 127.0.0.1 port in
a temporary data dir, keeps the ``Popen`` handle, waits until ``GET /`` answers, and terminates it by
that handle at the end. The wrapper script ``noida-db`` runs the real binary as a *child* process, so
the fixture starts the packaged binary directly (the handle then is the server itself); it falls
back to the wrapper in its own session and signals that process group.

``SONAR_ES_URL`` set: the tests run unchanged against that cluster (credentials from the usual
``SONAR_ES_API_KEY`` / ``SONAR_ES_USERNAME`` / ``SONAR_ES_PASSWORD``), each test module on a fresh,
uniquely named index that is deleted afterwards. The fault test cannot kill a real cluster, so there
``restartable_es`` puts a local TCP proxy in front of it and stops/starts the proxy on the same port.

When noida-db cannot start, every test that needs a server skips with the reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

EXTERNAL_URL = os.environ.get("SONAR_ES_URL")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _noida_command() -> tuple[list[str], bool]:
    """(argv prefix, is_wrapper)."""
    try:
        from importlib.resources import files

        binary = files("noida_db").joinpath("noida-db")
        if binary.is_file():
            path = str(binary)
            if not os.access(path, os.X_OK):
                os.chmod(path, 0o755)
            return [path], False
    except (ImportError, OSError):
        pass
    wrapper = shutil.which("noida-db")
    if wrapper:
        return [wrapper], True
    raise FileNotFoundError("noida-db is not installed (pip package 'noida-db')")


class NoidaServer:
    """One noida-db process we own: start / stop (terminate by handle) / start again on the same port
    and data dir."""

    restartable = True

    def __init__(self, data_dir: str | Path, port: int | None = None, startup_timeout_s: float = 15.0):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self._wrapper = False
        self._log = self.data_dir / "noida.log"

    def start(self) -> "NoidaServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        argv, self._wrapper = _noida_command()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(
                argv + ["start", "--only", "elasticsearch", "--elasticsearch-port", str(self.port),
                        "--host", "127.0.0.1", "--data-dir", str(self.data_dir)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"noida-db exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url, timeout=0.5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"noida-db did not answer on {self.url} within {self.startup_timeout_s}s: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        if self._wrapper:
            os.killpg(p.pid, signal.SIGTERM)  # our own session: the wrapper and the binary it spawned
        else:
            p.terminate()
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if self._wrapper:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
            p.wait(timeout_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self._log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class TcpProxy:
    """127.0.0.1:<port> -> target, stoppable and restartable on the same port (SONAR_ES_URL fault test).

    ``stop()`` closes the listener and every open connection, so the client sees refused connections
    exactly as if the server had died."""

    restartable = True

    def __init__(self, target_url: str, port: int | None = None):
        parts = urlsplit(target_url)
        self.scheme = parts.scheme or "http"
        self.target = (parts.hostname or "127.0.0.1", parts.port or (443 if self.scheme == "https" else 9200))
        self.port = port or free_port()
        self.url = f"{self.scheme}://127.0.0.1:{self.port}{parts.path}"
        self._listener: socket.socket | None = None
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> "TcpProxy":
        if self._listener is not None:
            return self
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            if self._listener is not ls:  # stopped meanwhile
                client.close()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not ls:
                    client.close()
                    upstream.close()
                    return
                self._socks.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def stop(self) -> None:
        with self._lock:
            ls, self._listener = self._listener, None
            socks, self._socks = self._socks, set()
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() (Linux)
            except OSError:
                pass
            ls.close()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    @property
    def running(self) -> bool:
        return self._listener is not None


class ExternalServer:
    restartable = False

    def __init__(self, url: str):
        self.url = url


def _start_noida(tmp: Path) -> NoidaServer:
    try:
        return NoidaServer(tmp).start()
    except (FileNotFoundError, RuntimeError, OSError) as e:
        pytest.skip(f"noida-db cannot start: {e}")


@pytest.fixture(scope="session")
def es_server():
    """A running server for the session: noida-db (ours) or SONAR_ES_URL."""
    if EXTERNAL_URL:
        yield ExternalServer(EXTERNAL_URL)
        return
    tmp = Path(tempfile.mkdtemp(prefix="sonar-noida-"))
    server = _start_noida(tmp)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def es_url(es_server) -> str:
    return es_server.url


@pytest.fixture
def restartable_es(tmp_path):
    """A server the test may stop and start again on the same port: a private noida-db (same data dir
    across restarts) or, with SONAR_ES_URL, a TCP proxy in front of that cluster."""
    if EXTERNAL_URL:
        proxy = TcpProxy(EXTERNAL_URL).start()
        try:
            yield proxy
        finally:
            proxy.stop()
        return
    server = _start_noida(tmp_path / "noida")
    try:
        yield server
    finally:
        server.stop()


def unique_index(prefix: str = "sonar-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def make_es_config():
    """ElasticConfig for a URL with a unique index name; with SONAR_ES_URL, the indices named through
    it are deleted at the end of the module."""
    from sonar.cluster.wire.config import ElasticConfig

    made: list[tuple[str, str]] = []

    def make(url: str, **overrides) -> ElasticConfig:
        cfg = ElasticConfig(hosts=[url], index=overrides.pop("index", unique_index()), **overrides)
        made.append((url, cfg.index))
        return cfg

    yield make
    _cleanup_indices(made)


def _cleanup_indices(made: list[tuple[str, str]]) -> None:
    if not EXTERNAL_URL or not made:
        return  # noida-db data dirs are temporary
    from sonar.cluster.wire.config import ElasticConfig
    from sonar.retrieval.elastic import ElasticRetriever

    for url, index in made:
        r = None
        try:
            r = ElasticRetriever.from_config(ElasticConfig(hosts=[EXTERNAL_URL], index=index))
            r.client.indices.delete(index=index, ignore_unavailable=True)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
        finally:
            if r is not None:
                r.close()
