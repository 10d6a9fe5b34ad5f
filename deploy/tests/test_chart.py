"""deploy/helm/kvpool, offline: Helm's own SDK (helm-python-sdk) lints the chart, checks every
example values file against values.schema.json and renders it; kubernetes-validate checks every
rendered object against the Kubernetes schemas (--strict: no unknown fields); the assertions below
check what a schema cannot (probes and Services on the container's real ports, the PDB and
Services selecting the pods, auth wiring, security context, the preStop drain); the rendered
kvpoold.conf is handed to the real kvpoold (--config), which must start and serve; and with TLS
on, the rendered flags, probes and preStop command run against a real kvpoold with TLS and
tokens (certificates from tests/integration/make_test_certs.sh).

No cluster runs here: nothing below installs the chart (deploy/README.md)."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CHART = os.path.join(HERE, "..", "helm", "kvpool")
EXAMPLES = sorted(glob.glob(os.path.join(HERE, "..", "helm", "examples", "*.yaml")))
KUBE_VERSIONS = ["1.29.0", "1.37.0"]  # an older supported release and the newest bundled
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # not in the Kubernetes schemas


def load_values(path):
    with open(path) as f:
        return yaml.safe_load(f)


def render(values, name="kvpool", namespace="ml"):
    """Every object the chart renders, (kind, name) -> object."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=name, namespace=namespace)
    objects = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def only(objects, kind):
    found = [o for (k, _), o in objects.items() if k == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def daemon_container(objects):
    pod = only(objects, "StatefulSet")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "kvpoold"]
    return pod, container


def config_of(objects):
    text = only(objects, "ConfigMap")["data"]["kvpoold.conf"]
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    return dict(l.split(" = ", 1) for l in lines)


