"""Stateful property: whatever name a RemoveImage carries (a tag, an ID in either form, a
shortened ID, a hex string that is also a tag, ``""``, garbage) and whatever other clients
pull or remove meanwhile (between the shim's lookup and its removal too), the pinned image
stays with its pinned name, on containerd's and CRI-O's ways of resolving a name (issue 44).

The runtime below is a model of how each resolves a name, from their sources:
containerd (1.6 to 2.x, ``localResolve``): a digest is an ID; else the name as a reference;
else its short-ID index, where a prefix of the hex digits of one ID (``""`` and
``sha256:<prefix>`` included) is that image and of several an error. CRI-O (v1.34,
``HeuristicallyTryResolvingStringAsIDPrefix`` first): 3 or more hex digits that begin an
ID are that image; else the name; ``""`` is an error; RemoveImage of one tag of an image
with several only untags it. The handler is called as both engines call it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shim import reference
from shim.cri.call import Call
from shim.cri.deadline import NO_DEADLINE, Deadline
from shim.cri.methods import IMAGE_STATUS, REMOVE_IMAGE
from shim.cri.peer import Peer
from shim.errors import RpcError
from shim.images.remove_image import remove_image
from shim.images.service import ImageService
from shim.observability.metrics import Metrics
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.scheduler import PullScheduler

PINNED_TAG = "reg.example/pinned:1"
# tags other images may carry; "aab" looks like a shortened ID (IDs here are made of a and b)
TAGS = ["reg.example/u0:1", "reg.example/u1:1", "reg.example/u2:1", "docker.io/library/aab:latest"]
ID_HEX = st.text("ab", min_size=64, max_size=64)  # two letters: IDs share long prefixes


@dataclass
class Img:
    hex: str
    tags: list[str] = field(default_factory=list)


class Runtime:
    """One runtime's images and its way of resolving a name (see the module's docstring)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.images: list[Img] = []

    def image_id(self, img: Img) -> str:
        return f"sha256:{img.hex}" if self.kind == "containerd" else img.hex

    def by_tag(self, name: str) -> Img | None:
        want = reference.pull_name(name)
        return next((i for i in self.images if want in i.tags), None)

    def resolve(self, name: str) -> tuple[Img | None, str]:
        """The image ``name`` names and how (``id`` or ``tag``); RpcError where the runtime errs."""
        if self.kind == "crio":
            if not name:
                raise RpcError(grpc.StatusCode.UNKNOWN, "no image specified", from_upstream=True)
            if len(name) >= 3 and set(name) <= set("0123456789abcdef"):
                img = next((i for i in self.images if i.hex.startswith(name)), None)
                if img is not None:
                    return img, "id"
            return self.by_tag(name), "tag"
        full = reference.normalize_image_id(name)
        if full is not None:
            return next((i for i in self.images if f"sha256:{i.hex}" == full), None), "id"
        try:
            reference.normalize(name)
        except reference.InvalidReference:
            pass
        else:
            if (img := self.by_tag(name)) is not None:
                return img, "tag"
        prefix = name.removeprefix("sha256:") if name != "sha256:" else name
        found = [i for i in self.images if i.hex.startswith(prefix)]
        if len(found) > 1:
            raise RpcError(grpc.StatusCode.UNKNOWN, f'can not resolve "{name}" locally: ambiguous digest string',
                           from_upstream=True)
        return (found[0] if found else None), "id"

    def status(self, name: str) -> bytes:
        img, _ = self.resolve(name)
        if img is None:
            return b""
        return api_pb2.ImageStatusResponse(image=api_pb2.Image(id=self.image_id(img), repo_tags=img.tags)) \
            .SerializeToString()

    def remove(self, name: str) -> None:
        img, how = self.resolve(name)
        if img is None:
            return
        if self.kind == "crio" and how == "tag" and len(img.tags) > 1:
            img.tags.remove(reference.pull_name(name))
        else:
            self.images.remove(img)


class Upstream:
    """The runtime as the shim's Upstream; ``meanwhile`` runs once, right after the first lookup."""

    def __init__(self, runtime: Runtime, meanwhile) -> None:
        self.runtime, self.meanwhile = runtime, meanwhile
        self.sent: list[tuple[str, str]] = []  # (method, image name)

    async def unary(self, method: str, request: bytes, *, metadata=(), deadline: Deadline = NO_DEADLINE) -> bytes:
        if method == IMAGE_STATUS:
            name = api_pb2.ImageStatusRequest.FromString(request).image.image
            self.sent.append(("ImageStatus", name))
            answer = self.runtime.status(name)
            if self.meanwhile is not None:
                self.meanwhile, meanwhile = None, self.meanwhile
                meanwhile()
            return answer
        assert method == REMOVE_IMAGE, method
        name = api_pb2.RemoveImageRequest.FromString(request).image.image
        self.sent.append(("RemoveImage", name))
        self.runtime.remove(name)
        return b""


