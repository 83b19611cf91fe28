"""crictl, the real CRI client, against the shim gives what it gives against the runtime
(containerd 1.6; CRI-O v1.34, the ``crio`` cases).

Every command runs twice, against the runtime and against the shim (default engine),
and the outputs are compared.  Normalized, because they differ by nature and not by
the shim: the time and pid crictl writes in front of its log lines, and the time of
the call that ``imagefsinfo`` reports.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tests.support.crictl import Crictl
from tests.support.fixtures import CRIO, CriRuntime, ShimFactory, runtime_named
from tests.support.shim import ShimProcess

# (marked e2e by the folder, the CRI-O cases crio: tests/conftest.py)

_KLOG_PREFIX = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ", re.M)  # E1202 15:14:19.106612   17722
_LOGRUS_TIME = re.compile(r'time="[^"]*"')
_FS_TIMESTAMP = re.compile(r'("timestamp": )"\d+"')


def normalized(text: str) -> str:
    text = _KLOG_PREFIX.sub(r"\1<time> <pid> ", text)
    text = _LOGRUS_TIME.sub('time="<time>"', text)
    return _FS_TIMESTAMP.sub(r'\1"<time>"', text)


@pytest.fixture(scope="module", params=["containerd-1.6", CRIO])
def runtime(request: pytest.FixtureRequest) -> CriRuntime:
    """The session containerd, then the session CRI-O (a test takes a subset with
    ``@pytest.mark.parametrize("runtime", [...], indirect=True)``)."""
    return runtime_named(request, request.param)


@pytest.fixture(scope="module")
def shim(runtime: CriRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    factory = ShimFactory(lambda: str(runtime.socket), tmp_path_factory.mktemp("crictl-shim"))
    try:
        shim = factory({"server": {"admin_socket": ""}})  # (its default path is one per machine)
        yield shim
    finally:
        problems = factory.close()
    assert not problems, problems
    bad = [line for line in shim.log_text().splitlines() if "Traceback" in line or "level=error" in line]
    assert not bad, f"{shim.log_path}:\n" + "\n".join(bad[:10])


@pytest.fixture
def crictl(crictl_factory: Callable[..., Crictl], runtime: CriRuntime) -> Crictl:
    """crictl talking directly to the runtime."""
    return crictl_factory(runtime.socket)


@pytest.fixture
def both(crictl: Crictl, crictl_factory: Callable[..., Crictl], shim: ShimProcess) -> Callable[..., tuple]:
    """``both(*args)``: run ``crictl ARGS`` against the runtime, then the shim; assert the
    same exit code, stdout and stderr (normalized); return both results."""
    via_shim = crictl_factory(shim.socket)

    def run(*args: str) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
        direct, shimmed = crictl.run(*args), via_shim.run(*args)
        assert shimmed.returncode == direct.returncode, (args, direct, shimmed)
        assert normalized(shimmed.stdout) == normalized(direct.stdout), args
        assert normalized(shimmed.stderr) == normalized(direct.stderr), args
        return direct, shimmed

    return run


def test_version(both, runtime: CriRuntime) -> None:
    direct, _ = both("version")
    assert direct.returncode == 0 and f"RuntimeName:  {runtime.runtime_name}" in direct.stdout


@pytest.mark.parametrize("runtime", ["containerd-1.6"], indirect=True)
def test_info(crictl: Crictl, crictl_factory, shim: ShimProcess) -> None:
    # containerd writes the info map in random order; crictl prints what it gets.
    direct, shimmed = crictl.run("info"), crictl_factory(shim.socket).run("info")
    assert direct.returncode == shimmed.returncode == 0, (direct.stderr, shimmed.stderr)
    assert json.loads(shimmed.stdout) == json.loads(direct.stdout)
    assert json.loads(direct.stdout)["status"]["conditions"][0]["type"] == "RuntimeReady"


def test_pull_images_inspecti_rmi(both, crictl: Crictl, crictl_factory, shim: ShimProcess, make_image,
                                  runtime: CriRuntime) -> None:
    img = make_image()
    image_id = runtime.image_id(img)  # CRI-O: the bare hex
    bare_id = img.image_id.removeprefix("sha256:")
    via_shim = crictl_factory(shim.socket)
    pulled = via_shim.pull(img.ref)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout == f"Image is up to date for {runtime.pulled_ref(img)}\n"  # CRI-O: repo@digest
    both("pull", img.ref)  # present now: the same answer both ways

    listings = [("images",), ("images", "-q"), ("images", "--digests"), ("images", "-v"),
                ("images", "-o", "json"), ("images", img.ref)]
    if runtime.is_crio:  # (the session CRI-O's listing is filtered to this image)
        listings = [(*args, img.ref) for args in listings[:-1]]
    for args in listings:
        direct, _ = both(*args)
        assert direct.returncode == 0
        assert bare_id[:13] in direct.stdout, args
    refs = [img.ref, img.digest_ref, image_id]
    if runtime.is_crio:
        refs += [bare_id[:13]]  # a bare ID prefix is a name to CRI-O
    for ref in refs:
        direct, _ = both("inspecti", ref)
        assert json.loads(direct.stdout)["status"]["id"] == image_id
    both("imagefsinfo")

    removed = via_shim.rmi(img.ref)
    assert removed.returncode == 0 and removed.stdout == f"Deleted: {img.ref}\n", removed
    direct, _ = both("inspecti", img.ref)  # gone for both
    assert direct.returncode == 1 and f'no such image \\"{img.ref}\\" present' in direct.stderr
    direct, _ = both("rmi", img.ref)  # removing it again: the same error both ways
    assert direct.returncode == 1 and f"no such image {img.ref}" in direct.stderr

    # The other way round: pulled directly, removed through the shim gives crictl's own output.
    assert crictl.pull(img.ref).returncode == 0
    again = via_shim.rmi(img.ref)
    assert again.stdout == removed.stdout and again.returncode == 0


def test_errors(both, registry, runtime: CriRuntime) -> None:
    for args in (
        ("pull", f"{registry.host}/e2e/never-pushed:v1"),
        ("pull", "garbage!!!"),
        ("inspecti", f"{registry.host}/e2e/never-pushed:v1"),
        ("rmi", f"{registry.host}/e2e/never-pushed:v1"),
        ("inspect", "no-such-container"),
        ("inspectp", "no-such-sandbox"),
        ("runtime-config",),  # containerd 1.6: unimplemented
    ):
        both(*args)
    direct, _ = both("pull", f"{registry.host}/e2e/never-pushed:v1")
    assert direct.returncode != 0 and ("manifest unknown" if runtime.is_crio else "not found") in direct.stderr


@pytest.mark.parametrize("runtime", ["containerd-1.6"], indirect=True)
def test_pods_containers_stats(both) -> None:
    # (json output: the table form samples CPU for a second first)
    for args in (("pods",), ("ps", "-a"), ("stats", "-o", "json"), ("statsp", "-o", "json"),
                 ("pods", "-o", "json"), ("ps", "-a", "-o", "json")):
        direct, _ = both(*args)
        assert direct.returncode == 0, (args, direct.stderr)
