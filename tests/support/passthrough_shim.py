"""A trivial stand-in for the shim: forwards every unary call to the upstream.

It accepts the shim's command line contract
(``serve --listen unix://SOCK --upstream unix://UP --config FILE --log-level L``)
so the harness's ``shim_factory`` can be tested before the real shim exists::

    shim_factory(config, module="tests.support.passthrough_shim")

Requests and responses are forwarded as raw bytes, errors with their code,
details and trailing metadata.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

import grpc
import grpc.aio


class _Forwarder(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            remaining = context.time_remaining()
            call = self.channel.unary_unary(method)(request, timeout=remaining)
            try:
                response = await call
            except grpc.aio.AioRpcError as e:
                context.set_trailing_metadata(e.trailing_metadata() or ())
                await context.abort(e.code(), e.details() or "")
            context.set_trailing_metadata(await call.trailing_metadata() or ())
            return response

        return grpc.unary_unary_rpc_method_handler(unary)


async def serve(listen: str, upstream: str) -> None:
    channel = grpc.aio.insecure_channel(upstream)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_Forwarder(channel),))
    server.add_insecure_port(listen)
    await server.start()
    print(f"passthrough shim listening on {listen}, upstream {upstream}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("passthrough shim stopping", flush=True)
    await server.stop(grace=2)
    await channel.close()
    if listen.startswith("unix://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen[len("unix://") :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="passthrough_shim")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    s.add_argument("--upstream", required=True)
    s.add_argument("--config")
    s.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