async def remove_through_the_shim(runtime: Runtime, name: str, meanwhile) -> tuple[bytes | RpcError, Upstream]:
    upstream = Upstream(runtime, meanwhile)
    svc = ImageService(upstream=upstream, scheduler=PullScheduler(1), events=Metrics(),  # type: ignore[arg-type]
                       pin_patterns=(PINNED_TAG,))
    call = Call(method=REMOVE_IMAGE, metadata=(), deadline=NO_DEADLINE, upstream=upstream,  # type: ignore[arg-type]
                peer=Peer(uid=65534))  # an untrusted client may remove what is not pinned
    request = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=name)).SerializeToString()
    try:
        return await remove_image(svc, request, call), upstream
    except RpcError as e:
        return e, upstream


class RemoveByAnyName(RuleBasedStateMachine):
    runtime: Runtime

    @initialize(kind=st.sampled_from(["containerd", "crio"]), pinned=ID_HEX)
    def start(self, kind: str, pinned: str) -> None:
        self.runtime = Runtime(kind)
        self.pinned = Img(pinned, [PINNED_TAG])
        self.runtime.images.append(self.pinned)

    def free_tag(self, tags: list[str]) -> list[str]:
        taken = {t for i in self.runtime.images for t in i.tags}
        return [t for t in tags if t not in taken]

    @rule(hex_=ID_HEX, tags=st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True),
          at=st.integers(0, 4))
    def another_client_pulls(self, hex_: str, tags: list[str], at: int) -> None:
        """(``at``: where CRI-O's lookup meets it, before or after the pinned image.)"""
        if all(i.hex != hex_ for i in self.runtime.images):
            self.runtime.images.insert(at, Img(hex_, self.free_tag(tags)))

    @rule(data=st.data())
    def another_client_removes_an_unpinned_image(self, data: st.DataObject) -> None:
        others = [i for i in self.runtime.images if i is not self.pinned]
        if others:
            self.runtime.images.remove(data.draw(st.sampled_from(others)))

    def names(self) -> st.SearchStrategy[str]:
        ids = [i.hex for i in self.runtime.images]
        tags = [t for i in self.runtime.images for t in i.tags]
        prefix = st.builds(lambda h, n, full: ("sha256:" if full else "") + h[:n], st.sampled_from(ids),
                           st.integers(0, 6) | st.integers(0, 64), st.booleans())  # mostly short
        return st.one_of(st.just(""), prefix, st.sampled_from(tags + ["aab", "pinned:1", "nothing:here"]),
                         st.text("ab:sha256", max_size=12))

    @rule(data=st.data(), race=st.sampled_from(["none", "checked image removed", "twin pulled", "tag moved"]),
          twin_len=st.integers(0, 64), twin_tail=ID_HEX)
    def remove_through_the_shim(self, data: st.DataObject, race: str, twin_len: int, twin_tail: str) -> None:
        name = data.draw(self.names(), label="name")
        before = {i.hex: list(i.tags) for i in self.runtime.images}

        def meanwhile() -> None:  # another client, between the shim's lookup and its removal
            try:
                checked, _ = self.runtime.resolve(name)
            except RpcError:
                return
            if checked is None or checked is self.pinned:
                return
            if race == "checked image removed":
                self.runtime.images.remove(checked)
            elif race == "twin pulled":  # an image whose ID starts as the checked one's
                twin = checked.hex[:twin_len] + twin_tail[twin_len:]
                if all(i.hex != twin for i in self.runtime.images):
                    self.runtime.images.insert(0, Img(twin, []))
            elif race == "tag moved" and checked.tags:  # a pull re-points the checked image's name
                tag = checked.tags.pop(0)
                self.pinned.tags.append(tag)

        answer, upstream = asyncio.run(remove_through_the_shim(self.runtime, name, meanwhile))

        if not name:  # never looked up, never sent on: answered as a missing image
            assert (answer, upstream.sent) == (b"", [])
        for method, sent in upstream.sent:
            if method == "RemoveImage":  # only ever the ID the shim checked, or (CRI-O) a tag it carried
                checked_name = upstream.sent[0][1]
                assert upstream.sent[0][0] == "ImageStatus" and checked_name == name
                ids = {self.runtime.image_id(Img(h)) for h in before}
                carried = {t for tags in before.values() for t in tags}
                assert sent in ids or (self.runtime.kind == "crio" and reference.pull_name(sent) in carried), \
                    (name, sent)
                assert sent in ids or sent == name

    @invariant()
    def the_pinned_image_stays_with_its_pinned_name(self) -> None:
        assert self.pinned in self.runtime.images and PINNED_TAG in self.pinned.tags


RemoveByAnyName.TestCase.settings = settings(max_examples=150, stateful_step_count=12, deadline=None)
test_remove_by_any_name = RemoveByAnyName.TestCase
