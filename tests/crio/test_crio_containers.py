"""A pod and a container run by CRI-O, driven by crictl through the shim.

The image holds a tiny static program as ``/bin/true`` (``tests.support.tiny_elf``)
that prints a line and exits 0. The pod uses the host network (no CNI plugins here) and
its own PID namespace (so no infra container is needed); CRI-O still resolves its pause
image at RunPodSandbox, so the private CRI-O's pause image is that same image. The OCI
runtime is runc behind the wrapper in ``tests.support.crio`` (oomScoreAdj clamped,
hugepageLimits dropped).

crictl runp / create / start / inspect / ps / stopp / rmp go through the shim's relay
(RunPodSandbox is also read by the shim to learn the pod's runtime handler), and what
``crictl ps`` and ``pods`` show through the shim is what they show directly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import oci, tiny_elf
from tests.support.crictl import Crictl

pytestmark = pytest.mark.crio

MESSAGE = b"hello from a container run by cri-o\n"


def wait_exited(c: Crictl, container: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        out = c.run("inspect", "-o", "json", container)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)["status"]
        if status["state"] == "CONTAINER_EXITED":
            return status
        assert time.monotonic() < deadline, f"container still {status['state']} after {timeout} s"
        time.sleep(0.1)


def test_runp_create_start_through_the_shim(registry, crio_factory, shim_factory, crictl_factory,
                                            tmp_path: Path) -> None:
    if not tiny_elf.supported():
        pytest.skip("the test program is x86-64 machine code")
    layer = oci.make_layer({"bin/true": tiny_elf.hello_program(MESSAGE)}, mode=0o755)
    img = registry.push(oci.make_image([layer]), "e2e/crio-hello", "v1")
    runtime = crio_factory(pause_image=img.ref)
    shim = shim_factory({"server": {"admin_socket": ""}, "pins": {"images": [img.ref]}}, upstream=runtime.socket)
    via, direct = crictl_factory(shim.socket), crictl_factory(runtime.socket)

    logs = tmp_path / "pod-logs"
    own_pid = {"namespace_options": {"network": 2, "pid": 1, "ipc": 0}}  # host network, own PID namespace
    pod = tmp_path / "pod.json"
    pod.write_text(json.dumps({"metadata": {"name": "hello", "namespace": "e2e", "uid": "crio-hello-1", "attempt": 0},
                               "log_directory": str(logs), "linux": {"security_context": own_pid}}))
    ctr = tmp_path / "container.json"
    ctr.write_text(json.dumps({"metadata": {"name": "hello"}, "image": {"image": img.ref}, "log_path": "hello.log",
                               "linux": {"security_context": own_pid}}))

    assert via.pull(img.ref).returncode == 0
    out = via.run("runp", str(pod))
    assert out.returncode == 0, out.stderr
    sandbox = out.stdout.strip()
    try:
        out = via.run("create", sandbox, str(ctr), str(pod))
        assert out.returncode == 0, out.stderr
        container = out.stdout.strip()
        out = via.run("start", container)
        assert out.returncode == 0, out.stderr

        status = wait_exited(via, container)
        assert (status["exitCode"], status["reason"]) == (0, "Completed")
        assert status["imageId"] == img.image_id.removeprefix("sha256:")
        assert (logs / "hello.log").read_bytes().endswith(b" stdout F " + MESSAGE)

        for args in (("ps", "-a", "-o", "json"), ("pods", "-o", "json")):
            a, b = direct.run(*args), via.run(*args)
            assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
            assert json.loads(b.stdout) == json.loads(a.stdout)
        assert container in via.run("ps", "-a", "-q").stdout

        # the running pod's image is pinned by the shim: crictl rmi through it is refused
        out = via.rmi(img.ref)
        assert out.returncode != 0 and "is pinned by" in out.stderr
    finally:
        assert via.run("stopp", sandbox).returncode == 0
        assert via.run("rmp", sandbox).returncode == 0
    assert via.run("pods", "-q").stdout.strip() == ""
