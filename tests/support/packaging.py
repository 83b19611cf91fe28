"""What tests/package and tests/node read the builds of scripts/build-image.sh and
scripts/build-deb.sh with: ``build`` runs a script as an operator would, ``built_once`` gives
every suite of a test run the same build, ``require_build_tools`` skips (fails in CI) where they
cannot run, ``Image`` reads an OCI layout with nothing but json and tarfile (not with umoci, which
wrote it), ``tree_digest`` sums a directory tree."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import subprocess
import tarfile
import time
import tomllib
from pathlib import Path

import pytest

from tests.support import binaries


REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
#: One build may take this long on 2 busy cores, downloads included (about 1-2 min each measured:
#: docs/install.md); past it the build counts as failed.
BUILD_TIMEOUT = 900
ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
#: the file scripts/build-deb.sh writes into its --out directory
DEB_NAME = f"cri-shim_{VERSION}_{ARCH}.deb"
#: what each script needs besides bash and Python
BUILD_TOOLS = {"build-image.sh": ("mmdebstrap", "umoci", "dpkg-shlibdeps", "skopeo"),
               "build-deb.sh": ("dpkg-deb", "dpkg-shlibdeps")}


def commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


@dataclasses.dataclass(frozen=True)
class Build:
    out: Path
    seconds: float
    #: the script's last stdout line: the image's digest, or the .deb's sha256
    printed: str
    log: str


def build(script: str, out: Path) -> Build:
    """Run ``scripts/SCRIPT --out OUT`` (it must succeed) and time it."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "scripts" / script), "--out", str(out)], capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - t0
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stderr[-6000:]}"
    return Build(out, seconds, r.stdout.strip().splitlines()[-1], r.stderr)


def require_build_tools(script: str, suite: str) -> None:
    """Skip the test where ``script`` cannot run (not root, a tool missing); under ``CI=true`` fail
    it instead, naming ``suite``."""
    if os.geteuid() != 0:
        msg = "the package builds need root (mmdebstrap, a private mount namespace)"
        if binaries.in_ci():
            pytest.fail(f"{msg} (CI is set: {suite} tests must not be skipped)", pytrace=False)
        pytest.skip(msg)
    for tool in BUILD_TOOLS[script]:
        binaries.require(tool)


_built: dict[str, Build] = {}


def built_once(script: str, tmp_path_factory: pytest.TempPathFactory, suite: str) -> Build:
    """``scripts/SCRIPT``'s build of this test run: made by the first suite that asks (the node
    suite, the package suite), the same directory for every later one. Skips (fails in CI, naming
    ``suite``) where the script cannot run."""
    require_build_tools(script, suite)
    if script not in _built:
        _built[script] = build(script, tmp_path_factory.mktemp(script.removesuffix(".sh")))
    return _built[script]


class Image:
    """An OCI layout as the build wrote it, read with nothing but json and tarfile."""

    def __init__(self, layout: Path) -> None:
        self.layout = layout
        index = json.loads((layout / "index.json").read_text())
        (self.descriptor,) = index["manifests"]
        self.digest: str = self.descriptor["digest"]
        self.manifest = json.loads(self.blob(self.digest).read_bytes())
        self.config = json.loads(self.blob(self.manifest["config"]["digest"]).read_bytes())
        (self.layer,) = self.manifest["layers"]

    def blob(self, digest: str) -> Path:
        algo, hexdigest = digest.split(":", 1)
        return self.layout / "blobs" / algo / hexdigest

    def compressed_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.layout / "blobs").rglob("*") if p.is_file())

    def unpacked_bytes(self) -> int:
        with gzip.open(self.blob(self.layer["digest"])) as f:
            return sum(m.size for m in tarfile.open(fileobj=f, mode="r|"))

    def members(self) -> list[tarfile.TarInfo]:
        with tarfile.open(self.blob(self.layer["digest"]), mode="r:gz") as t:
            return t.getmembers()


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256 of a file, or '-> target' of a symlink} under ``root``."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
