"""Registry credentials the node already has, for the shim's own pulls (image-set prefetch).

``keyring``: kubelet's credential keyring rules (which credentials go with an image);
``dockerconfig``: docker ``config.json`` files, re-read when they change.
Credentials never appear in a log line, span, metric or status: ``Credential``'s repr
holds only where it came from.
"""

from .dockerconfig import DockerConfigFiles
from .keyring import Credential, Keyring

__all__ = ["Credential", "DockerConfigFiles", "Keyring"]
