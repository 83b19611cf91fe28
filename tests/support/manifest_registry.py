"""A registry serving only manifests (and a token endpoint), on 127.0.0.1, plain HTTP.

``ManifestRegistry().start()``; ``add(repo, tag, layer_sizes)`` makes an image manifest, and with
``index=True`` an OCI index listing it for linux/amd64 and linux/arm64 (the other platform's
manifest twice the size). Repositories under ``private/`` answer 401 with a Bearer challenge;
``/token`` gives a token for the basic credentials ``USER``/``PASSWORD`` only. ``gets`` counts
manifest requests by path; ``seen_auth`` keeps the Authorization headers of manifest requests.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
from collections import Counter

USER, PASSWORD = "puller", "s3cret-pw"
TOKEN = "tok-" + "x" * 20
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def _digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


class ManifestRegistry:
    def __init__(self) -> None:
        self.blobs: dict[str, tuple[bytes, str]] = {}  # digest -> (body, media type)
        self.tags: dict[tuple[str, str], str] = {}  # (repo, tag) -> digest
        self.gets: Counter[str] = Counter()
        self.seen_auth: list[str] = []
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def host(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.server_address[1]}"

    def _put(self, doc: dict, media_type: str) -> str:
        body = json.dumps(doc).encode()
        d = _digest(body)
        self.blobs[d] = (body, media_type)
        return d

    def manifest(self, layer_sizes: list[int], config_size: int = 100) -> str:
        layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "size": s,
                   "digest": "sha256:" + hashlib.sha256(f"{i}-{s}-{len(self.blobs)}".encode()).hexdigest()}
                  for i, s in enumerate(layer_sizes)]
        return self._put({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                          "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": config_size,
                                     "digest": "sha256:" + "c" * 64},
                          "layers": layers}, OCI_MANIFEST)

    def add(self, repo: str, tag: str, layer_sizes: list[int], *, index: bool = False) -> str:
        """The reference ``host/repo:tag``; its size is sum(layer_sizes) + 100 (the config)."""
        d = self.manifest(layer_sizes)
        if index:
            other = self.manifest([2 * s for s in layer_sizes])
            d = self._put({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
                {"mediaType": OCI_MANIFEST, "digest": other, "size": 1, "platform": {"os": "linux",
                                                                                   "architecture": "arm64"}},
                {"mediaType": OCI_MANIFEST, "digest": d, "size": 1, "platform": {"os": "linux",
                                                                               "architecture": "amd64"}}]},
                OCI_INDEX)
        self.tags[(repo, tag)] = d
        return f"{self.host}/{repo}:{tag}"

    def digest_of(self, repo: str, tag: str) -> str:
        return self.tags[(repo, tag)]

    def start(self) -> "ManifestRegistry":
        reg = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if path == "/token":
                    want = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                    if self.headers.get("Authorization") != want:
                        return self._send(401)
                    return self._send(200, json.dumps({"token": TOKEN}).encode())
                if not path.startswith("/v2/") or "/manifests/" not in path:
                    return self._send(404)
                repo, _, ref = path[4:].rpartition("/manifests/")
                reg.gets[path] += 1
                reg.seen_auth.append(self.headers.get("Authorization", ""))
                if repo.startswith("private/") and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="http://{reg.host}/token",'
                                                   f'service="test",scope="repository:{repo}:pull"'})
                d = ref if ref.startswith("sha256:") else reg.tags.get((repo, ref), "")
                if d not in reg.blobs:
                    return self._send(404)
                body, media_type = reg.blobs[d]
                self._send(200, body, {"Content-Type": media_type, "Docker-Content-Digest": d})

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
