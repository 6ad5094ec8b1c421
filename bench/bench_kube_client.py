#!/usr/bin/env python3
"""The DRA driver's API client against lightkube (PyPI `lightkube` + `lightkube-models`), each in a process of
its own that first imports what the driver imports anyway (devinject.dra.driver: gRPC, protobuf, the spec
pipeline): the import time and RSS the client adds, and the RSS after 200 calls (a list of the HGX fixture's
ResourceSlices and a claim read, alternately) against a local HTTPS server. lightkube is not a dependency:
give `--lightkube-python` an interpreter that has it and devinject (`python3 -m venv V && V/bin/pip install
lightkube==1.0.1 lightkube-models==1.37.0.8 -e .`). Prints JSON; asserts nothing."""

from __future__ import annotations

import argparse
import json
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, time
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:"))
import devinject.dra.driver  # what the driver imports anyway
base = rss()
start = time.perf_counter()
if sys.argv[1] == "devinject":
    from devinject.dra import kubeapi
    api = kubeapi.ResourceApi(kubeapi.credentials(sys.argv[2]))
    imported = time.perf_counter() - start
    after_import = rss()
    for i in range(100):
        api.list_resource_slice(field_selector="spec.nodeName=node1")
        api.read_namespaced_resource_claim("c", "ns")
else:
    from lightkube import Client, KubeConfig
    from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
    client = Client(KubeConfig.from_file(sys.argv[2]))
    imported = time.perf_counter() - start
    after_import = rss()
    for i in range(100):
        list(client.list(ResourceSlice, fields={"spec.nodeName": "node1"}))
        client.get(ResourceClaim, "c", namespace="ns")
print(json.dumps({"import_ms": round(imported * 1000, 1), "rss_base_mib": round(base, 1),
                  "rss_import_mib": round(after_import - base, 1), "rss_calls_mib": round(rss() - base, 1)}))
"""


def answers() -> dict[str, bytes]:
    from devinject.discovery.node import Node
    from devinject.dra.slices import DRIVER, offers, resource_slices

    items = resource_slices(DRIVER, "node1", offers(Node(str(REPO / "tests/fixtures/hosts/hgx-h100")), "node1"))
    for number, item in enumerate(items):
        item.update(apiVersion="resource.k8s.io/v1", kind="ResourceSlice")
        item["metadata"].update(resourceVersion=str(number + 1), uid=f"u{number}")
    slices = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList", "metadata": {"resourceVersion": "9"},
              "items": items}
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "c", "namespace": "ns", "uid": "u", "resourceVersion": "3"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": DRIVER, "pool": "node1-nvidia-com-gpu", "device": "gpu-0000-18-00-0"}]}}}}
    return {"/apis/resource.k8s.io/v1/resourceslices": json.dumps(slices).encode(),
            "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c": json.dumps(claim).encode()}


def serve(directory: Path) -> tuple[ThreadingHTTPServer, Path]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(directory / "key"), "-out",
                    str(directory / "crt")], check=True, capture_output=True)
    bodies = answers()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = bodies.get(self.path.split("?")[0], b"{}")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "crt", directory / "key")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    import base64

    config = directory / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{httpd.server_address[1]}",
                                               "certificate-authority-data":
                                                   base64.b64encode((directory / "crt").read_bytes()).decode()}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}))
    return httpd, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightkube-python", help="an interpreter with lightkube and devinject installed")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-kube-client-"))
    try:
        httpd, config = serve(directory)
        clients = [("devinject", sys.executable)]
        if args.lightkube_python:
            clients.append(("lightkube", args.lightkube_python))
        results: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.runs):
            for name, python in clients:
                done = subprocess.run([python, "-c", CHILD, name, str(config)], check=True, capture_output=True,
                                      text=True, timeout=120)
                results.setdefault(name, []).append(json.loads(done.stdout))
        httpd.shutdown()
        summary = {}
        for name, runs in results.items():
            summary[name] = {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in runs[0]}
        print(json.dumps({"median_of": args.runs, **summary}, indent=1))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
