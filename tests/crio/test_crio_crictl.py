"""crictl against the shim in front of CRI-O gives what it gives against CRI-O.

Each command runs against CRI-O and against the shim and the outputs are compared,
with the time and pid crictl puts in front of its log lines and ImageFsInfo's
timestamp normalized. Then with a pin: ``crictl images --pinned`` shows it, and
``crictl rmi`` by tag and by the short ID ``crictl images`` prints is refused.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tests.support.crictl import Crictl
from tests.support.crio import Crio
from tests.support.fixtures import ShimFactory
from tests.support.shim import ShimProcess

pytestmark = pytest.mark.crio

_KLOG_PREFIX = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ", re.M)
_LOGRUS_TIME = re.compile(r'time="[^"]*"')
_FS_TIMESTAMP = re.compile(r'("timestamp": )"\d+"')


def normalized(text: str) -> str:
    text = _KLOG_PREFIX.sub(r"\1<time> <pid> ", text)
    text = _LOGRUS_TIME.sub('time="<time>"', text)
    return _FS_TIMESTAMP.sub(r'\1"<time>"', text)


@pytest.fixture(scope="module")
def shim(crio: Crio, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    factory = ShimFactory(lambda: str(crio.socket), tmp_path_factory.mktemp("crio-crictl-shim"))
    try:
        yield factory({"server": {"admin_socket": ""}})
    finally:
        problems = factory.close()
    assert not problems, problems


@pytest.fixture
def both(crictl: Crictl, crictl_factory: Callable[..., Crictl], shim: ShimProcess) -> Callable[..., tuple]:
    via_shim = crictl_factory(shim.socket)

    def run(*args: str) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
        direct, shimmed = crictl.run(*args), via_shim.run(*args)
        assert shimmed.returncode == direct.returncode, (args, direct, shimmed)
        assert normalized(shimmed.stdout) == normalized(direct.stdout), args
        assert normalized(shimmed.stderr) == normalized(direct.stderr), args
        return direct, shimmed

    return run


def test_pull_images_inspecti_rmi(both, crictl: Crictl, crictl_factory, shim: ShimProcess, make_image) -> None:
    img = make_image()
    bare_id = img.image_id.removeprefix("sha256:")
    via_shim = crictl_factory(shim.socket)
    pulled = via_shim.pull(img.ref)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout == f"Image is up to date for {img.digest_ref}\n"  # containerd: the image ID
    both("pull", img.ref)

    direct, _ = both("version")
    assert "RuntimeName:  cri-o" in direct.stdout
    for args in (("images", img.ref), ("images", "-q", img.ref), ("images", "--digests", img.ref),
                 ("images", "-v", img.ref), ("images", "-o", "json", img.ref)):
        direct, _ = both(*args)
        assert bare_id[:13] in direct.stdout, args
    for ref in (img.ref, img.digest_ref, bare_id, bare_id[:13]):
        direct, _ = both("inspecti", ref)
        assert json.loads(direct.stdout)["status"]["id"] == bare_id
    both("imagefsinfo")

    removed = via_shim.rmi(img.ref)
    assert removed.returncode == 0 and removed.stdout == f"Deleted: {img.ref}\n", removed
    direct, _ = both("inspecti", img.ref)
    assert direct.returncode == 1 and f'no such image \\"{img.ref}\\" present' in direct.stderr
    direct, _ = both("rmi", img.ref)
    assert direct.returncode == 1 and f"no such image {img.ref}" in direct.stderr


def test_errors(both, registry) -> None:
    for args in (("pull", f"{registry.host}/e2e/never-pushed:v1"), ("pull", "garbage!!!"),
                 ("inspecti", f"{registry.host}/e2e/never-pushed:v1"), ("rmi", f"{registry.host}/e2e/never-pushed:v1")):
        both(*args)


def test_pinned_images_and_rmi_refused(crictl: Crictl, crictl_factory, shim_factory, make_image) -> None:
    img, other = make_image(), make_image()
    shim = shim_factory({"server": {"admin_socket": ""}, "pins": {"images": [f"{img.repo_ref}:*"]}})
    via_shim = crictl_factory(shim.socket)
    for i in (img, other):
        assert via_shim.pull(i.ref).returncode == 0

    def pinned(c: Crictl) -> dict[str, bool]:
        out = c.images("--pinned", "-o", "json")
        assert out.returncode == 0, out.stderr
        return {i["id"]: bool(i.get("pinned")) for i in json.loads(out.stdout)["images"]}

    img_id, other_id = (i.image_id.removeprefix("sha256:") for i in (img, other))
    assert (pinned(via_shim)[img_id], pinned(via_shim)[other_id]) == (True, False)
    assert pinned(crictl)[img_id] is False

    for name in (img.ref, img_id[:13]):  # the short ID is what `crictl images` shows
        out = via_shim.rmi(name)
        assert out.returncode != 0 and "FailedPrecondition" in out.stderr and "is pinned by" in out.stderr, out
    assert crictl.inspecti(img.ref).returncode == 0

    out = via_shim.rmi(other.ref)
    assert out.returncode == 0, out.stderr
    assert crictl.inspecti(other.ref).returncode != 0
