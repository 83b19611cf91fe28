"""Running crictl against arbitrary runtime/image endpoints.

``--config tests/support/crictl.yaml`` is always passed, so no ``/etc/crictl.yaml``
is needed (and none is read).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.support.binaries import require


# Endpoints are always given on the command line; the file only keeps crictl
# from looking for /etc/crictl.yaml.
CONFIG = Path(__file__).with_name("crictl.yaml")


def endpoint(socket: str | os.PathLike[str]) -> str:
    s = str(socket)
    return s if s.startswith("unix:") else f"unix://{s}"


class Crictl:
    """``crictl`` bound to endpoints.  ``image_endpoint`` defaults to ``runtime_endpoint``."""

    def __init__(
        self,
        runtime_endpoint: str | os.PathLike[str],
        image_endpoint: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.binary = binary or require("crictl")
        self.runtime_endpoint = endpoint(runtime_endpoint)
        self.image_endpoint = endpoint(image_endpoint if image_endpoint is not None else runtime_endpoint)
        self.timeout = timeout
        self.config_path = CONFIG

    def argv(self, *args: str, timeout: float | None = None) -> list[str]:
        t = self.timeout if timeout is None else timeout
        return [
            self.binary,
            "--config",
            str(self.config_path),
            "--runtime-endpoint",
            self.runtime_endpoint,
            "--image-endpoint",
            self.image_endpoint,
            "--timeout",
            f"{t:g}s",
            *args,
        ]

    def run(
        self,
        *args: str,
        timeout: float | None = None,
        check: bool = False,
        input: str | None = None,  # noqa: A002
    ) -> subprocess.CompletedProcess[str]:
        """Run ``crictl ARGS``; the process gets ``timeout`` + 30 s before being killed."""
        t = self.timeout if timeout is None else timeout
        return subprocess.run(
            self.argv(*args, timeout=t),
            capture_output=True,
            text=True,
            check=check,
            input=input,
            timeout=t + 30,
        )

    # Convenience wrappers -------------------------------------------------

    def pull(self, image: str, *, creds: str | None = None, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        args = ["pull"] + (["--creds", creds] if creds else []) + [image]
        return self.run(*args, timeout=timeout)

    def images(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run("images", *extra)

    def rmi(self, *images: str) -> subprocess.CompletedProcess[str]:
        return self.run("rmi", *images)

    def inspecti(self, image: str) -> subprocess.CompletedProcess[str]:
        return self.run("inspecti", "-o", "json", image)


def run_crictl(
    args: Sequence[str],
    *,
    runtime_endpoint: str,
    image_endpoint: str | None = None,
    timeout: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """One-shot ``crictl`` run."""
    return Crictl(runtime_endpoint, image_endpoint, timeout=timeout).run(*args)
