"""Fabricating small OCI images and pushing them to a registry.

Nothing here touches the network except :class:`RegistryClient`, which speaks
the distribution (registry v2) HTTP API with the stdlib only.

Typical use::

    layer = make_layer({"hello.txt": b"hi"})
    img = make_image([layer], unique="abc")
    client = RegistryClient("127.0.0.1:5000")
    pushed = client.push(img, "test/hello", "v1")
    pushed.manifest_digest, pushed.image_id

Many images sharing one layer (distinct configs) push fast with
:meth:`RegistryClient.push_many`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import gzip
import hashlib
import http.client
import io
import json
import os
import tarfile
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"

#: Label put in every fabricated config; its value makes the image unique.
UNIQUE_LABEL = "io.cri-shim.test.unique"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Blob:
    """A content-addressed blob with its media type."""

    media_type: str
    data: bytes = field(repr=False)
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", sha256_digest(self.data))

    @property
    def size(self) -> int:
        return len(self.data)

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Layer:
    blob: Blob
    diff_id: str  # digest of the uncompressed tar


@dataclass(frozen=True)
class OciImage:
    """A fabricated single-platform image: layers, config, manifest."""

    layers: tuple[Layer, ...]
    config: Blob
    manifest: Blob

    @property
    def manifest_digest(self) -> str:
        return self.manifest.digest

    @property
    def config_digest(self) -> str:
        """The CRI image id (containerd reports the config digest)."""
        return self.config.digest

    image_id = config_digest

    @property
    def blobs(self) -> tuple[Blob, ...]:
        """Blobs to upload before the manifest (layers first, config last)."""
        return tuple(layer.blob for layer in self.layers) + (self.config,)

    @property
    def size(self) -> int:
        """Sum of config and layer sizes (what CRI reports as image size)."""
        return self.config.size + sum(layer.blob.size for layer in self.layers)


def make_layer(
    files: Mapping[str, bytes], *, compress: bool = True, mode: int = 0o644
) -> Layer:
    """Build a reproducible tar layer holding ``files`` (path -> content)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for path in sorted(files):
            rel = path.lstrip("/")
            parts = rel.split("/")[:-1]
            for i in range(len(parts)):
                d = "/".join(parts[: i + 1])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(info)
            data = files[path]
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    diff_id = sha256_digest(raw)
    if compress:
        return Layer(Blob(MEDIA_OCI_LAYER_GZIP, gzip.compress(raw, compresslevel=1, mtime=0)), diff_id)
    return Layer(Blob(MEDIA_OCI_LAYER, raw), diff_id)


def make_image(
    layers: Sequence[Layer] | None = None,
    *,
    unique: str | None = None,
    filler_bytes: int = 0,
    labels: Mapping[str, str] | None = None,
    architecture: str = "amd64",
    os_name: str = "linux",
    annotations: Mapping[str, str] | None = None,
) -> OciImage:
    """Fabricate an image.

    Without ``layers``, one gzip layer is made holding ``/unique.txt`` (whose
    content is ``unique``) and, if ``filler_bytes`` > 0, ``/filler.bin`` of
    that many incompressible random bytes (to make pulls slow under a
    throttle).  The config always carries ``unique`` as label
    :data:`UNIQUE_LABEL`, so images sharing layers still differ.
    """
    unique = unique if unique is not None else uuid.uuid4().hex
    if layers is None:
        files = {"unique.txt": unique.encode()}
        if filler_bytes:
            files["filler.bin"] = os.urandom(filler_bytes)
        layers = [make_layer(files)]
    all_labels = {UNIQUE_LABEL: unique, **(labels or {})}
    config_doc = {
        "created": "2024-01-01T00:00:00Z",
        "architecture": architecture,
        "os": os_name,
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Cmd": ["/bin/true"],
            "Labels": all_labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": "2024-01-01T00:00:00Z", "created_by": "cri-shim test harness"}],
    }
    config = Blob(MEDIA_OCI_CONFIG, _canonical_json(config_doc))
    manifest_doc: dict[str, object] = {
        "schemaVersion": 2,
        "mediaType": MEDIA_OCI_MANIFEST,
        "config": config.descriptor(),
        "layers": [layer.blob.descriptor() for layer in layers],
    }
    if annotations:
        manifest_doc["annotations"] = dict(annotations)
    manifest = Blob(MEDIA_OCI_MANIFEST, _canonical_json(manifest_doc))
    return OciImage(tuple(layers), config, manifest)


