"""Test support code for cri-shim.

* :mod:`.binaries`   -- ``require(name)``: skip locally / fail in CI when a tool is missing
* :mod:`.oci`        -- fabricate OCI images, write OCI layouts, push via the registry API
* :mod:`.proxy`      -- counting/throttling HTTP proxy in front of a registry
* :mod:`.registry`   -- run docker-registry (optionally with htpasswd auth) + proxy
* :mod:`.containerd` -- run a throw-away containerd with its CRI image service
* :mod:`.crictl`     -- run crictl against any endpoints
* :mod:`.cri`        -- raw (bytes in, bytes out) CRI gRPC calls + tiny protobuf codec
* :mod:`.shim`       -- run the shim as a process (one ShimProcess, sync and async waits)
* :mod:`.fixtures`   -- the pytest fixtures (re-exported by ``tests/e2e/conftest.py``), CRI-O's
  and ``cri_runtime`` (one test over containerd 1.6, containerd 2.x and CRI-O) included
* :mod:`.fake_fixtures` -- ``runtime`` (a scripted runtime) and ``engine``, for tests/unit and
  tests/process
* :mod:`.passthrough_shim` -- a byte-forwarding stand-in for the shim
* :mod:`.wait`       -- ``wait_for`` (async tests) and ``wait_for_blocking``: poll a condition, fail naming it
"""
