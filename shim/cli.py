"""Command line: ``cri-shim serve | check-config | status | fleet status | controller | node install|uninstall``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from . import config as config_mod
from .config import ConfigError
from .observability import logs

DEFAULT_CONFIG = "/etc/cri-shim/config.yaml"
GIL_SWITCH_SECONDS = 0.0005  # how long a thread may hold the GIL while the event loop waits for it


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cri-shim",
        description="A CRI proxy for kubelet: caps and collapses image pulls node-wide, injects runtime "
                    "handlers, pins images, keeps declared image sets present. Every other CRI call "
                    "passes through to the runtime unchanged.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve CRI on --listen, forwarding to --upstream",
                       description="Serve CRI on a unix socket in front of the runtime. Flags override "
                                   "the config file; a missing or empty config file means defaults. "
                                   "SIGHUP or a change of the file reloads it; SIGTERM shuts down gracefully. "
                                   "Tracing is configured by the standard OTEL_* environment (off unless "
                                   "OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set).")
    s.add_argument("--listen", help=f"endpoint to serve on (default {config_mod.DEFAULT_LISTEN})")
    s.add_argument("--upstream", help=f"runtime endpoint (default {config_mod.DEFAULT_UPSTREAM})")
    s.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config file (default {DEFAULT_CONFIG})")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--log-format", choices=["text", "json"], help="text is key=value lines")

    c = sub.add_parser("check-config", help="validate a config file; exit 1 with the offending key")
    c.add_argument("file")

    st = sub.add_parser("status",
                        help="show pull queue, in-flight pulls with their progress, image sets and upstream state")
    st.add_argument("--admin-socket", help="the shim's server.admin_socket (default: read from --config, "
                                           f"else {config_mod.DEFAULT_ADMIN_SOCKET})")
    st.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file to read the admin socket from "
                                                             f"(default {DEFAULT_CONFIG})")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", action="store_true", help="refresh until interrupted (Ctrl-C)")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch (default 1)")
    fl = sub.add_parser("fleet", help="per image set (and MCO PinnedImageSet), as cri-shim controller wrote it: "
                                      "selected, current, progressing, failing nodes and why")
    fl.add_argument("action", choices=["status"])
    fl.add_argument("--kubeconfig", required=True, help="a kubeconfig that may list nodeimagesetstatuses")
    fl.add_argument("--json", action="store_true", help="machine-readable output")

    ct = sub.add_parser("controller", help="the cluster component: each ImageSet's truth in its status, paced "
                                           "rollouts' grants, the Role for the pull Secrets sets name",
                        description="Run the fleet controller (a Deployment of 2 replicas, deploy/cluster/"
                                    "controller.yaml). Replicas elect a leader on a coordination.k8s.io/v1 Lease; "
                                    "only the leader writes ImageSet.status: per set the selected nodes that are "
                                    "current, progressing, waiting, failing (by reason), stale and missing, with "
                                    "conditions Available, Progressing, Degraded and Halted; for a set with "
                                    "spec.rollout, which nodes may pull its generation now (status.rollout.granted). "
                                    "Where MCO's PinnedImageSets are served (discovery), the same truth for each, "
                                    "over the nodes of the MachineConfigPools listing it, in a PinnedImageSetReport "
                                    "of the same name (not paced: MCO owns the set). "
                                    "It also keeps the Role that lets nodes read the pull Secrets sets name.")
    ct.add_argument("--kubeconfig", help="kubeconfig to use (default: the Pod's ServiceAccount, in-cluster)")
    ct.add_argument("--namespace", default="cri-shim", help="namespace of the leader Lease (default cri-shim)")
    ct.add_argument("--lease-name", default="cri-shim-controller", help="name of the leader Lease")
    ct.add_argument("--identity", help="this replica's holderIdentity (default: POD_NAME or host name + random)")
    ct.add_argument("--lease-duration", type=float, default=15.0,
                    help="seconds a standby waits after the Lease last changed before taking it (default 15)")
    ct.add_argument("--renew-deadline", type=float, default=10.0,
                    help="seconds the leader keeps acting without a successful renewal (default 10)")
    ct.add_argument("--retry-period", type=float, default=2.0, help="seconds between tries (default 2)")
    ct.add_argument("--stale-after", type=float, default=120.0,
                    help="a node behind on a set whose shim wrote nothing for this many seconds (since its last "
                         "write or the set's generation change, whichever is later) is stale (default 120)")
    ct.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    ct.add_argument("--log-format", choices=["text", "json"], default="text")
    _node_parser(sub)
    return p


def _node_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    nd = sub.add_parser("node", help="put cri-shim on this node and switch kubelet to it, or undo that (as root)",
                        description="One command per node, and one to undo it; both idempotent. "
                                    "docs/install.md, 'A node, with cri-shim node install'.")
    actions = nd.add_subparsers(dest="action", required=True)
    ins = actions.add_parser(
        "install", help="install the config, the unit and the kubelet drop-in, start the shim, switch kubelet",
        description="Puts /etc/cri-shim/config.yaml, the cri-shim.service unit and kubelet's drop-in in place, "
                    "starts the shim and checks that Version through its socket names the runtime kubelet uses; "
                    "then sets imageServiceEndpoint (full mode: containerRuntimeEndpoint) in kubelet's own config "
                    "file, or where kubelet has it as a flag, the flag in the one flags file that sets it "
                    "(kubeadm-flags.env, /etc/default/kubelet, /etc/sysconfig/kubelet; refused elsewhere), "
                    "a copy of each file kept under /var/lib/cri-shim/install; restarts kubelet and waits until "
                    "kubelet's "
                    "/healthz answers, its Lease is renewed and its Node is still Ready one status update period "
                    "later (read with kubelet's own kubeconfig). When a check fails, everything is switched back. "
                    "--dry-run prints every change and makes none. Exit 0: done, or nothing to "
                    "change; 1: a check failed and the changes were undone; 2: refused, nothing changed.")
    ins.add_argument("--mode", choices=["image-only", "full"], default="image-only",
                     help="image-only (default): kubelet's image calls go through the shim; full: every CRI call")
    ins.add_argument("--config", help="a shim config file to install as /etc/cri-shim/config.yaml (default: keep "
                                      "the one in place, else the shipped config.example.yaml with upstream set "
                                      "to the runtime kubelet uses)")
    ins.add_argument("--kubelet-config", help="kubelet's config file (default: kubelet's --config)")
    _node_check_flags(ins)
    ins.add_argument("--shim-timeout", type=float, default=30.0,
                     help="seconds for the shim to answer Version through its socket (default 30)")
    ins.add_argument("--keep-pull-settings", action="store_true",
                     help="leave kubelet's serializeImagePulls and registryPullQPS as they are (default: false and "
                          "0, as the shipped kubelet snippet says)")
    ins.add_argument("--executable", help="the cri-shim program the unit runs (default /usr/local/bin/cri-shim "
                                          "if it exists, else this program)")
    ins.add_argument("--dry-run", action="store_true", help="print every change (files with their diff, systemctl "
                                                            "calls) and make none")
    un = actions.add_parser(
        "uninstall", help="switch kubelet back, then stop the shim and remove what install added",
        description="Puts kubelet's config, and a flags file install set an endpoint flag in, back byte for "
                    "byte (only the keys or flags install set, if the file changed since), restarts kubelet and "
                    "waits for it; then stops the shim (its pins are given up only "
                    "then, and the images they kept are named) and removes or puts back every file install wrote. "
                    "Exit 0: done, or nothing to undo; 1: kubelet is not back, or a step failed (run it again); "
                    "2: refused.")
    _node_check_flags(un)
    un.add_argument("--dry-run", action="store_true", help="print every change and make none")


def _node_check_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", help="a kubeconfig that may read this Node and its Lease in kube-node-lease "
                                        "(default: kubelet's --kubeconfig, "
                                        "else /etc/kubernetes/kubelet.conf or /var/lib/kubelet/kubeconfig; \"\": "
                                        "none, kubelet's /healthz only)")
    p.add_argument("--node-name", help="this node's Node (default: the kubeconfig's user, system:node:<name>)")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds for kubelet to be healthy and its Node Ready after a restart (default 120; "
                        "switching back after a failed install, at least 60)")


def _controller(args: argparse.Namespace) -> int:
    from kubernetes_asyncio.config import ConfigException

    from .controller.main import default_identity, run

    logs.setup(args.log_level, args.log_format)
    if not args.lease_duration > args.renew_deadline > args.retry_period > 0:
        print("cri-shim: need --lease-duration > --renew-deadline > --retry-period > 0", file=sys.stderr)
        return 2
    if args.kubeconfig and not os.path.exists(args.kubeconfig):
        print(f"cri-shim: --kubeconfig {args.kubeconfig}: no such file", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(kubeconfig=args.kubeconfig, namespace=args.namespace, lease_name=args.lease_name,
                               identity=args.identity or default_identity(), lease_duration=args.lease_duration,
                               renew_deadline=args.renew_deadline, retry_period=args.retry_period,
                               stale_after=args.stale_after))
    except ConfigException as e:
        print(f"cri-shim: cannot start the controller: {e} (outside a Pod, pass --kubeconfig)", file=sys.stderr)
        return 2


def _node(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from .node_install import install, uninstall
    from .node_install.host import SystemHost

    if os.geteuid() != 0:
        print(f"cri-shim node {args.action}: run it as root", file=sys.stderr)
        return install.EXIT_REFUSED

    def say(line: str) -> None:
        print(line, flush=True)

    if args.action == "uninstall":
        return uninstall.uninstall(uninstall.Options(kubeconfig=args.kubeconfig, node_name=args.node_name,
                                                     ready_timeout=args.ready_timeout, dry_run=args.dry_run),
                                   Path("/"), SystemHost(), say)
    running = os.path.abspath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "cri-shim" else shutil.which("cri-shim")
    opts = install.Options(mode=args.mode, config=args.config, kubelet_config=args.kubelet_config,
                           kubeconfig=args.kubeconfig, node_name=args.node_name, shim_timeout=args.shim_timeout,
                           ready_timeout=args.ready_timeout, pull_settings=not args.keep_pull_settings,
                           executable=args.executable, running=running, dry_run=args.dry_run)
    return install.install(opts, Path("/"), SystemHost(), say)


def _fleet(args: argparse.Namespace) -> int:
    from .cluster.fleet import print_fleet

    return print_fleet(args.kubeconfig, as_json=args.json)


def _serve(args: argparse.Namespace) -> int:
    # A reload request (SIGHUP) before the server installs its handler must not kill
    # us; the config is read below, after this, so nothing is missed.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from .process.server import ShimServer
    from .process.unixsock import StartupError

    overrides = {"listen": args.listen, "upstream": args.upstream,
                 "level": args.log_level, "format": args.log_format}
    try:
        cfg = config_mod.with_overrides(config_mod.load(args.config), **overrides)
    except ConfigError as e:
        print(f"cri-shim: bad config {args.config}: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg.log.level, cfg.log.format, cfg.log.max_repeats, cfg.log.repeat_window_seconds)
    if not os.path.exists(args.config):
        logs.log(logs.get("cli"), logging.WARNING, "config file not found; using defaults", config=args.config)
    # The event loop relays every call; CPU work handed to a thread (the runtime's list of
    # 100,000 names, a state file) would otherwise keep it from the GIL 5 ms at a time
    # (Python's default): each call then waits up to 5 ms per turn of the loop.
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    if cfg.server.uvloop:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    try:
        return asyncio.run(ShimServer(cfg, args.config, overrides).run())
    except StartupError as e:
        print(f"cri-shim: cannot start: {e}", file=sys.stderr)
        return 1


def _check_config(args: argparse.Namespace) -> int:
    if not os.path.exists(args.file):
        print(f"cri-shim: {args.file}: no such file", file=sys.stderr)
        return 1
    try:
        config_mod.load(args.file)
    except ConfigError as e:
        print(f"cri-shim: {args.file}: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def _status(args: argparse.Namespace) -> int:
    from .process.status_render import print_status

    admin_socket = args.admin_socket
    if admin_socket is None:
        try:
            admin_socket = config_mod.load(args.config).server.admin_socket
        except ConfigError as e:
            print(f"cri-shim: {args.config}: {e}; trying {config_mod.DEFAULT_ADMIN_SOCKET}", file=sys.stderr)
            admin_socket = config_mod.DEFAULT_ADMIN_SOCKET
        if not admin_socket:
            print(f"cri-shim: status is off: server.admin_socket is empty in {args.config}", file=sys.stderr)
            return 1
    if args.watch:
        # Ctrl-C (SIGINT) ends a watch, also when started with SIGINT ignored, as a shell without
        # job control starts `cmd &` (Python then leaves SIGINT ignored: the watch never ended).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            from .process.status_render import watch_status

            return watch_status(admin_socket, interval=max(0.1, args.interval), as_json=args.json)
        except KeyboardInterrupt:  # Ctrl-C ends a watch, also before its first view
            return 0
    return print_status(admin_socket, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"serve": _serve, "check-config": _check_config, "status": _status, "fleet": _fleet,
               "controller": _controller, "node": _node}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
