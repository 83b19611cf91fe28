"""kubelet credential provider plugins (``CredentialProviderConfig``), run as kubelet runs them.

The config file (YAML or JSON, ``apiVersion: kubelet.config.k8s.io/v1``, ``kind:
CredentialProviderConfig``) lists providers: ``name`` (an executable in the bin dir),
``matchImages`` (patterns matched like keyring keys: globbed host parts, port, path
prefix), ``defaultCacheDuration``, ``apiVersion`` (``credentialprovider.kubelet.k8s.io/v1``),
``args`` and ``env``. For an image some provider matches, the plugin is executed with a
``CredentialProviderRequest`` (``{"image": …}``) on stdin and answers a
``CredentialProviderResponse`` on stdout: ``auth`` (registry key -> username/password),
``cacheKeyType`` (``Image``, ``Registry`` or ``Global``) and ``cacheDuration``
(else the provider's ``defaultCacheDuration``; ``0`` means not cached).

Bounds: one run at a time per provider and cache key (concurrent lookups share it), at
most ``TIMEOUT_SECONDS`` per run (then the plugin is killed), at most
``CACHE_ENTRIES`` cached answers per provider. A failing plugin (exit status, bad
JSON, timeout) is logged with its name and the reason, never its output (it may
hold a secret), and the image is pulled with whatever other credentials match.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from .. import reference, safeyaml
from ..observability import logs
from .keyring import Credential, key_of, matches

_log = logs.get("credentials")

CONFIG_VERSIONS = ("kubelet.config.k8s.io/v1", "kubelet.config.k8s.io/v1beta1", "kubelet.config.k8s.io/v1alpha1")
PLUGIN_VERSIONS = ("credentialprovider.kubelet.k8s.io/v1", "credentialprovider.kubelet.k8s.io/v1beta1",
                   "credentialprovider.kubelet.k8s.io/v1alpha1")
TIMEOUT_SECONDS = 60.0
CACHE_ENTRIES = 1000
MAX_OUTPUT_BYTES = 1 << 20
REAP_SECONDS = 5.0  # after a kill: how long its unread output is drained before it is left to the watcher

_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)")
_GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


class ProviderConfigError(ValueError):
    """The CredentialProviderConfig cannot be used; the message names the key."""


def go_duration(value: Any, key: str) -> float:
    """A Go duration string (``12h``, ``1h30m``, ``0``) in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    if not isinstance(value, str) or not value:
        raise ProviderConfigError(f"{key}: expected a duration such as '12h' or '30m', got {logs.shown(value)}")
    if value == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _GO_DURATION.finditer(value):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(value):
        raise ProviderConfigError(f"{key}: expected a duration such as '12h' or '30m', got {logs.shown(value)}")
    return total


@dataclass(frozen=True)
class Provider:
    name: str
    match_images: tuple[str, ...]
    default_cache_seconds: float
    api_version: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def matches(self, image_name: str) -> bool:
        return any(matches(key_of(p), image_name) for p in self.match_images)


