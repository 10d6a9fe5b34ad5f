"""The daemon's build and API version, the same everywhere it is reported: `kvpoold --version`,
`kvpool --version`, GetStats (BuildInfo) and the kvpool_build_info metric."""

from __future__ import annotations

import os
import re
import subprocess

from kvpool.local_daemon import find_kvpoold

from observed_daemon import ObservedDaemon


def version_of(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_version_flag_and_get_stats_agree():
    kvpoold = find_kvpoold()
    daemon_version = version_of(kvpoold)
    m = re.match(r"^kvpoold (\S+) \(commit (\S+), (\S+), CUDA (on|off)\)\n"
                 r"API (kvpool\.v\d+) revision (\d+)\n$", daemon_version)
    assert m, daemon_version
    version, commit, build_type, cuda, package, revision = m.groups()
    cli = os.path.join(os.path.dirname(kvpoold), "kvpool")
    assert version_of(cli) == daemon_version.replace("kvpoold ", "kvpool ", 1)

    with ObservedDaemon() as d, d.client() as client:
        stats = client.get_stats()
        b = stats.build
        assert b.version == version and stats.service.version == f"kvpoold {version}"
        assert (b.git_commit or "unknown") == commit
        assert b.build_type == build_type and b.cuda == (cuda == "on")
        assert b.api_package == package == "kvpool.v1"
        assert b.api_revision == int(revision) >= 1
        if b.git_commit:
            assert re.match(r"^[0-9a-f]{12}(-dirty)?$", b.git_commit), b.git_commit
        m = d.scrape()
        assert m.value("kvpool_build_info", version=stats.service.version, backend="cpu",
                       git_commit=b.git_commit, build_type=b.build_type,
                       cuda="true" if b.cuda else "false", api=f"{package}.{revision}") == 1
