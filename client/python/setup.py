"""Build step of the kvpool package: generates the kvpool.v1 protobuf and gRPC stubs.

The .proto files live in the repository's proto/ folder (two levels up), or in the folder named
by $KVPOOL_PROTO_DIR, or, inside an sdist, in proto/ next to this file. The generated modules
(kvpool/v1/*_pb2.py, *_pb2_grpc.py and their .pyi type stubs) are written into the build tree
only; they are never part of the source tree.
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))


def proto_root() -> str:
    candidates = [os.environ.get("KVPOOL_PROTO_DIR", ""),
                  os.path.join(HERE, "proto"),
                  os.path.join(HERE, "..", "..", "proto")]
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "kvpool", "v1", "common.proto")):
            return os.path.abspath(root)
    raise RuntimeError("kvpool: no proto/kvpool/v1/*.proto found (set KVPOOL_PROTO_DIR)")


def generate_stubs(out_dir: str) -> None:
    """protoc (from grpcio-tools) over every kvpool/v1 proto into out_dir/kvpool/v1/."""
    import grpc_tools
    from grpc_tools import protoc

    root = proto_root()
    protos = sorted(glob.glob(os.path.join(root, "kvpool", "v1", "*.proto")))
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"] + protos
    if protoc.main(args) != 0:
        raise RuntimeError("kvpool: protoc failed on " + " ".join(protos))
    init = os.path.join(out_dir, "kvpool", "v1", "__init__.py")
    with open(init, "w") as f:
        f.write('"""kvpool.v1 protobuf messages and gRPC stubs, generated from proto/."""\n')


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        generate_stubs(self.build_lib)


class SdistWithProtos(sdist):
    """An sdist carries the .proto files so that it builds away from the repository."""

    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        dest = os.path.join(base_dir, "proto", "kvpool", "v1")
        os.makedirs(dest, exist_ok=True)
        for path in glob.glob(os.path.join(proto_root(), "kvpool", "v1", "*.proto")):
            shutil.copy(path, dest)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos})
