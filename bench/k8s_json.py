"""JSON decoders on the route source's largest job: 10,000 pods' list pages (20 pages of 500, as the
API stand-in serves them, `--pad` bytes of container env entries each) decoded and turned into
table entries (tsor/routes_k8s.py's pod_entry), in this process, no HTTP.

    .venv/bin/python bench/k8s_json.py [--pods N] [--pad BYTES] [--runs N] [--json F]

  json       the standard library (what the source used before tsor/k8s_fields.py)
  json-nogc  the same with the cyclic GC off while decoding (how much of json's time is the GC)
  orjson     orjson.loads, whole objects like json (if installed)
  simdjson   pysimdjson: parse, then pod_entry reads its lazy proxies directly (if installed)
  msgspec    tsor/k8s_fields.py: msgspec into TypedDicts of the fields the entries read (the source now)

orjson and pysimdjson are not dependencies of quark: install them to compare
(`pip install orjson pysimdjson`); missing ones are skipped.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.routes_k8s import objects   # noqa: E402
from tsor.k8s_fields import Decoder   # noqa: E402
from tsor.routes_k8s import PAGE, pod_entry   # noqa: E402


def pages(pods: int, pad: int) -> list[bytes]:
    items = [json.dumps(o).encode() for kind, o in objects(pods, max(1, pods // 10), pad) if kind == "pods"]
    head = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"}}).encode()
    return [head[:-1] + b', "items": [' + b", ".join(items[i:i + PAGE]) + b"]}" for i in range(0, len(items), PAGE)]


def decoders() -> dict:
    def whole(loads):
        def run(data: list[bytes]) -> int:
            return sum(pod_entry(o, "quark") is not None for page in data for o in loads(page)["items"])
        return run

    def nogc(data: list[bytes]) -> int:
        gc.disable()
        try:
            return whole(json.loads)(data)
        finally:
            gc.enable()
    out = {"json": whole(json.loads), "json-nogc": nogc}
    try:
        import orjson
        out["orjson"] = whole(orjson.loads)
    except ImportError:
        print("orjson is not installed: its row is skipped", file=sys.stderr)
    try:
        import simdjson
        parser = simdjson.Parser()

        def simd(data: list[bytes]) -> int:
            n = 0
            for page in data:
                doc = parser.parse(page)   # proxies must be gone before the parser's next page
                n += sum(pod_entry(o, "quark") is not None for o in doc["items"])
                del doc
            return n
        out["simdjson"] = simd
    except ImportError:
        print("pysimdjson is not installed: its row is skipped", file=sys.stderr)
    dec = Decoder("pods")
    out["msgspec"] = whole(dec.page)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=10_000)
    ap.add_argument("--pad", type=int, default=4000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "k8s_json.json"))
    args = ap.parse_args()
    data = pages(args.pods, args.pad)
    size = sum(map(len, data))
    runs = {name: [] for name in decoders()}
    fns = decoders()
    for _ in range(args.runs):   # interleaved: the machine's noise falls on every decoder alike
        for name, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            assert fn(data) == args.pods
            runs[name].append(time.perf_counter() - t0)
    base = statistics.median(runs["json"])
    print(f"{args.pods} pods, {size / 2**20:.1f} MiB of JSON ({size // args.pods} bytes a pod), "
          f"decoded + pod_entry, median of {args.runs}:")
    for name, ts in runs.items():
        m = statistics.median(ts)
        print(f"  {name:10s} {m:.3f} s ({min(ts):.3f}-{max(ts):.3f})  {base / m:5.1f}x json")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": " ".join(["bench/k8s_json.py"] + sys.argv[1:]), "pods": args.pods,
           "bytes": size, "seconds": runs}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