def test_lint_is_clean():
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda e: os.path.basename(e or "defaults"))
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(example, kube):
    values = load_values(example) if example else {"auth": {"tenantsFile": "tenant { name: \"a\" }"}}
    objects = render(values)
    assert objects
    for (kind, name), obj in objects.items():
        if (obj["apiVersion"], kind) in CRDS:
            continue
        kubernetes_validate.validate(obj, kube, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_probes_services_and_selectors_use_the_real_ports(example):
    values = load_values(example)
    objects = render(values)
    pod, c = daemon_container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    config = config_of(objects)
    assert config["listen"] == f"0.0.0.0:{ports['grpc']}"
    assert config["metrics_listen"] == f"0.0.0.0:{ports['metrics']}"
    assert config["ucx_listen"] == f"0.0.0.0:{ports['ucx']}"
    assert config["health_listen"] == f"0.0.0.0:{ports['health']}"
    # The probes ask the plaintext health port, which serves with or without TLS.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["health"], probe
    sts = only(objects, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    headless = objects[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    for (kind, _), svc in objects.items():
        if kind != "Service":
            continue
        assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"]
    pdb = only(objects, "PodDisruptionBudget")
    assert all(pod_labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())
    if values.get("serviceMonitor", {}).get("enabled"):
        sm = only(objects, "ServiceMonitor")
        assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
        client = [s for (k, _), s in objects.items() if k == "Service" and all(
            s["metadata"]["labels"].get(a) == b for a, b in sm["spec"]["selector"]["matchLabels"].items())]
        assert len(client) == 1 and "metrics" in [p["name"] for p in client[0]["spec"]["ports"]]
    np_ports = {p["port"] for rule in only(objects, "NetworkPolicy")["spec"]["ingress"]
                for p in rule["ports"]}
    assert np_ports == {"grpc", "ucx", "metrics"}
    # The helm test pod asks the client Service for health.
    test_pod = [o for o in objects.values() if o["metadata"].get("annotations", {}).get(
        "helm.sh/hook") == "test"]
    assert len(test_pod) == 1
    args = test_pod[0]["spec"]["containers"][0]["args"]
    assert args[0] == "health" and args[1].endswith(f".svc:{ports['grpc']}")


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_daemons_advertise_the_pod_ip_and_peer_through_the_headless_service(example):
    """docs/scale-out.md: --advertise is the pod IP (downward API) on the gRPC port; --peers is
    the headless Service's DNS name, in the target syntax kvpoold and the clients parse."""
    from kvpool.membership import parse_target

    objects = render(load_values(example), name="pool", namespace="ml")
    pod, c = daemon_container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (advertise,) = [a for a in c["args"] if a.startswith("--advertise=")]
    assert advertise == f"--advertise=$(POD_IP):{ports['grpc']}"
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    (peers,) = [a for a in c["args"] if a.startswith("--peers=")]
    target = parse_target(peers[len("--peers="):])
    sts = only(objects, "StatefulSet")
    headless = objects[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False  # only ready pods are members
    assert target.dns_host == f"{headless['metadata']['name']}.ml.svc"
    assert target.dns_port == ports["grpc"]
    assert [p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc"] == [ports["grpc"]]


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_pods_are_least_privilege_and_sized(example):
    values = load_values(example)
    objects = render(values)
    pod, c = daemon_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod.get("hostIPC", False) == values.get("gpu", {}).get("cudaIpc", False)
    gpus = values.get("gpu", {}).get("count", 0)
    assert c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == gpus
    if gpus:
        assert config_of(objects)["device"].startswith("cuda:")
    shm = [v for v in pod["volumes"] if v["name"] == "shm"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    grace_ms = int(config_of(objects)["shutdown_grace_ms"])
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_seconds = int(pre_stop[-1]) if pre_stop[0] == "/bin/sleep" else 10  # drain's timeout
    assert pod["terminationGracePeriodSeconds"] * 1000 > grace_ms + pre_stop_seconds * 1000


def test_tenants_file_by_default_insecure_only_when_asked():
    objects = render({"auth": {"tenantsFile": "tenant { name: \"a\" }"}})
    pod, c = daemon_container(objects)
    assert "--insecure" not in c["args"]
    (tenants_arg,) = [a for a in c["args"] if a.startswith("--tenants_file=")]
    mount = [m for m in c["volumeMounts"] if m["name"] == "tenants"][0]
    assert tenants_arg == f"--tenants_file={mount['mountPath']}/tenants.txtpb"
    secret = [v for v in pod["volumes"] if v["name"] == "tenants"][0]["secret"]["secretName"]
    assert ("Secret", secret) in objects

    insecure = render({"auth": {"insecure": True}})
    _, c = daemon_container(insecure)
    assert "--insecure" in c["args"]
    assert not [a for a in c["args"] if a.startswith("--tenants_file")]
    assert not [k for k in insecure if k[0] == "Secret"]


@pytest.mark.parametrize("values, message", [
    ({"auth": {"insecure": True, "existingSecret": "x"}}, "auth.insecure"),
    ({"terminationGracePeriodSeconds": 10}, "terminationGracePeriodSeconds"),
    ({"gpu": {"count": 1}}, "cuda"),
    ({"tls": {"enabled": True}}, "tls.secretName"),
])
def test_inconsistent_values_are_refused(values, message):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert message in str(e.value)


def pre_stop_of(container):
    return container["lifecycle"]["preStop"]["exec"]["command"]


def test_pre_stop_drains_with_the_admin_token_else_sleeps():
    tenants = {"auth": {"tenantsFile": "tenant { name: \"a\" }"}}
    # No admin token: the hook sleeps; SIGTERM then begins the drain.
    _, c = daemon_container(render(tenants))
    assert pre_stop_of(c) == ["/bin/sleep", "5"]
    # With one: `kvpool drain` on the pod's own gRPC port, the token from its Secret.
    objects = render({**tenants, "drain": {"adminTokenSecret": "ops-token"}})
    pod, c = daemon_container(objects)
    command = pre_stop_of(c)
    assert command[0] == "/usr/local/bin/kvpool" and command[-1] == "drain"
    assert "--target=127.0.0.1:50051" in command
    mount = [m for m in c["volumeMounts"] if m["name"] == "admin-token"][0]
    assert f"--token_file={mount['mountPath']}/token" in command
    assert [v for v in pod["volumes"] if v["name"] == "admin-token"][0]["secret"] == {
        "secretName": "ops-token"}
    # Insecure: every caller is the default tenant, an admin; no token.
    _, c = daemon_container(render({"auth": {"insecure": True}}))
    command = pre_stop_of(c)
    assert command[-1] == "drain" and not [a for a in command if a.startswith("--token_file")]


def tls_values():
    return {"auth": {"tenantsFile": "tenant { name: \"a\" }"},
            "tls": {"enabled": True, "secretName": "kvpool-tls"},
            "drain": {"adminTokenSecret": "ops-token"}}


def test_tls_mounts_its_secret_and_probes_stay_plaintext():
    objects = render(tls_values(), namespace="ml")
    pod, c = daemon_container(objects)
    mount = [m for m in c["volumeMounts"] if m["name"] == "tls"][0]["mountPath"]
    assert f"--tls_cert={mount}/tls.crt" in c["args"]
    assert f"--tls_key={mount}/tls.key" in c["args"]
    assert [v for v in pod["volumes"] if v["name"] == "tls"][0]["secret"]["secretName"] == \
        "kvpool-tls"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["health"], probe
    command = pre_stop_of(c)
    assert f"--tls_ca={mount}/ca.crt" in command
    assert "--tls_server_name=kvpool.ml.svc" in command
    test_pod = [o for o in objects.values() if o["metadata"].get("annotations", {}).get(
        "helm.sh/hook") == "test"][0]
    assert f"--tls_ca={mount}/ca.crt" in test_pod["spec"]["containers"][0]["args"]


def find_cli():
    from kvpool.local_daemon import find_kvpoold
    cli = os.environ.get("KVPOOL_CLI") or os.path.join(os.path.dirname(find_kvpoold()), "kvpool")
    if not os.access(cli, os.X_OK):
        pytest.skip(f"no kvpool CLI at {cli} (set KVPOOL_CLI)")
    return cli


def test_tls_pod_runs_its_probes_and_pre_stop_drain_against_a_real_kvpoold():
    """The rendered pod on this machine: kvpoold from the ConfigMap and the container's TLS
    args (files of the Secret replaced by test certificates), the probes' plaintext health port
    answering without credentials, then the preStop command draining the daemon with the admin
    token, after which it exits with status 0."""
    from kvpool import Client, ClientOptions
    from kvpool.local_daemon import LocalDaemon, find_kvpoold
    from kvpool.options import TlsOptions
    script = os.path.join(HERE, "..", "..", "tests", "integration", "make_test_certs.sh")
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    cli = find_cli()
    objects = render(tls_values(), namespace="ml")
    _, c = daemon_container(objects)
    config = config_of(objects)
    token = "chart-admin-token-577215"
    with tempfile.TemporaryDirectory() as tmp:
        certs = os.path.join(tmp, "certs")
        subprocess.run([script, certs], check=True, capture_output=True)
        files = {"/etc/kvpool/tls/tls.crt": f"{certs}/server.pem",
                 "/etc/kvpool/tls/tls.key": f"{certs}/server.key",
                 "/etc/kvpool/tls/ca.crt": f"{certs}/ca.pem",
                 "/etc/kvpool/admin/token": f"{tmp}/token"}

        def local(arg):
            for path, here in files.items():
                arg = arg.replace(path, here)
            return arg

        with open(f"{tmp}/token", "w") as f:
            f.write(token + "\n")
        with open(f"{tmp}/tenants.txtpb", "w") as f:
            f.write(f'tenant {{ name: "ops" role: ROLE_ADMIN '
                    f'token_sha256: "{hashlib.sha256(token.encode()).hexdigest()}" }}\n')
        with open(f"{tmp}/kvpoold.conf", "w") as f:
            f.writelines(f"{k} = {v}\n" for k, v in config.items())
        tls_args = [local(a) for a in c["args"] if a.startswith("--tls_")]
        assert len(tls_args) == 2
        with open(f"{certs}/ca.pem", "rb") as f:
            ca = f.read()
        daemon = LocalDaemon(find_kvpoold(), [
            f"--config={tmp}/kvpoold.conf", *tls_args, f"--tenants_file={tmp}/tenants.txtpb",
            "--metrics_listen=127.0.0.1:0", "--ucx_listen=127.0.0.1:0", "--transports=",
            "--health_listen=127.0.0.1:0", f"--health_port_file={tmp}/health.port",
            "--device=cpu", "--pool_bytes=67108864", "--worker_threads=2"],
            client_options=ClientOptions(tls=TlsOptions(root_certificates=ca), token=token))
        try:
            daemon.start()
            with open(f"{tmp}/health.port") as f:
                health_port = int(f.read())
            with Client(f"127.0.0.1:{health_port}") as probe:
                assert probe.health() == "SERVING"
            # The preStop hook, as rendered, on the daemon's port (127.0.0.1 in the pod).
            command = [local(a) for a in pre_stop_of(c)]
            command[0] = cli
            command = [f"--target={daemon.target}" if a.startswith("--target=") else a
                       for a in command]
            command = ["--tls_server_name=localhost" if a.startswith("--tls_server_name=")
                       else a for a in command]
            run = subprocess.run(command, capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr
            assert "DRAINING" in run.stdout
            assert daemon.process.wait(timeout=120) == 0
        finally:
            daemon.cleanup()


@pytest.mark.parametrize("values", [
    {"replicas": 0},
    {"no_such_key": 1},
    {"daemon": {"device": "tpu", "shutdown_grace_ms": 1}},
    {"daemon": {"device": "cpu", "shutdown_grace_ms": 1, "listen": "0.0.0.0:1"}},
    {"ports": {"grpc": 70000, "ucx": 1, "metrics": 2, "health": 3}},
    {"drain": {"adminTokenSecret": "x", "adminTokenKey": ""}},
])
def test_schema_refuses_bad_values(values):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError):
        chart.validate_schema(values)


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_kvpoold_accepts_the_rendered_config(example):
    """Every flag in the ConfigMap is one kvpoold accepts: the daemon starts from the rendered
    file and serves. Overridden on the command line for this machine: the addresses (loopback),
    the device (no GPU here) and the pool size."""
    from kvpool.local_daemon import LocalDaemon, find_kvpoold
    config = config_of(render(load_values(example)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kvpoold.conf")
        with open(path, "w") as f:
            f.writelines(f"{k} = {v}\n" for k, v in config.items())
        daemon = LocalDaemon(find_kvpoold(), [
            f"--config={path}", "--metrics_listen=127.0.0.1:0", "--ucx_listen=127.0.0.1:0",
            "--health_listen=127.0.0.1:0",
            "--device=cpu", "--pool_bytes=67108864", "--worker_threads=2",
            "--ucx_tls=tcp", "--ucx_net_devices=lo"])
        try:
            daemon.start()  # waits for grpc.health.v1 SERVING
            with daemon_client(daemon) as client:
                stats = client.get_stats()
                assert stats.service.backend == "cpu"
                assert stats.limits.max_connections == int(config.get("max_connections",
                                                                      stats.limits.max_connections))
            daemon.stop()
        finally:
            daemon.cleanup()


def daemon_client(daemon):
    from kvpool import Client
    return Client(daemon.target)


def test_a_bad_flag_in_the_config_is_refused():
    """The check above has teeth: kvpoold refuses a config file with an unknown flag."""
    from kvpool.local_daemon import find_kvpoold
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kvpoold.conf")
        with open(path, "w") as f:
            f.write("listen = 127.0.0.1:0\nno_such_flag = 1\n")
        run = subprocess.run([find_kvpoold(), f"--config={path}"], capture_output=True,
                             text=True, timeout=120)
    assert run.returncode == 2 and "no_such_flag" in run.stderr
