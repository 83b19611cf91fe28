"""How many bytes a prefetch will download: the sizes its manifest lists, read from the registry.

Before a prefetch starts (with ``image_sets.gc_threshold_guard`` on), its image's manifest is
read from the registry with the credentials the prefetch would use (the node's: credentials/
prefetch.py; a registry token is asked for as the runtime would: ``WWW-Authenticate: Bearer``).
An index resolves to this node's platform (linux and this machine's architecture); the size is
the config's plus every layer's. Sizes are cached per manifest digest (``SIZE_CACHE`` entries,
least recently used out): a reference by digest costs no request once known, a tag one GET of
its manifest (plus one of the platform's manifest when the tag names an index not seen before).
Each request waits at most ``REQUEST_TIMEOUT_SECONDS``; a manifest larger than
``MAX_MANIFEST_BYTES`` is not read. A size that cannot be read is ``None``: the prefetch is then
judged by the filesystem's usage alone. HTTPS, except for loopback registries
(``localhost``, ``127.0.0.0/8``, ``::1``), which may answer plain HTTP as Docker allows.
Credentials are never logged; errors name the registry and the HTTP status only. The proxy of
the environment (``HTTPS_PROXY``, ``NO_PROXY``) is used as the runtime would. A registry that
cannot be reached (connection refused, no route, a timeout) is not asked again for
``UNREACHABLE_SECONDS``: its images are judged by usage alone meanwhile, so a node whose runtime
reaches registries through mirrors the shim does not know (containerd's ``hosts.toml``, CRI-O's
``registries.conf``) pays one timeout per registry every ``UNREACHABLE_SECONDS``, not one per image.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import platform
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import aiohttp

from ..credentials.keyring import Credential
from ..reference import parse

SIZE_CACHE = 4096  # manifest digest -> bytes
REQUEST_TIMEOUT_SECONDS = 20.0
MAX_MANIFEST_BYTES = 4 << 20
UNREACHABLE_SECONDS = 300.0  # a registry that could not be reached is not asked again for this long
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_ACCEPT = ", ".join((*_INDEX_TYPES, "application/vnd.oci.image.manifest.v1+json",
                     "application/vnd.docker.distribution.manifest.v2+json"))
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le",
         "s390x": "s390x", "riscv64": "riscv64", "armv7l": "arm"}


class SizeUnknown(Exception):
    """The manifest could not be read (the message names the registry and why, no secret)."""


class Unreachable(SizeUnknown):
    """The registry could not be reached at all (no connection, or no answer in time)."""


def node_arch() -> str:
    m = platform.machine().lower()
    return _ARCH.get(m, m)


def manifest_size(doc: dict[str, Any]) -> int:
    """Bytes an image manifest lists: its config and its layers."""
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise SizeUnknown("not an image manifest (no layers)")
    total = 0
    for d in [doc.get("config") or {}, *layers]:
        size = d.get("size") if isinstance(d, dict) else None
        if not isinstance(size, int) or size < 0:
            raise SizeUnknown("a descriptor without a size")
        total += size
    return total


def pick_platform(doc: dict[str, Any], arch: str) -> str:
    """The digest of the index's manifest for linux/``arch``."""
    for m in doc.get("manifests") or []:
        if not isinstance(m, dict):
            continue
        p = m.get("platform") or {}
        if p.get("os") == "linux" and p.get("architecture") == arch and isinstance(m.get("digest"), str):
            return str(m["digest"])
    raise SizeUnknown(f"the index has no manifest for linux/{arch}")


def _loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _challenge(header: str) -> dict[str, str]:
    """The parameters of a ``Bearer realm=...,service=...,scope=...`` challenge."""
    scheme, _, rest = header.partition(" ")
    if scheme.lower() != "bearer":
        return {}
    out: dict[str, str] = {}
    for part in rest.split(","):
        k, eq, v = part.strip().partition("=")
        if eq:
            out[k.strip().lower()] = v.strip().strip('"')
    return out


