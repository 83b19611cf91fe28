"""The OCI image and the .deb, each built twice from the commit under test by its own script
(scripts/build-image.sh, scripts/build-deb.sh), as an operator or CI would run them.

The builds read the commit (``git archive HEAD``): changes not committed are not in them. They
download Debian packages and the locked wheels once (cached in /var/cache/cri-shim) and need
root (mmdebstrap, a private mount namespace). Missing tools skip the tests locally and fail them
under ``CI=true`` (scripts/setup.d/70-packaging.sh installs them).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.packaging import Build, build, built_once


@pytest.fixture(scope="session")
def image_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Build, Build]]:
    """scripts/build-image.sh run twice, into two directories (the first: the run's build)."""
    first = built_once("build-image.sh", tmp_path_factory, "package")
    yield first, build("build-image.sh", tmp_path_factory.mktemp("image-again"))


@pytest.fixture(scope="session")
def deb_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Build, Build]]:
    """scripts/build-deb.sh run twice, into two directories. The first is the run's build, which
    the node suite installs too when it runs in the same session (tests/node/test_node_install.py)."""
    first = built_once("build-deb.sh", tmp_path_factory, "package")
    yield first, build("build-deb.sh", tmp_path_factory.mktemp("deb-again"))