def parse_config(text: str, source: str) -> list[Provider]:
    """Providers of a CredentialProviderConfig; raises ProviderConfigError naming the key."""
    try:
        doc = safeyaml.load(text)
    except safeyaml.UnsafeYaml as e:
        raise ProviderConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ProviderConfigError(f"{source}: not valid YAML/JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ProviderConfigError(f"{source}: expected a map")
    if doc.get("kind") != "CredentialProviderConfig" or doc.get("apiVersion") not in CONFIG_VERSIONS:
        raise ProviderConfigError(f"{source}: expected kind CredentialProviderConfig, apiVersion one of "
                                  f"{', '.join(CONFIG_VERSIONS)}")
    items = doc.get("providers")
    if not isinstance(items, list) or not items:
        raise ProviderConfigError(f"{source}: providers: expected a non-empty list")
    out: list[Provider] = []
    names: set[str] = set()
    for i, p in enumerate(items):
        key = f"{source}: providers[{i}]"
        if not isinstance(p, dict):
            raise ProviderConfigError(f"{key}: expected a map")
        name = p.get("name")
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ProviderConfigError(f"{key}.name: expected the file name of a plugin in the bin dir, "
                                      f"got {logs.shown(name)}")
        if name in names:
            raise ProviderConfigError(f"{key}.name: {logs.shown(name)} is listed twice")
        names.add(name)
        match_images = p.get("matchImages")
        if not isinstance(match_images, list) or not match_images or not all(
                isinstance(m, str) and m for m in match_images):
            raise ProviderConfigError(f"{key}.matchImages: expected a non-empty list of image patterns")
        api = p.get("apiVersion")
        if api not in PLUGIN_VERSIONS:
            raise ProviderConfigError(f"{key}.apiVersion: expected one of {', '.join(PLUGIN_VERSIONS)}, "
                                      f"got {logs.shown(api)}")
        args = p.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ProviderConfigError(f"{key}.args: expected a list of strings")
        env: list[tuple[str, str]] = []
        for j, var in enumerate(p.get("env") or []):
            if (not isinstance(var, dict) or not isinstance(var.get("name"), str)
                    or not isinstance(var.get("value"), str)):
                raise ProviderConfigError(f"{key}.env[{j}]: expected {{name: <string>, value: <string>}}")
            env.append((var["name"], var["value"]))
        out.append(Provider(name, tuple(match_images),
                            go_duration(p.get("defaultCacheDuration"), f"{key}.defaultCacheDuration"),
                            api, tuple(args), tuple(env)))
    return out


def load_config(path: str) -> list[Provider]:
    try:
        text = safeyaml.read_capped(path, safeyaml.CONFIG_MAX_BYTES)
    except OSError as e:
        raise ProviderConfigError(f"{path}: cannot read: {e.strerror}") from None
    except (safeyaml.TooBig, UnicodeDecodeError) as e:
        raise ProviderConfigError(f"{path}: cannot read: {e}") from None
    return parse_config(text, path)


@dataclass
class _Cached:
    expires: float
    entries: list[tuple[str, Credential]]


@dataclass
class _ProviderState:
    provider: Provider
    cache: OrderedDict[str, _Cached] = field(default_factory=OrderedDict)
    running: dict[str, asyncio.Task[tuple[str, _Cached | None]]] = field(default_factory=dict)


class PluginProviders:
    """The providers of one CredentialProviderConfig, their plugins and answer caches."""

    def __init__(self, providers: list[Provider], bin_dir: str, *, timeout: float = TIMEOUT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bin_dir = bin_dir
        self.timeout = timeout
        self._clock = clock
        self._state = [_ProviderState(p) for p in providers]
        self.runs = 0
        self.last_error: dict[str, str] = {}

    @classmethod
    def from_files(cls, config_path: str, bin_dir: str) -> PluginProviders:
        return cls(load_config(config_path), bin_dir)

    async def entries(self, image: str) -> list[tuple[str, Credential]]:
        """Keyring entries every matching provider gives for ``image`` (cached as the plugin says)."""
        try:
            ref = reference.parse(image)
        except reference.InvalidReference:
            return []
        out: list[tuple[str, Credential]] = []
        for st in self._state:
            if st.provider.matches(ref.name):
                out += await self._for(st, image, ref)
        return out

    def _cache_keys(self, image: str, ref: reference.Reference) -> list[str]:
        return [f"image:{image}", f"registry:{ref.domain}", "global"]

    async def _for(self, st: _ProviderState, image: str, ref: reference.Reference) -> list[tuple[str, Credential]]:
        now = self._clock()
        for k in self._cache_keys(image, ref):
            hit = st.cache.get(k)
            if hit is not None:
                if hit.expires > now:
                    st.cache.move_to_end(k)
                    return hit.entries
                del st.cache[k]
        run_key = f"image:{image}"
        task = st.running.get(run_key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._run(st.provider, image, ref),
                                                          name=f"credential-provider {st.provider.name}")
            st.running[run_key] = task
            task.add_done_callback(lambda t: st.running.pop(run_key, None))
        cache_key, cached = await asyncio.shield(task)
        if cached is None:
            return []
        if cached.expires > self._clock():
            st.cache[cache_key] = cached
            st.cache.move_to_end(cache_key)
            while len(st.cache) > CACHE_ENTRIES:
                st.cache.popitem(last=False)
        return cached.entries

    async def _run(self, p: Provider, image: str, ref: reference.Reference) -> tuple[str, _Cached | None]:
        self.runs += 1
        exe = os.path.join(self.bin_dir, p.name)
        request = json.dumps({"apiVersion": p.api_version, "kind": "CredentialProviderRequest", "image": image})
        env = dict(os.environ)
        env.update(p.env)
        try:
            proc = await asyncio.create_subprocess_exec(exe, *p.args, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.DEVNULL, env=env)
        except OSError as e:
            self._failed(p, f"cannot run {exe}: {e.strerror}")
            return "", None
        try:
            async with asyncio.timeout(self.timeout):
                out = await _answer(proc, request.encode())
        except TimeoutError:
            await kill_plugin(proc)
            self._failed(p, f"no answer within {self.timeout:g} s; killed")
            return "", None
        except asyncio.CancelledError:
            await kill_plugin(proc)
            raise
        if out is None:
            self._failed(p, f"answer larger than {MAX_OUTPUT_BYTES} bytes; killed")
            return "", None
        if proc.returncode != 0:
            self._failed(p, f"exited with status {proc.returncode}")
            return "", None
        try:
            return self._parse_response(p, out, image, ref)
        except (ValueError, ProviderConfigError) as e:
            self._failed(p, str(e))
            return "", None

    def _parse_response(self, p: Provider, out: bytes, image: str,
                        ref: reference.Reference) -> tuple[str, _Cached | None]:
        try:
            doc = json.loads(out)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError("answer is not JSON") from None
        if not isinstance(doc, dict) or doc.get("kind") != "CredentialProviderResponse":
            raise ValueError("answer is not a CredentialProviderResponse")
        if doc.get("apiVersion") != p.api_version:
            raise ValueError(f"answer has apiVersion {logs.shown(doc.get('apiVersion'))}, "
                             f"expected {logs.shown(p.api_version)}")
        key_type = doc.get("cacheKeyType")
        cache_key = {"Image": f"image:{image}", "Registry": f"registry:{ref.domain}", "Global": "global"}.get(
            key_type if isinstance(key_type, str) else "")
        if cache_key is None:
            raise ValueError(f"cacheKeyType must be Image, Registry or Global, got {logs.shown(key_type)}")
        duration = (go_duration(doc["cacheDuration"], "cacheDuration") if doc.get("cacheDuration") not in (None, "")
                    else p.default_cache_seconds)
        auth = doc.get("auth") or {}
        if not isinstance(auth, dict):
            raise ValueError("auth: expected a map")
        entries: list[tuple[str, Credential]] = []
        for location, a in auth.items():
            if not isinstance(a, dict) or not isinstance(a.get("username", ""), str) \
                    or not isinstance(a.get("password", ""), str):
                raise ValueError(f"auth[{logs.shown(location)}]: expected {{username, password}} strings")
            entries.append((location, Credential(f"credential provider {p.name} auth[{logs.shown(location)}]",
                                                 a.get("username", ""), a.get("password", ""))))
        self.last_error.pop(p.name, None)
        logs.log(_log, logging.DEBUG, "credential provider answered", provider=p.name, registries=len(entries),
                 cache_seconds=duration, cache_key_type=key_type)
        return cache_key, _Cached(self._clock() + duration, entries)

    def _failed(self, p: Provider, why: str) -> None:
        self.last_error[p.name] = why
        logs.log(_log, logging.WARNING, "credential provider failed; its credentials are not used", provider=p.name,
                 error=why)

    def status(self) -> dict[str, Any]:
        return {st.provider.name: {"match_images": list(st.provider.match_images), "cached": len(st.cache),
                                   **({"last_error": self.last_error[st.provider.name]}
                                      if st.provider.name in self.last_error else {})}
                for st in self._state}


async def _answer(proc: asyncio.subprocess.Process, request: bytes) -> bytes | None:
    """Write the request, read the plugin's stdout as it comes and wait for it to exit. At
    more than MAX_OUTPUT_BYTES the plugin is killed and None returned: at most that much
    (plus one read) is ever held."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(request)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the plugin does not read its request; its answer (or exit status) still counts
    out = bytearray()
    while chunk := await proc.stdout.read(65536):
        out += chunk
        if len(out) > MAX_OUTPUT_BYTES:
            await kill_plugin(proc)
            return None
    await proc.wait()
    return bytes(out)


async def kill_plugin(proc: asyncio.subprocess.Process) -> None:
    """Kill the plugin and reap it. asyncio's wait() returns only once the process has exited
    and its pipes are closed, and a flood's stdout stops being read when the reader's buffer is
    full, so the output left in the pipe is drained (discarded) first. A grandchild that keeps
    the pipe open bounds this at REAP_SECONDS; the child watcher still reaps the plugin."""
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        async with asyncio.timeout(REAP_SECONDS):
            if proc.stdout is not None:
                while await proc.stdout.read(65536):
                    pass
            await proc.wait()
    except TimeoutError:
        logs.log(_log, logging.WARNING, "credential provider killed, but its output pipe is still open "
                 "(a process it started?); not waiting for it", pid=proc.pid)