class ImageSizes:
    """Sizes of images by their manifests, cached per digest."""

    def __init__(self, arch: str | None = None, cache_size: int = SIZE_CACHE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.arch = arch or node_arch()
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cache_size = cache_size
        self._clock = clock
        # registry host -> when it may be asked again (it could not be reached); one entry per
        # registry the declared sets name, expired ones dropped as others are added
        self._unreachable: dict[str, float] = {}
        self.requests = 0  # manifest GETs made (token requests not counted)
        self.errors = 0

    def cached(self, digest: str) -> int | None:
        size = self._cache.get(digest)
        if size is not None:
            self._cache.move_to_end(digest)
        return size

    def _keep(self, digest: str, size: int) -> None:
        self._cache[digest] = size
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def status(self) -> dict[str, int]:
        return {"cached": len(self._cache), "cache_size": self._cache_size, "manifest_requests": self.requests,
                "errors": self.errors, "unreachable_registries": sum(1 for until in self._unreachable.values()
                                                                     if until > self._clock())}

    async def size_of(self, image: str, credentials: Sequence[Credential | None]) -> int:
        """Bytes the manifest of ``image`` lists for this node's platform. Raises SizeUnknown."""
        ref = parse(image).with_default_tag()
        if ref.digest is not None and (known := self.cached(ref.digest)) is not None:
            return known
        now = self._clock()
        if self._unreachable.get(ref.domain, 0.0) > now:
            self.errors += 1
            raise SizeUnknown(f"{ref.domain}: not reached within the last {UNREACHABLE_SECONDS:g} s")
        last: SizeUnknown | None = None
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as session:
            for cred in credentials or [None]:
                try:
                    return await self._resolve(session, ref.domain, ref.path, ref.digest or ref.tag or "latest",
                                               cred)
                except Unreachable as e:  # no other credential helps
                    self._mark_unreachable(ref.domain)
                    last = e
                    break
                except SizeUnknown as e:
                    last = e
                except (aiohttp.ClientConnectionError, TimeoutError) as e:  # the token service: unreachable too
                    self._mark_unreachable(ref.domain)
                    last = SizeUnknown(f"{ref.domain}: {type(e).__name__}")
                    break
                except (aiohttp.ClientError, ValueError) as e:  # never the request's text: no secret
                    last = SizeUnknown(f"{ref.domain}: {type(e).__name__}")
        self.errors += 1
        assert last is not None
        raise last

    def _mark_unreachable(self, domain: str) -> None:
        now = self._clock()
        for host in [h for h, until in self._unreachable.items() if until <= now]:
            del self._unreachable[host]
        self._unreachable[domain] = now + UNREACHABLE_SECONDS

    async def _resolve(self, session: aiohttp.ClientSession, domain: str, repo: str, ref: str,
                       cred: Credential | None) -> int:
        host = "registry-1.docker.io" if domain == "docker.io" else domain
        client = _Registry(session, host, repo, cred)
        body, digest = await client.manifest(ref)
        self.requests += client.gets
        if (known := self.cached(digest)) is not None:
            return known
        doc = _json(body)
        if doc.get("mediaType") in _INDEX_TYPES or "manifests" in doc:
            child = pick_platform(doc, self.arch)
            size = self.cached(child)
            if size is None:
                child_body, _ = await client.manifest(child)
                self.requests += 1
                size = manifest_size(_json(child_body))
                self._keep(child, size)
        else:
            size = manifest_size(doc)
        self._keep(digest, size)
        return size


def _basic(c: Credential) -> str:
    return "Basic " + base64.b64encode(f"{c.username}:{c.password}".encode()).decode()


def _json(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        raise SizeUnknown("the manifest is not JSON") from None
    if not isinstance(doc, dict):
        raise SizeUnknown("the manifest is not a JSON object")
    return doc


class _Registry:
    """GETs of one repository's manifests, with the token dance of the distribution spec."""

    def __init__(self, session: aiohttp.ClientSession, host: str, repo: str, cred: Credential | None) -> None:
        self.session, self.host, self.repo, self.cred = session, host, repo, cred
        self.schemes = ["https", "http"] if _loopback(host) else ["https"]
        self.auth: str | None = None
        if cred is not None and cred.registry_token:
            self.auth = f"Bearer {cred.registry_token}"
        self.gets = 0

    async def manifest(self, ref: str) -> tuple[bytes, str]:
        """(body, digest) of a manifest by tag or digest."""
        last = ""
        for scheme in list(self.schemes):
            url = f"{scheme}://{self.host}/v2/{self.repo}/manifests/{ref}"
            try:
                body, digest = await self._get(url)
            except aiohttp.ClientConnectionError as e:
                last = f"{self.host}: cannot connect ({type(e).__name__})"
                if len(self.schemes) > 1:
                    self.schemes.remove(scheme)  # this registry speaks the other one
                continue
            except TimeoutError:
                raise Unreachable(f"{self.host}: no answer within {REQUEST_TIMEOUT_SECONDS:g} s") from None
            self.schemes = [scheme]
            return body, digest
        raise Unreachable(last or f"{self.host}: unreachable")

    async def _get(self, url: str) -> tuple[bytes, str]:
        for attempt in range(2):
            headers = {"Accept": _ACCEPT, **({"Authorization": self.auth} if self.auth else {})}
            self.gets += 1
            async with self.session.get(url, headers=headers, allow_redirects=True) as resp:
                if resp.status == 401 and attempt == 0:
                    await self._login(resp.headers.get("WWW-Authenticate", ""))
                    continue
                if resp.status != 200:
                    raise SizeUnknown(f"{self.host}: manifest answered HTTP {resp.status}")
                body = await resp.content.read(MAX_MANIFEST_BYTES + 1)
                if len(body) > MAX_MANIFEST_BYTES:
                    raise SizeUnknown(f"{self.host}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
                digest = resp.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(body).hexdigest()
                return body, digest
        raise SizeUnknown(f"{self.host}: manifest answered HTTP 401 with the credentials")

    async def _login(self, header: str) -> None:
        c = self.cred
        if header.lower().startswith("basic"):
            if c is None or not c.username:
                raise SizeUnknown(f"{self.host}: needs credentials")
            self.auth = _basic(c)
            return
        params = _challenge(header)
        realm = params.get("realm")
        if not realm:
            raise SizeUnknown(f"{self.host}: HTTP 401 without a usable challenge")
        query = {k: v for k, v in (("service", params.get("service")),
                                   ("scope", params.get("scope") or f"repository:{self.repo}:pull")) if v}
        headers = {"Authorization": _basic(c)} if c is not None and c.username else {}
        if c is not None and c.identity_token:
            async with self.session.post(realm, data={"grant_type": "refresh_token", "refresh_token": c.identity_token,
                                                      "service": query.get("service", ""), "scope": query["scope"],
                                                      "client_id": "cri-shim"}) as resp:
                await self._token(resp)
            return
        async with self.session.get(realm, params=query, headers=headers) as resp:
            await self._token(resp)

    async def _token(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status != 200:
            raise SizeUnknown(f"{self.host}: token endpoint answered HTTP {resp.status}")
        try:
            doc = json.loads(await resp.content.read(1 << 20))
        except ValueError:
            raise SizeUnknown(f"{self.host}: the token endpoint's answer is not JSON") from None
        token = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token:
            raise SizeUnknown(f"{self.host}: the token endpoint gave no token")
        self.auth = f"Bearer {token}"
