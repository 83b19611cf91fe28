"""The HTTP/2 frame relay: the fast passthrough engine (kubelet -> shim -> runtime).

The files, in an order where each imports only files above it:

- ``http2.py``: wire vocabulary (frame types, flags, error codes, frame builders).
- ``hpack_decoder.py``: HPACK decoding, bounded, mirroring the client's table.
- ``bucket.py``: a token bucket. ``grpcwire.py``: gRPC framing of the shim's own answers.
- ``frames.py``: the frame buffer and the frame-layer rules for client frames.
- ``headers.py``: header blocks (HEADERS + CONTINUATION) and malformed requests.
- ``streams.py``: the per-stream state machine (``State``, ``Event``, ``TRANSITIONS``).
- ``settings.py``, ``flow.py``, ``pings.py``, ``output.py``: both peers' SETTINGS,
  flow-control windows, the PING policy, the order of what goes to the client.
- ``memory.py``, ``limits.py``: the process-wide pools; ``server.*`` as the relay reads it.
- ``events.py``: what the core tells its adapter.
- ``intercepted.py``: the streams the shim answers itself.
- ``patched.py``: relayed streams whose response messages the shim rewrites.
- ``core.py``: the sans-IO core, ``RelayCore``, coordinating all of the above.
- ``admission.py``: who makes room at the connection cap.
- ``host.py``: what a connection needs from its listener (a Protocol).
- ``connection.py``: the asyncio adapter of one client connection (and its runtime one).
- ``listener.py``: the listening socket and what its connections share.

The relay never imports shim/grpc_engine/; routing and the call model are shim/cri/.
"""