def _canonical_json(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def write_oci_layout(image: OciImage, directory: str | os.PathLike[str], tag: str = "latest") -> Path:
    """Write (or add to) an OCI image layout dir usable as ``oci:DIR:TAG`` by skopeo."""
    root = Path(directory)
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    for blob in (*image.blobs, image.manifest):
        path = blobs / blob.digest.split(":", 1)[1]
        if not path.exists():
            path.write_bytes(blob.data)
    index_path = root / "index.json"
    index = (
        json.loads(index_path.read_text())
        if index_path.exists()
        else {"schemaVersion": 2, "mediaType": MEDIA_OCI_INDEX, "manifests": []}
    )
    ref_key = "org.opencontainers.image.ref.name"
    index["manifests"] = [m for m in index["manifests"] if m.get("annotations", {}).get(ref_key) != tag]
    desc = image.manifest.descriptor()
    desc["annotations"] = {ref_key: tag}
    index["manifests"].append(desc)
    index_path.write_text(json.dumps(index))
    return root


@dataclass(frozen=True)
class PushedImage:
    """An image present in a registry.

    ``host`` is the address clients should pull from (e.g. the counting
    proxy), which may differ from the registry the image was pushed to.
    """

    host: str
    repository: str
    tag: str
    image: OciImage

    @property
    def ref(self) -> str:
        return f"{self.host}/{self.repository}:{self.tag}"

    @property
    def digest_ref(self) -> str:
        return f"{self.host}/{self.repository}@{self.manifest_digest}"

    @property
    def repo_ref(self) -> str:
        """``host/repository`` without tag or digest (CRI RepoDigests prefix)."""
        return f"{self.host}/{self.repository}"

    @property
    def manifest_digest(self) -> str:
        return self.image.manifest_digest

    @property
    def config_digest(self) -> str:
        return self.image.config_digest

    @property
    def image_id(self) -> str:
        return self.image.config_digest

    def with_host(self, host: str) -> PushedImage:
        return PushedImage(host, self.repository, self.tag, self.image)


class RegistryError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{method} {path} -> {status}: {body[:500]!r}")
        self.status = status
        self.body = body


class RegistryClient:
    """Minimal thread-safe registry v2 client (stdlib only, plain HTTP).

    Each thread keeps its own keep-alive connection.  Blobs known to exist
    in a repository are remembered and not re-checked; a blob already pushed
    to another repository is cross-mounted instead of re-uploaded.
    """

    def __init__(
        self,
        host: str,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.host = host
        self.timeout = timeout
        self._auth: str | None = None
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            self._auth = "Basic " + token
        self._local = threading.local()
        self._lock = threading.Lock()
        self._present: set[tuple[str, str]] = set()  # (repo, digest)
        self._anywhere: dict[str, str] = {}  # digest -> a repo holding it

    # -- low level -----------------------------------------------------

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request on this thread's connection; retried once if the connection dropped."""
        hdrs = dict(headers or {})
        if self._auth and "Authorization" not in hdrs:
            hdrs["Authorization"] = self._auth
        if body is not None or method in ("POST", "PUT", "PATCH"):
            hdrs.setdefault("Content-Length", str(len(body or b"")))
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=body, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
                if resp.will_close:
                    conn.close()
                    self._local.conn = None
                return resp.status, resp.headers, data
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest, BrokenPipeError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def ping(self) -> int:
        """Status of ``GET /v2/`` (200, or 401 when auth is required and missing)."""
        return self.request("GET", "/v2/")[0]

    # -- blobs -----------------------------------------------------------

    def blob_exists(self, repo: str, digest: str) -> bool:
        status, _, body = self.request("HEAD", f"/v2/{repo}/blobs/{digest}")
        if status == 200:
            return True
        if status == 404:
            return False
        raise RegistryError("HEAD", f"/v2/{repo}/blobs/{digest}", status, body)

    def push_blob(self, repo: str, blob: Blob, *, check: bool = True) -> None:
        """Upload ``blob`` unless present (HEAD), cross-mounting when possible."""
        key = (repo, blob.digest)
        with self._lock:
            if key in self._present:
                return
            source = self._anywhere.get(blob.digest)
        if check and self.blob_exists(repo, blob.digest):
            self._mark(repo, blob.digest)
            return
        if source is not None and source != repo:
            path = f"/v2/{repo}/blobs/uploads/?mount={blob.digest}&from={source}"
            status, headers, body = self.request("POST", path, b"")
            if status == 201:
                self._mark(repo, blob.digest)
                return
            if status != 202:
                raise RegistryError("POST", path, status, body)
        else:
            path = f"/v2/{repo}/blobs/uploads/"
            status, headers, body = self.request("POST", path, b"")
            if status != 202:
                raise RegistryError("POST", path, status, body)
        location = headers["Location"]
        if location.startswith("http://") or location.startswith("https://"):
            location = "/" + location.split("/", 3)[3]
        sep = "&" if "?" in location else "?"
        put_path = f"{location}{sep}digest={blob.digest}"
        status, _, body = self.request(
            "PUT", put_path, blob.data, {"Content-Type": "application/octet-stream"}
        )
        if status != 201:
            raise RegistryError("PUT", put_path, status, body)
        self._mark(repo, blob.digest)

    def _mark(self, repo: str, digest: str) -> None:
        with self._lock:
            self._present.add((repo, digest))
            self._anywhere.setdefault(digest, repo)

    # -- manifests ---------------------------------------------------------

    def put_manifest(self, repo: str, ref: str, manifest: Blob) -> str:
        path = f"/v2/{repo}/manifests/{ref}"
        status, headers, body = self.request("PUT", path, manifest.data, {"Content-Type": manifest.media_type})
        if status != 201:
            raise RegistryError("PUT", path, status, body)
        return headers.get("Docker-Content-Digest", manifest.digest)

    def get_manifest(self, repo: str, ref: str) -> tuple[int, bytes]:
        accept = ", ".join([MEDIA_OCI_MANIFEST, MEDIA_OCI_INDEX, MEDIA_DOCKER_MANIFEST])
        status, _, body = self.request("GET", f"/v2/{repo}/manifests/{ref}", headers={"Accept": accept})
        return status, body

    def delete_manifest(self, repo: str, digest: str) -> int:
        """Delete by digest (needs ``storage.delete.enabled``); returns the status."""
        return self.request("DELETE", f"/v2/{repo}/manifests/{digest}")[0]

    # -- whole images --------------------------------------------------------

    def push(
        self,
        image: OciImage,
        repo: str,
        tag: str,
        *,
        pull_host: str | None = None,
        check_config: bool = True,
    ) -> PushedImage:
        """Push ``image`` as ``repo:tag``.  ``pull_host`` defaults to this registry."""
        for layer in image.layers:
            self.push_blob(repo, layer.blob)
        self.push_blob(repo, image.config, check=check_config)
        digest = self.put_manifest(repo, tag, image.manifest)
        if digest != image.manifest_digest:
            raise AssertionError(f"registry digest {digest} != {image.manifest_digest}")
        return PushedImage(pull_host or self.host, repo, tag, image)

    def push_many(
        self,
        items: Iterable[tuple[OciImage, str, str]],
        *,
        workers: int = 8,
        pull_host: str | None = None,
        check_config: bool = False,
    ) -> list[PushedImage]:
        """Push ``(image, repo, tag)`` items concurrently; results keep input order.

        Layers shared between items are uploaded once and cross-mounted
        into the other repositories.  Configs are assumed new
        (``check_config=False`` skips their HEAD).
        """
        items = list(items)
        if not items:
            return []
        # Upload each distinct layer once, serially, so that the concurrent
        # part only needs cheap mounts.
        seen: set[str] = set()
        for image, repo, _tag in items:
            for layer in image.layers:
                if layer.blob.digest not in seen:
                    seen.add(layer.blob.digest)
                    self.push_blob(repo, layer.blob)

        def one(item: tuple[OciImage, str, str]) -> PushedImage:
            image, repo, tag = item
            return self.push(image, repo, tag, pull_host=pull_host, check_config=check_config)

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(one, items))
