"""The method-spelling table: what a runtime does with each spelling of a CRI image method
when called directly, and what the shim in front of it does (tests/e2e/test_routing_e2e.py
for containerd 1.6, containerd 2.x and CRI-O, its ``crio`` cases).

For RemoveImage of a pinned image and PullImage each row asks the runtime itself first
(does it route the spelling to the method?), then the shim, and asserts:

- RemoveImage: through the shim the pinned image is never removed, whatever the spelling;
  a spelling the runtime routes is refused as the canonical one is (FAILED_PRECONDITION),
  runtime.v1alpha2 as containerd 2.x refuses it (UNIMPLEMENTED), a service that is not
  CRI with PERMISSION_DENIED;
- PullImage: a runtime.v1 spelling goes through the shim's pull scheduler (counted in
  ``cri_shim_pull_requests_total``) and gets the runtime's own answer for that spelling;
  a spelling the shim refuses never reaches the runtime.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tests.support import cri
from tests.support.image_fleet import metric
from tests.support.oci import PushedImage
from tests.support.prom import free_port

SPELLINGS: dict[str, str] = {
    "canonical": "/runtime.v1.ImageService/{}",
    "no-leading-slash": "runtime.v1.ImageService/{}",
    "v1alpha2": "/runtime.v1alpha2.ImageService/{}",
    "v1alpha2-no-leading-slash": "runtime.v1alpha2.ImageService/{}",
    "double-slash": "//runtime.v1.ImageService/{}",
}
# spellings the shim answers itself, whatever the runtime does with them
SHIM_REFUSES = {"v1alpha2": grpc.StatusCode.UNIMPLEMENTED,  # as containerd 2.x: "unknown service ..."
                "v1alpha2-no-leading-slash": grpc.StatusCode.UNIMPLEMENTED,
                "double-slash": grpc.StatusCode.PERMISSION_DENIED}  # service "/runtime.v1.ImageService": not CRI


@dataclass(frozen=True)
class Row:
    spelling: str
    runtime_routes: bool  # the runtime called directly runs the method for this spelling
    direct: str  # the runtime's answer to the spelling (code name)
    via_shim: str  # the shim's answer to the same call (code name)

    def __str__(self) -> str:
        return f"{self.spelling:28} runtime routes: {str(self.runtime_routes):5}  direct {self.direct:20} shim {self.via_shim}"


def present(runtime: str | os.PathLike[str], img: PushedImage) -> bool:
    res = cri.call(runtime, "ImageStatus", cri.image_status_request(img.ref), 10)
    return cri.decode_image_status_response(res.unwrap()) is not None


def pull(socket: str | os.PathLike[str], img: PushedImage, spelling: str = "canonical") -> cri.CallResult:
    return cri.call(socket, SPELLINGS[spelling].format("PullImage"), cri.pull_image_request(img.ref), 60)


def remove_row(runtime: str | os.PathLike[str], shim: str | os.PathLike[str], pinned: PushedImage,
               victim: PushedImage, spelling: str) -> Row:
    """``pinned`` is pinned in the shim; ``victim`` is pulled for the runtime to remove directly."""
    path = SPELLINGS[spelling].format("RemoveImage")
    assert pull(runtime, victim).ok
    direct = cri.call(runtime, path, cri.remove_image_request(victim.ref), 10)
    routes = direct.ok and not present(runtime, victim)
    via = cri.call(shim, path, cri.remove_image_request(pinned.ref), 10)
    row = Row(spelling, routes, direct.code.name, via.code.name)
    assert present(runtime, pinned), f"pinned image removed through the shim: {row}"
    if spelling in SHIM_REFUSES:
        assert via.code is SHIM_REFUSES[spelling], row
    elif routes:
        assert via.code is grpc.StatusCode.FAILED_PRECONDITION and "is pinned by" in (via.details or ""), row
    else:  # the runtime refuses the spelling: the shim refuses too (on the pin, or as the runtime does)
        assert not direct.ok and via.code in (grpc.StatusCode.FAILED_PRECONDITION, direct.code), row
    return row


def pull_requests(metrics_port: int) -> float:
    return sum(metric(metrics_port, "cri_shim_pull_requests_total", {"priority": p}) or 0.0
               for p in ("foreground", "background"))


def pull_row(runtime: str | os.PathLike[str], shim: str | os.PathLike[str], metrics_port: int,
             img: PushedImage, spelling: str) -> Row:
    """``img`` is not in the runtime when the row starts."""
    direct = pull(runtime, img, spelling)
    routes = direct.ok
    if routes:
        assert cri.call(runtime, "RemoveImage", cri.remove_image_request(img.ref), 10).ok
    before = pull_requests(metrics_port)
    via = pull(shim, img, spelling)
    counted = pull_requests(metrics_port) - before
    row = Row(spelling, routes, direct.code.name, via.code.name)
    if spelling in SHIM_REFUSES:
        assert via.code is SHIM_REFUSES[spelling] and counted == 0 and not present(runtime, img), row
    else:
        assert counted == 1, f"the pull bypassed the shim's scheduler: {row}"
        assert via.code == direct.code, row  # the runtime's own answer to this spelling
    return row


def remove_pinned_table(runtime: str, shim_factory: Callable[..., Any], make_image: Callable[..., PushedImage],
                        engine: str) -> list[Row]:
    """Every row of RemoveImage of a pinned image, through a shim with ``engine`` in front of ``runtime``."""
    pinned = make_image()
    assert pull(runtime, pinned).ok
    shim = shim_factory({"server": {"admin_socket": "", "engine": engine}, "pins": {"images": [pinned.ref]}},
                        upstream=runtime)
    rows = [remove_row(runtime, shim.socket, pinned, make_image(), s) for s in SPELLINGS]
    print(f"\nRemoveImage of a pinned image, {engine}:\n" + "\n".join(map(str, rows)))
    assert rows[0].runtime_routes  # the canonical spelling works directly
    return rows


def pull_table(runtime: str, shim_factory: Callable[..., Any], make_image: Callable[..., PushedImage],
               engine: str) -> list[Row]:
    """Every row of PullImage, through a shim with ``engine`` in front of ``runtime``."""
    port = free_port()
    shim = shim_factory({"server": {"admin_socket": "", "engine": engine},
                         "metrics": {"address": f"127.0.0.1:{port}"}}, upstream=runtime)
    rows = [pull_row(runtime, shim.socket, port, make_image(), s) for s in SPELLINGS]
    print(f"\nPullImage, {engine}:\n" + "\n".join(map(str, rows)))
    assert rows[0].runtime_routes
    return rows


def remaining_after_removing_one_tag(runtime: str, shim: str | None, make_image: Callable[..., PushedImage],
                                     registry: Any) -> list[str]:
    """Pull one image under two tags, remove it by the first (through ``shim``, or directly when
    None); the tags the runtime still has for it."""
    first = make_image()
    second = registry.push(first.image, first.repository, "v2")
    assert pull(runtime, first).ok and pull(runtime, second).ok
    assert cri.call(shim or runtime, "RemoveImage", cri.remove_image_request(first.ref), 10).ok
    res = cri.call(runtime, "ImageStatus", cri.image_status_request(second.ref), 10)
    info = cri.decode_image_status_response(res.unwrap())
    return [] if info is None else [t.rpartition(":")[2] for t in info.repo_tags]


def assert_removal_by_tag_as_the_runtime_does(runtime: str, shim_factory: Callable[..., Any],
                                              make_image: Callable[..., PushedImage], registry: Any,
                                              engine: str) -> list[str]:
    """The shim names the image it checked by ID (shim/images/remove_image.py): a removal by one of
    an image's tags must still leave what the runtime itself leaves."""
    direct = remaining_after_removing_one_tag(runtime, None, make_image, registry)
    shim = shim_factory({"server": {"admin_socket": "", "engine": engine},
                         "pins": {"images": ["nothing.invalid/*"]}}, upstream=runtime)  # pins: RemoveImage intercepted
    via = remaining_after_removing_one_tag(runtime, shim.socket, make_image, registry)
    assert via == direct, (direct, via)
    return direct
