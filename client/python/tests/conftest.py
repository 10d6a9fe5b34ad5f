"""Fixtures: one real kvpoold per test session (kvpool.LocalDaemon), and a client of it.

The daemon binary is $KVPOOL_KVPOOLD (CTest sets it to the one it built) or build/bin/kvpoold.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvpool import Client, ClientOptions
from kvpool.local_daemon import LocalDaemon, find_kvpoold


@pytest.fixture(scope="session")
def daemon():
    try:
        binary = find_kvpoold()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    d = LocalDaemon(binary, ["--pool_bytes=268435456", "--worker_threads=2"])
    d.start()
    yield d
    try:
        d.stop()
    finally:
        d.cleanup()


@pytest.fixture()
def client(daemon):
    c = Client(daemon.target, ClientOptions(deadline_s=120.0))
    yield c
    c.close()


@pytest.fixture()
def uid():
    """A fresh id suffix, so tests sharing the daemon never collide."""
    return uuid.uuid4().hex[:10]


def pytest_report_header(config):
    return f"kvpoold: {os.environ.get('KVPOOL_KVPOOLD', '(build/bin/kvpoold)')}"
