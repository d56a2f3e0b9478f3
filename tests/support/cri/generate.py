"""Regenerate cri_v1_pb2.py and cri_v1_pb2_grpc.py beside this file from cri_v1.proto.

Run from the repository root: `python -m tests.support.cri.generate` (needs grpcio-tools; the
generated modules are committed, so only changing the .proto needs it). The proto's path is rooted
at the repository so the grpc module imports `tests.support.cri.cri_v1_pb2`.
"""
from __future__ import annotations

import pathlib
import sys


def main() -> int:
    from grpc_tools import protoc

    here = pathlib.Path(__file__).resolve().parent
    repo = here.parents[2]
    proto = str((here / "cri_v1.proto").relative_to(repo))
    rc = protoc.main(["protoc", f"-I{repo}", f"--python_out={repo}", f"--grpc_python_out={repo}", proto])
    if rc != 0:
        print("protoc failed", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
