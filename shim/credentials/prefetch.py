"""The credentials to try, in order, for one of the shim's own pulls (image-set prefetch).

Three sources make one keyring, as kubelet merges its providers: the pull secrets of the
image's cluster sets (first), the node's docker config.json files (``image_sets.docker_config``)
and the CredentialProviderConfig plugins (``image_sets.credential_provider_config``). Matching
entries are tried most specific first; with none, the pull is anonymous. A credential source
that fails never stops prefetch, and its content is never logged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..observability import logs
from .dockerconfig import DockerConfigFiles
from .keyring import Credential, Keyring
from .plugins import PluginProviders, ProviderConfigError

_log = logs.get("imagesets")

SetCredentials = Callable[[frozenset[str]], "list[tuple[str, Credential]]"]  # set names -> their pull secrets' entries


class PrefetchCredentials:
    """Built with its sources (no file is read here); ``load_plugins`` reads the plugin config."""

    def __init__(self, docker_config: DockerConfigFiles, set_credentials: SetCredentials | None = None) -> None:
        self.docker_config = docker_config
        self.set_credentials = set_credentials  # a set's own pull secrets (cluster sets), before the node's
        self.plugins: PluginProviders | None = None

    def load_plugins(self, config_path: str, bin_dir: str) -> None:
        """(Re-)read the CredentialProviderConfig: at start and at every reload. A file that
        turned bad since the config was validated keeps the running providers."""
        if not config_path:
            self.plugins = None
            return
        try:
            self.plugins = PluginProviders.from_files(config_path, bin_dir)
        except ProviderConfigError as e:
            logs.log(_log, logging.ERROR, "credential provider config rejected; keeping the running providers",
                     error=str(e))

    async def for_image(self, image: str, sets: frozenset[str]) -> list[Credential | None]:
        """What to try for ``image`` (declared by ``sets``), in order: matching entries (one
        keyring, most specific key first, as kubelet merges its providers), else anonymous (None)."""
        try:
            entries = self.docker_config.entries()
            if self.set_credentials is not None:
                entries = self.set_credentials(sets) + entries
            if self.plugins is not None:
                entries += await self.plugins.entries(image)
            found: list[Credential | None] = list(Keyring(entries).lookup(image))
        except Exception as e:  # never let a credential file stop prefetch; never log its content
            logs.log(_log, logging.WARNING, "registry credentials unavailable; pulling anonymously",
                     error=type(e).__name__)
            found = []
        return found or [None]

    def status(self) -> dict[str, Any]:
        return {"docker_config": self.docker_config.status(),
                **({"plugins": self.plugins.status()} if self.plugins is not None else {})}
