"""A real kvpoold with its metrics port (--metrics_listen on loopback, port from
--metrics_port_file), a client of it and a scraper, for the observability tests."""

from __future__ import annotations

import os
import tempfile
import urllib.error
import urllib.request
from typing import Dict, List, Sequence, Tuple

from prometheus_client.parser import text_string_to_metric_families

from kvpool import NO_RETRY, Client, ClientOptions
from kvpool.local_daemon import LocalDaemon, find_kvpoold

# UCX stays on loopback tcp (its sessions show in the transport series).
BASE_FLAGS = ["--pool_bytes=268435456", "--worker_threads=2", "--ucx_tls=tcp",
              "--ucx_net_devices=lo", "--scrub_period=0"]


class ObservedDaemon:
    def __init__(self, flags: Sequence[str] = ()) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpoold-metrics-")
        self.metrics_port_file = os.path.join(self.dir, "metrics_port")
        self.daemon = LocalDaemon(find_kvpoold(), [
            *BASE_FLAGS, "--metrics_listen=127.0.0.1:0",
            f"--metrics_port_file={self.metrics_port_file}", *flags])
        self.metrics_port = 0

    def __enter__(self) -> "ObservedDaemon":
        self.daemon.start()  # the metrics port file is written before the gRPC port's
        with open(self.metrics_port_file) as f:
            self.metrics_port = int(f.read().strip())
        assert self.metrics_port > 0
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.daemon.stop()
        finally:
            self.daemon.cleanup()

    def client(self) -> Client:
        return Client(self.daemon.target, ClientOptions(deadline_s=120.0, retry=NO_RETRY))

    def get(self, path: str) -> Tuple[int, str, str]:
        """(HTTP status, Content-Type, body) of GET `path` on the metrics port."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), ""

    def scrape(self) -> "Scrape":
        status, content_type, body = self.get("/metrics")
        assert status == 200, status
        assert content_type.startswith("text/plain; version=0.0.4"), content_type
        return Scrape(body)


class Scrape:
    """A page parsed by prometheus_client's text parser: sample name -> [(labels, value)]."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: Dict[str, List[Tuple[Dict[str, str], float]]] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((dict(s.labels), s.value))

    def value(self, name: str, **labels: str) -> float:
        found = [v for l, v in self.samples.get(name, []) if l == labels]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples in\n{self.text}"
        return found[0]

    def labelled(self, name: str) -> List[Tuple[Dict[str, str], float]]:
        return self.samples.get(name, [])

