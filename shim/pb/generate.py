"""Regenerate the *_pb2.py modules beside this file from the .proto files here.

Run from anywhere: `python -m shim.pb.generate` (needs grpcio-tools; the generated modules
are committed, so only changing a .proto needs it). Imports inside the protos are rooted at
the repository (`shim/pb/x.proto`) so the generated modules import each other as `shim.pb`.
"""
from __future__ import annotations

import pathlib
import sys


def main() -> int:
    from grpc_tools import protoc
    import grpc_tools

    here = pathlib.Path(__file__).resolve().parent
    repo = here.parent.parent
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(repo)) for p in here.glob("*.proto"))
    rc = protoc.main(["protoc", f"-I{repo}", f"-I{well_known}", f"--python_out={repo}", *protos])
    if rc != 0:
        print("protoc failed", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
