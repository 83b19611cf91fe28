"""The fallback engine (``server.engine: grpc``): grpc.aio's server with one generic handler.

Beside shim/relay/ (the default engine, an HTTP/2 frame relay), the other way to serve CRI
clients: both route every call once through the App's router and hand intercepted calls to
the same handlers (the call model, shim/cri/call.py). Neither engine imports the other.

- ``proxy.py``: ``Proxy``, the generic handler (raw-bytes passthrough, interception, spans).
"""
