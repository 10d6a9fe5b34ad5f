#!/usr/bin/env python3
"""Fails on any #include edge that breaks kvpool's layer map (docs/architecture.md).

    bottom   common/   proto/ (kvpool/v1/*, proto/*)   kernels/
    middle   dataplane/        (what both ends of the data plane share)
    upper    server/           client/
    top      calibration/   tools (client/demo/, kernels/demo/)   tests/

A part may include its own headers and those of the parts its row allows below. Unit tests and
their helpers beside the code (*_test.cc, *_test_util.*) may also include tests/support/. Some parts must also stay free of
whole libraries: kernels/ has no gRPC, protobuf, UCX or logging; common/ and dataplane/ know no
API messages.

    python3 tests/layering_test.py [REPO_ROOT]

Prints every offending edge (file:line -> header) and exits 1 when there is one.
"""
import os
import re
import subprocess
import sys

# What each part may include besides itself.
ALLOWED = {
    "common": set(),
    "proto": {"common"},
    "kernels": {"common"},
    "dataplane": {"common"},
    "server": {"common", "proto", "kernels", "dataplane"},
    "client": {"common", "proto", "kernels", "dataplane"},
    "calibration": {"common", "kernels"},
    "tools": {"common", "proto", "kernels", "dataplane", "client", "tests"},
    "tests": {"common", "proto", "kernels", "dataplane", "server", "client", "calibration",
              "tests"},
}
# Third-party headers (by their first path component) a part must not include.
FORBIDDEN_LIBRARIES = {
    "common": {"kvpool", "google", "ucp", "uct", "ucs", "spdlog"},
    "kernels": {"grpc", "grpcpp", "kvpool", "google", "ucp", "uct", "ucs", "spdlog", "nccl.h"},
    "dataplane": {"kvpool", "grpc", "grpcpp", "google"},
}
PARTS = {"common", "proto", "kernels", "dataplane", "server", "client", "calibration", "tests"}
TOOLS = ("client/demo/", "kernels/demo/")
INCLUDE = re.compile(r'\s*#\s*include\s+[<"]([^">]+)[">]')
SOURCE = re.compile(r"\.(h|cc|cu|cuh)$")


def part_of_file(path):
    if path.startswith(TOOLS):
        return "tools"
    top = path.split("/", 1)[0]
    return top if top in PARTS else None


def part_of_header(header):
    top = header.split("/", 1)[0]
    if top == "kvpool":  # generated API code: kvpool/v1/*.pb.h
        return "proto"
    return top if top in PARTS else None


def check(root):
    files = subprocess.check_output(["git", "-C", root, "ls-files"], text=True).split()
    problems = []
    for path in files:
        if not SOURCE.search(path):
            continue
        src = part_of_file(path)
        if src is None:
            continue
        is_test = path.endswith(("_test.cc", "_test_util.h", "_test_util.cc"))
        with open(os.path.join(root, path), errors="replace") as f:
            for number, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                header = m.group(1)
                first = header.split("/", 1)[0]
                if first in FORBIDDEN_LIBRARIES.get(src, ()) and not is_test:
                    problems.append(f"{path}:{number} -> {header} ({src}/ must not use {first})")
                    continue
                dst = part_of_header(header)
                if dst is None or dst == src:
                    continue
                if dst in ALLOWED[src]:
                    continue
                if is_test and header.startswith("tests/support/"):
                    continue
                problems.append(f"{path}:{number} -> {header} ({src}/ may not include {dst}/)")
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"layering: {len(problems)} include edge(s) break the layer map")
        return 1
    print("layering: every include edge follows the layer map")
    return 0


if __name__ == "__main__":
    sys.exit(main())
