"""How long marking pinned images costs per ListImages response, and what a
RemoveImage check costs, for a node with many images.

    python bench/pins.py [images]

Prints the time to mark a ListImagesResponse of N images (runtime-shaped names:
normalized tags and digests, an unknown field per image) with no pins, with exact
pins and with globs, and the time per image of the name check alone.
"""

from __future__ import annotations

import sys
import time

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from shim.cri import protowire as wire  # noqa: E402
from shim.images.mark_pinned import mark_images  # noqa: E402
from shim.images.pin_set import PinSet, image_names  # noqa: E402
from shim.proto.runtime.v1 import api_pb2  # noqa: E402


def response(n: int) -> bytes:
    out = []
    for i in range(n):
        img = api_pb2.Image(id=f"sha256:{i:064x}", repo_tags=[f"docker.io/library/app{i}:v1", f"quay.io/org/app{i}:v{i % 7}"],
                            repo_digests=[f"docker.io/library/app{i}@sha256:{i:064x}"], size=123456789)
        img.spec.annotations["org.example/built"] = "2024"
        out.append(wire.len_field(1, img.SerializeToString() + wire.string_field(99, "x")))
    return b"".join(out)


def best(fn, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return min(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    data = response(n)
    cases = {
        "no pins": PinSet.build([]),
        "10 exact pins": PinSet.build([f"app{i}:v1" for i in range(0, 10)]),
        "exact + 3 globs": PinSet.build(["registry.k8s.io/pause:*", "quay.io/org/app1*:v3", "ghcr.io/*", "nginx"]),
    }
    print(f"ListImagesResponse with {n} images, {len(data) / 1e6:.1f} MB (CPU time, best of 7)")
    for name, pins in cases.items():
        t0 = time.process_time()
        out = mark_images(pins, data, api_pb2.ListImagesResponse)  # first call: every name parsed
        cold = time.process_time() - t0
        marked = sum(i.pinned for i in api_pb2.ListImagesResponse.FromString(out).images)
        t = best(lambda: mark_images(pins, data, api_pb2.ListImagesResponse))
        print(f"  {name:18s} first {cold * 1000:7.1f} ms, then {t * 1000:7.1f} ms "
              f"({t / n * 1e6:.2f} us/image, {marked} marked)")
    msg = api_pb2.ListImagesResponse.FromString(data)
    fresh = PinSet.build(["registry.k8s.io/pause:*", "quay.io/org/app1*:v3", "ghcr.io/*", "nginx"])
    t = best(lambda: [fresh.match(image_names(i.id, i.repo_tags, i.repo_digests)) for i in msg.images])
    print(f"  uncached name check (parse + match every name) {t * 1000:7.1f} ms ({t / n * 1e6:.2f} us/image)")
    t = best(lambda: api_pb2.ListImagesResponse.FromString(data))
    print(f"  decode only        {t * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
