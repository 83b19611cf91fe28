"""The OCI image and the .deb, each built twice from the commit under test by its own script
(scripts/build-image.sh, scripts/build-deb.sh), as an operator or CI would run them.

The builds read the commit (``git archive HEAD``): changes not committed are not in them. They
download Debian packages and the locked wheels once (cached in /var/cache/cri-shim) and need
root (mmdebstrap, a private mount namespace). Missing tools skip the tests locally and fail them
under ``CI=true`` (scripts/setup.d/70-packaging.sh installs them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import binaries
from tests.support.packaging import Build, build


def _require_build_tools(*tools: str) -> None:
    if os.geteuid() != 0:
        msg = "the package builds need root (mmdebstrap, a private mount namespace)"
        if binaries.in_ci():
            pytest.fail(msg + " (CI is set: package tests must not be skipped)", pytrace=False)
        pytest.skip(msg)
    for tool in tools:
        binaries.require(tool)


@pytest.fixture(scope="session")
def image_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Build, Build]]:
    """scripts/build-image.sh run twice, into two directories."""
    _require_build_tools("mmdebstrap", "umoci", "dpkg-shlibdeps", "skopeo")
    base = tmp_path_factory.mktemp("image")
    yield build("build-image.sh", base / "first"), build("build-image.sh", base / "second")


@pytest.fixture(scope="session")
def deb_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Build, Build]]:
    """scripts/build-deb.sh run twice, into two directories."""
    _require_build_tools("dpkg-deb", "dpkg-shlibdeps")
    base = tmp_path_factory.mktemp("deb")
    yield build("build-deb.sh", base / "first"), build("build-deb.sh", base / "second")
