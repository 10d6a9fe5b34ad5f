"""Tokens and client certificates from the Python package against a real kvpoold with TLS and a
tenants file (certificates generated at test time by tests/integration/make_test_certs.sh)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

import grpc
import pytest

from kvpool import Client, ClientOptions
from kvpool.errors import KvpoolError
from kvpool.local_daemon import LocalDaemon, find_kvpoold
from kvpool.options import NO_RETRY, TlsOptions

HERE = os.path.dirname(os.path.abspath(__file__))
CERTS_SCRIPT = os.path.join(HERE, "..", "..", "..", "tests", "integration", "make_test_certs.sh")
TOKEN_A = "py-token-a-31415926"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture(scope="module")
def secure_daemon():
    if shutil.which("openssl") is None or not os.path.exists(CERTS_SCRIPT):
        pytest.skip("needs the openssl CLI and the repository's make_test_certs.sh")
    try:
        binary = find_kvpoold()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tmp = tempfile.mkdtemp(prefix="kvpool-py-tenancy-")
    certs = os.path.join(tmp, "certs")
    subprocess.run([CERTS_SCRIPT, certs], check=True)
    tenants = os.path.join(tmp, "tenants.txtpb")
    with open(tenants, "w") as f:
        f.write(f'tenant {{ name: "team-a" role: ROLE_TENANT token_sha256: "{sha256(TOKEN_A)}" '
                f'certificate_name: "team-a" }}\n')
    with open(os.path.join(certs, "ca.pem"), "rb") as f:
        ca = f.read()
    d = LocalDaemon(binary, ["--pool_bytes=67108864", "--worker_threads=2",
                             f"--tenants_file={tenants}",
                             f"--tls_cert={certs}/server.pem", f"--tls_key={certs}/server.key",
                             f"--tls_client_ca={certs}/ca.pem"],
                    client_options=ClientOptions(tls=TlsOptions(root_certificates=ca)))
    d.start()
    yield d, certs, ca
    try:
        d.stop()
    finally:
        d.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def test_token_over_tls_names_the_tenant(secure_daemon):
    d, _, ca = secure_daemon
    with Client(d.target, ClientOptions(tls=TlsOptions(root_certificates=ca),
                                        token=TOKEN_A)) as c:
        assert c.get_stats().tenant == "team-a"


def test_client_certificate_names_the_tenant(secure_daemon):
    d, certs, ca = secure_daemon
    with open(os.path.join(certs, "client-uri.key"), "rb") as f:
        key = f.read()
    with open(os.path.join(certs, "client-uri.pem"), "rb") as f:
        chain = f.read()
    tls = TlsOptions(root_certificates=ca, private_key=key, certificate_chain=chain)
    with Client(d.target, ClientOptions(tls=tls)) as c:
        assert c.get_stats().tenant == "team-a"


def test_missing_or_wrong_token_is_unauthenticated_but_health_answers(secure_daemon):
    d, _, ca = secure_daemon
    for token in (None, TOKEN_A + "x"):
        with Client(d.target, ClientOptions(tls=TlsOptions(root_certificates=ca), token=token,
                                            retry=NO_RETRY)) as c:
            with pytest.raises(KvpoolError) as e:
                c.list_models()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"
