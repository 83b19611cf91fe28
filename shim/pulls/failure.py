"""A failed pull as the runtime (or the shim) reported it, and its typed reason.

A pull's error message holds the image reference, often several times (containerd: ``failed to
pull and unpack image "REF": failed to resolve reference "REF": ...``; CRI-O: ``initializing source
docker://REF: reading manifest TAG in REPO: ...``), and a reference may hold any digits
(``reg/app@sha256:…401…``). So the reason is never found by searching the message: it comes from

1. the gRPC code: NOT_FOUND (containerd maps its ErrNotFound there: a 404 of the manifest),
   UNAUTHENTICATED / PERMISSION_DENIED;
2. the registry's HTTP status or error, read at the one place each runtime writes it, after the
   reference and URL (which have no whitespace) in that sentence:

   - containerd 1.6/1.7 resolving: ``pulling from host H failed with status code [manifests T]: 403 Forbidden``;
   - containerd 1.6/1.7 token and blob fetches: ``unexpected status: 401 Unauthorized``,
     ``unexpected status code URL: 403 Forbidden``;
   - containerd 2.x: ``unexpected status from HEAD request to URL: 401 Unauthorized`` (a registry
     error body may follow on the next line);
   - containerd, a 401 it cannot answer: ``pull access denied, repository does not exist or may
     require authorization: server message: insufficient_scope: authorization failed`` (2.x also
     ``…: authorization failed: no basic auth credentials``);
   - CRI-O (containers/image): the registry's error after ``reading manifest T in REPO: ``,
     ``reading blob D in REPO: ``, ``fetching blob: `` or ``pinging container registry H: ``, as
     distribution's error code (``denied: …``, or the code's default message alone: ``manifest
     unknown``) or ``StatusCode: 403, "…"``; a 5xx or a refused token request ``received unexpected
     HTTP status: 503 Service Unavailable``; a 401 to the credentials ``unable to retrieve auth
     token: invalid username/password: …``;

3. the errno text the kernel gave a write, at the end of the message (containerd ``…/data: no space
   left on device``; CRI-O ``ApplyLayer stdout:  stderr: write /f: no space left on device exit status 1``);
4. the shim's own errors (``from_runtime`` false): the stall and no-progress guards' UNAVAILABLE
   ``cri-shim: pull of REF stalled: …`` / ``… made no progress for …``.

Anything else is ``other``. 401 and 403 are ``auth``, 404 ``notFound``; 429 and 5xx are ``other``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from ..errors import RpcError
from .poller import STALL_CODE

REASONS = ("auth", "notFound", "noSpace", "stalled", "other")

_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: "notFound",
    grpc.StatusCode.UNAUTHENTICATED: "auth",
    grpc.StatusCode.PERMISSION_DENIED: "auth",
}
_BY_STATUS = {401: "auth", 403: "auth", 404: "notFound"}

# The HTTP status a runtime reports, each anchored on its own wording; REF and URL are \S+.
_HTTP_STATUS = re.compile(
    r"(?:"
    r"pulling from host \S+ failed with (?:unexpected )?status code \[[^\]\s]* ?[^\]\s]*\]"  # containerd 1.6
    r"|unexpected status code \S+"  # containerd 1.6 blob fetch
    r"|unexpected status from [A-Z]+ request to \S+"  # containerd 2.x
    r"|unexpected status"  # containerd 1.6 token fetch
    r"|received unexpected HTTP status"  # containers/image (CRI-O): a 5xx, or a token request refused
    r"): (?P<status>[1-5][0-9][0-9]) [A-Z]"
)
# containerd wraps its ErrInvalidAuthorization (a 401 again after the credentials it had, or none to send) so
_CONTAINERD_DENIED = re.compile(r"pull access denied, repository does not exist or may require authorization: ")
# containers/image (CRI-O): what follows the manifest or blob sentence is the registry's error alone
_CRIO_REGISTRY_ERROR = re.compile(r"(?:reading manifest \S+ in \S+|reading blob \S+ in \S+|fetching blob"
                                  r"|pinging container registry \S+): (?P<error>[^\n]*)")
# a 4xx whose body is not distribution's JSON: StatusCode: 403, "Forbidden\n" (or the parse error's own words)
_CRIO_STATUS = re.compile(r"(?:StatusCode: |error parsing HTTP )(?P<status>[1-5][0-9][0-9])[, ]")
_CRIO_AUTH = re.compile(r"(?:^|: )unable to retrieve auth token: invalid username/password: ")
# distribution's error codes as containers/image prints them: "<code in lower case>: <message>",
# or the code's default message alone
_REGISTRY_CODES = {
    "unauthorized": "auth", "authentication required": "auth",
    "denied": "auth", "requested access to the resource is denied": "auth",
    "manifest unknown": "notFound", "name unknown": "notFound",
    "repository name not known to registry": "notFound", "blob unknown": "notFound",
    "blob unknown to registry": "notFound",
}
# the kernel's words end the message; CRI-O unpacks in a child: "ApplyLayer stdout: … stderr: write /f: no
# space left on device exit status 1"
_ERRNO_NO_SPACE = re.compile(r": (?:no space left on device|disk quota exceeded)(?: exit status [0-9]+)?$")
# progress.py stall_message / no_progress_message
_SHIM_STALL = re.compile(r"cri-shim: pull of \S+ (?:stalled: |made no progress for )")


@dataclass(frozen=True)
class PullFailure:
    """A failed pull: gRPC code and details as the caller got them; ``from_runtime``: the runtime's own."""

    code: grpc.StatusCode
    details: str
    from_runtime: bool = True

    @classmethod
    def of(cls, e: RpcError) -> PullFailure:
        return cls(e.code, e.details, e.from_upstream)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"

    @property
    def reason(self) -> str:
        """One of REASONS."""
        if not self.from_runtime:  # the shim's own: only its stall guards have a reason
            if self.code is STALL_CODE and _SHIM_STALL.match(self.details):
                return "stalled"
            return "other"
        by_code = _BY_CODE.get(self.code)
        if by_code is not None:
            return by_code
        return _from_details(self.details)


def _from_details(details: str) -> str:
    m = _HTTP_STATUS.search(details)
    if m is not None:
        return _BY_STATUS.get(int(m["status"]), "other")
    if _CONTAINERD_DENIED.search(details) or _CRIO_AUTH.search(details):
        return "auth"
    m = _CRIO_REGISTRY_ERROR.search(details)
    if m is not None:
        error = m["error"]
        status = _CRIO_STATUS.match(error)
        if status is not None:
            return _BY_STATUS.get(int(status["status"]), "other")
        code = error.split(": ", 1)[0]
        return _REGISTRY_CODES.get(code, _REGISTRY_CODES.get(error, "other"))
    if _ERRNO_NO_SPACE.search(details):
        return "noSpace"
    return "other"
