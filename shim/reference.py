"""Container image reference parsing and normalization.

Follows the rules of distribution/reference's ``ParseNormalizedNamed`` and
``TagNameOnly`` (what containerd and CRI-O use), written independently:

* A first path component is a registry host if it contains ``.`` or ``:``,
  is ``localhost``, or contains an uppercase letter; otherwise the reference
  is on Docker Hub (``docker.io``). ``index.docker.io`` is an alias of
  ``docker.io``.
* Single-component Docker Hub names get the ``library/`` prefix.
* Repository paths must be lowercase; hosts may have a port. Host names are
  case-insensitive, so the normal form spells the host in lower case
  (``Registry.Example.COM/app`` = ``registry.example.com/app``), except a host
  that only reads as one because of its upper case (``LOCALDOMAIN/x``): lower-cased
  it would read as a Docker Hub path, so it keeps its spelling.
* ``normalize`` adds the ``latest`` tag only when there is neither tag nor
  digest; ``name:tag@digest`` keeps both.
* Image IDs (``sha256:<64 hex>`` or bare ``<64 hex>``) are not references;
  see :func:`is_image_id`.

Deliberate difference from upstream: a host component that is not a valid
host name (e.g. ``my_host.com/x``) is rejected here, where upstream would
silently treat the whole string as a path with an empty domain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .observability.logs import shown

__all__ = [
    "DEFAULT_DOMAIN",
    "DEFAULT_TAG",
    "MAX_LENGTH",
    "Reference",
    "InvalidReference",
    "is_image_id",
    "normalize",
    "normalize_image_id",
    "parse",
    "pull_name",
    "split_domain",
]

DEFAULT_DOMAIN = "docker.io"
LEGACY_DEFAULT_DOMAIN = "index.docker.io"
OFFICIAL_REPO_PREFIX = "library/"
DEFAULT_TAG = "latest"
NAME_TOTAL_LENGTH_MAX = 255  # domain/path, as distribution/reference's NameTotalLengthMax
TAG_MAX_LENGTH = 128

# Grammar (see distribution/reference regexp.go for the reference grammar).
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*", re.ASCII)
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = re.compile(rf"{_HOST}(?::[0-9]+)?", re.ASCII)
_TAG = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{TAG_MAX_LENGTH - 1}}}", re.ASCII)
# Syntactic digest shape; the algorithm and encoding are checked separately.
_DIGEST_SHAPE = re.compile(
    r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}", re.ASCII
)
# Algorithms go-digest registers by default, with their hex lengths.
_DIGEST_HEX_LENGTH = {"sha256": 64, "sha384": 96, "sha512": 128}
# The longest string that can be a valid reference: the longest name as written (the legacy
# Docker Hub host is longer than its normal form), ":tag" and "@<longest digest>". Longer
# input is refused before it is looked at (or logged).
MAX_LENGTH = (NAME_TOTAL_LENGTH_MAX + len(LEGACY_DEFAULT_DOMAIN) - len(DEFAULT_DOMAIN) + 1 + TAG_MAX_LENGTH
              + 1 + max(len(algorithm) + 1 + n for algorithm, n in _DIGEST_HEX_LENGTH.items()))
_HEX64 = re.compile(r"[a-f0-9]{64}", re.ASCII)
_IMAGE_ID = re.compile(r"(?:sha256:)?[a-f0-9]{64}", re.ASCII)


class InvalidReference(ValueError):
    """An image reference is not valid."""


@dataclass(frozen=True, slots=True)
class Reference:
    """A parsed, normalized image reference.

    ``domain`` is the registry host (with port, if any); ``path`` is the
    repository path on it. ``tag`` and ``digest`` are ``None`` when absent.
    """

    domain: str
    path: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """Repository name: ``domain/path``."""
        return f"{self.domain}/{self.path}"

    def tagged(self) -> str | None:
        """``name:tag`` (the form of CRI ``Image.repo_tags``), or None if untagged."""
        return f"{self.name}:{self.tag}" if self.tag is not None else None

    def digested(self) -> str | None:
        """``name@digest`` (the form of CRI ``Image.repo_digests``), or None."""
        return f"{self.name}@{self.digest}" if self.digest is not None else None

    def with_default_tag(self) -> Reference:
        """Copy with tag ``latest`` if there is neither tag nor digest."""
        if self.tag is None and self.digest is None:
            return replace(self, tag=DEFAULT_TAG)
        return self

    def __str__(self) -> str:
        s = self.name
        if self.tag is not None:
            s += f":{self.tag}"
        if self.digest is not None:
            s += f"@{self.digest}"
        return s


def is_image_id(s: str) -> bool:
    """True for an image ID: ``sha256:<64 lowercase hex>`` or bare 64 hex."""
    return _IMAGE_ID.fullmatch(s) is not None


def normalize_image_id(s: str) -> str | None:
    """An image ID in its ``sha256:<hex>`` form, or None if ``s`` is not one.

    containerd reports IDs as ``sha256:<hex>``, CRI-O as the bare 64 hex; both name
    the same image (the digest of its config), so every comparison of IDs goes
    through this form.
    """
    if _IMAGE_ID.fullmatch(s) is None:
        return None
    return s if s.startswith("sha256:") else f"sha256:{s}"


def _host_in_lower_case(domain: str) -> str:
    lower = domain.lower()
    if lower == domain or lower == "localhost" or "." in lower or ":" in lower:
        return lower
    return domain  # upper case is what makes it a host here


def split_domain(ref: str) -> tuple[str, str]:
    """Split off the registry host (lower case); apply Docker Hub defaults.

    The one place the shim decides what is a host: references, pin globs and
    credential lookups all use it. ``ref`` may be a glob (``*.example.com/app:*``).
    """
    first, slash, rest = ref.partition("/")
    if not slash:
        domain, remainder = DEFAULT_DOMAIN, ref
    elif first == LEGACY_DEFAULT_DOMAIN:
        domain, remainder = DEFAULT_DOMAIN, rest
    elif first == "localhost" or "." in first or ":" in first or first.lower() != first:
        domain, remainder = _host_in_lower_case(first), rest
        if domain == LEGACY_DEFAULT_DOMAIN:
            domain = DEFAULT_DOMAIN
    else:
        domain, remainder = DEFAULT_DOMAIN, ref
    if domain == DEFAULT_DOMAIN and "/" not in remainder:
        remainder = OFFICIAL_REPO_PREFIX + remainder
    return domain, remainder


def _check_digest(ref: str, digest: str) -> None:
    if not _DIGEST_SHAPE.fullmatch(digest):
        raise InvalidReference(f"invalid reference {shown(ref)}: malformed digest {shown(digest)}")
    algorithm, _, encoded = digest.partition(":")
    length = _DIGEST_HEX_LENGTH.get(algorithm)
    if length is None:
        raise InvalidReference(
            f"invalid reference {shown(ref)}: unsupported digest algorithm {shown(algorithm)}"
        )
    if len(encoded) != length or encoded.lower() != encoded:
        raise InvalidReference(
            f"invalid reference {shown(ref)}: {algorithm} digest must be "
            f"{length} lowercase hex characters"
        )


def parse(ref: str) -> Reference:
    """Parse ``ref`` into a normalized :class:`Reference` (no default tag added).

    Raises :class:`InvalidReference` for invalid references and for image IDs.
    """
    if not ref:
        raise InvalidReference("invalid reference: empty string")
    if len(ref) > MAX_LENGTH:
        raise InvalidReference(f"invalid reference {shown(ref)}: longer than {MAX_LENGTH} characters")
    if _HEX64.fullmatch(ref):
        raise InvalidReference(
            f"invalid reference {shown(ref)}: a 64-character hex string is an image ID, "
            "not a repository name"
        )
    if is_image_id(ref):
        raise InvalidReference(f"invalid reference {shown(ref)}: this is an image ID, not a name")

    domain, remainder = split_domain(ref)

    remainder, at, digest = remainder.partition("@")
    if at:
        _check_digest(ref, digest)
    # A ':' left in the remainder separates the tag (paths have no ':').
    path, colon, tag = remainder.partition(":")

    if path.lower() != path:
        raise InvalidReference(
            f"invalid reference {shown(ref)}: repository name {shown(path)} must be lowercase"
        )
    if not _DOMAIN.fullmatch(domain):
        raise InvalidReference(f"invalid reference {shown(ref)}: invalid registry host {shown(domain)}")
    if not _PATH.fullmatch(path):
        raise InvalidReference(f"invalid reference {shown(ref)}: invalid repository name {shown(path)}")
    if len(domain) + 1 + len(path) > NAME_TOTAL_LENGTH_MAX:
        raise InvalidReference(
            f"invalid reference {shown(ref)}: repository name longer than {NAME_TOTAL_LENGTH_MAX} characters"
        )
    if colon and not _TAG.fullmatch(tag):
        raise InvalidReference(f"invalid reference {shown(ref)}: invalid tag {shown(tag)}")

    return Reference(
        domain=domain,
        path=path,
        tag=tag if colon else None,
        digest=digest if at else None,
    )


def normalize(ref: str) -> str:
    """Fully qualified form of ``ref``: ``nginx`` -> ``docker.io/library/nginx:latest``.

    An image ID is returned in its ``sha256:<hex>`` form. Raises
    :class:`InvalidReference` for invalid input.
    """
    image_id = normalize_image_id(ref)
    if image_id is not None:
        return image_id
    return str(parse(ref).with_default_tag())


def pull_name(ref: str) -> str:
    """The name pulls of ``ref`` are collapsed under: :func:`normalize`, or ``ref`` as it
    is when it does not parse (the runtime answers such a pull itself).

    ``nginx``, ``docker.io/library/nginx`` and ``Docker.IO/library/nginx:latest``
    are one pull; ``repo:tag@digest`` keeps its tag (the runtime records it).
    """
    try:
        return normalize(ref)
    except InvalidReference:
        return ref
