"""LocalDaemon: runs a real kvpoold process on a loopback port (tests, demos, notebooks).

Like client/local_daemon.h: the daemon gets --listen=127.0.0.1:0 (the kernel picks a free port;
`listen` names another address or a fixed port, as scale-out tests on 127.0.0.2-5 need) and
--port_file in a private temporary directory; start() waits for the port file and then for
the gRPC health status SERVING. Its output goes to a log file in that directory, quoted in
errors. stop() sends SIGTERM and expects a clean exit (status 0). On Linux (with util-linux's
setpriv) the daemon is also killed when the process that started it dies, so a crashed test
leaves no daemon behind.

    with LocalDaemon("build/bin/kvpoold", ["--pool_bytes=268435456"]) as daemon:
        client = Client(daemon.target)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence


from kvpool.client import Client
from kvpool.errors import KvpoolError
from kvpool.options import ClientOptions


def find_kvpoold() -> str:
    """$KVPOOL_KVPOOLD, else build/bin/kvpoold of the repository this file sits in, else
    kvpoold on PATH; FileNotFoundError otherwise."""
    env = os.environ.get("KVPOOL_KVPOOLD")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (os.path.join(here, "..", "..", ".."), os.getcwd()):
        path = os.path.abspath(os.path.join(up, "build", "bin", "kvpoold"))
        if os.access(path, os.X_OK):
            return path
    path = shutil.which("kvpoold")
    if path:
        return path
    raise FileNotFoundError("no kvpoold: set KVPOOL_KVPOOLD or build it (make build)")


def _exit_with_parent() -> List[str]:
    """A command prefix that has the daemon killed when the process that started it dies
    (util-linux `setpriv --pdeathsig`, which sets it and execs the daemon), or none without
    setpriv. Not a preexec_fn: Python code between fork and exec is unsafe once gRPC threads
    run in this process, and it aborted daemons started beside live channels."""
    if os.name != "posix":
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


class LocalDaemon:
    def __init__(self, binary: Optional[str] = None, flags: Sequence[str] = (),
                 startup_timeout_s: float = 120.0,
                 client_options: Optional[ClientOptions] = None,
                 listen: str = "127.0.0.1:0") -> None:
        self.binary = binary or find_kvpoold()
        # How the startup health check connects (TLS when the flags turn it on).
        self.client_options = client_options
        self.flags: List[str] = list(flags)
        self.startup_timeout_s = startup_timeout_s
        self.listen_host, _, port = listen.rpartition(":")
        self.listen_port = int(port)
        self.dir = ""
        self.port = 0
        self.process: Optional[subprocess.Popen] = None

    @property
    def target(self) -> str:
        return f"{self.listen_host}:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "kvpoold.log")

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                data = f.read()
        except OSError:
            return ""
        text = data[-max_bytes:].decode("utf-8", "replace")
        return text if len(data) <= max_bytes else "..." + text

    def start(self) -> "LocalDaemon":
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(f"kvpoold binary {self.binary!r} is not executable")
        self.dir = tempfile.mkdtemp(prefix="kvpoold-")
        port_file = os.path.join(self.dir, "port")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*_exit_with_parent(), self.binary,
                 f"--listen={self.listen_host}:{self.listen_port}", f"--port_file={port_file}",
                 *self.flags],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        give_up = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                with open(port_file) as f:
                    text = f.read().strip()
                if text.isdigit() and int(text) > 0:
                    self.port = int(text)
                    break
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"kvpoold exited during startup (status "
                                   f"{self.process.returncode}); log:\n{self.log_tail()}")
            if time.monotonic() > give_up:
                self.kill()
                raise RuntimeError(f"kvpoold wrote no port file within "
                                   f"{self.startup_timeout_s} s; log:\n{self.log_tail()}")
            time.sleep(0.02)
        with Client(self.target, self.client_options) as client:
            try:
                client.wait_for_serving(max(5.0, give_up - time.monotonic()))
            except KvpoolError as e:
                self.kill()
                raise RuntimeError(f"kvpoold on {self.target} did not become SERVING: {e}; "
                                   f"log:\n{self.log_tail()}") from None
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM and wait; RuntimeError unless the daemon exits with status 0."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"kvpoold did not exit within {timeout_s} s of SIGTERM (killed); "
                               f"log:\n{self.log_tail()}") from None
        if status != 0:
            raise RuntimeError(f"kvpoold stopped with status {status}; log:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def cleanup(self) -> None:
        self.kill()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __enter__(self) -> "LocalDaemon":
        return self.start()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                self.stop()
        finally:
            self.cleanup()


__all__ = ["LocalDaemon", "find_kvpoold"]
