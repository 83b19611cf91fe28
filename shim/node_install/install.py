"""``cri-shim node install``: put cri-shim in front of this node's runtime and switch kubelet to
it, checking each step, and switch everything back by itself when a check fails.

1. Read how kubelet runs (``kubelet.py``); refuse what install cannot switch (an endpoint flag
   set anywhere but in one place of one of kubelet's flags files, ``flagfile.py``; a
   ``--config-dir`` drop-in) and a node that is not healthy and Ready now.
   The runtime kubelet uses answers ``Version``: that endpoint becomes the shim's ``upstream``.
2. Files: ``/etc/cri-shim/config.yaml`` (``--config``; else the one in place; else the shipped
   config.example.yaml with ``upstream`` set), ``/etc/systemd/system/cri-shim.service`` and the
   kubelet drop-in ``kubelet.service.d/10-cri-shim.conf`` (each only when a package did not
   ship it under /lib/systemd/system or /usr/lib/systemd/system), and on CRI-O the shim's drop-in
   ``cri-shim.service.d/20-runtime.conf`` (``After=``/``Wants=crio.service``); ``daemon-reload``,
   enable and start the shim.
3. ``Version`` through the shim's socket must name the runtime kubelet uses, within
   ``--shim-timeout``; else everything above is undone.
4. kubelet's config file: ``imageServiceEndpoint`` (or ``containerRuntimeEndpoint`` in full
   mode) set to the shim's socket, with ``serializeImagePulls``/``registryPullQPS`` from the
   shipped snippet; an endpoint set by a flag is set where the flag is, in its flags file,
   instead; a copy of each file's bytes kept under /var/lib/cri-shim/install; restart kubelet.
5. kubelet healthy and its Node Ready again (``readiness.py``) within ``--ready-timeout``; else
   kubelet's config (and flags file) is put back byte for byte, kubelet restarted (and waited
   for), and the rest undone.

Each step changes only what differs, so a second run changes nothing. ``--dry-run`` prints
every change (files with their diff, systemctl calls) and makes none; the read-only checks of
step 1 still run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import yaml

from .. import config as config_mod
from .. import safeyaml
from ..config import ConfigError
from . import edited, flagfile, readiness, state, yamledit
from . import kubelet as kubelet_mod
from .changes import Changes, Say
from .flagfile import Place
from .host import Host, HostError, Runtime
from .kubelet import IMAGE_FLAG, IMAGE_KEY, RUNTIME_FLAG, RUNTIME_KEY, Kubelet, Refused, parse_flags, same_endpoint
from .state import FileRecord, FlagRecord, KubeletRecord, State
from .yamledit import EditError

SHIM_UNIT = "cri-shim.service"
SHIM_CONFIG = "/etc/cri-shim/config.yaml"
UNIT_DIR = "/etc/systemd/system"
#: where a package puts unit files (an install of ours would shadow them from UNIT_DIR)
PACKAGED_UNIT_DIRS = ("/lib/systemd/system", "/usr/lib/systemd/system")
UNIT_FILE = SHIM_UNIT
DROP_IN = "kubelet.service.d/10-cri-shim.conf"
#: the shim's drop-in that orders it after a runtime other than containerd (the unit's own After=)
RUNTIME_DROP_IN = "cri-shim.service.d/20-runtime.conf"
#: a runtime's name in its Version answer -> its systemd unit, for runtimes the shipped unit does not name
RUNTIME_UNITS = {"cri-o": "crio.service"}
#: the program the shipped unit's ExecStart= runs
SHIPPED_EXECUTABLE = "/usr/local/bin/cri-shim"
#: the mode -> the shipped snippet of kubelet settings it merges
MODES = {"image-only": "kubelet-image-only.yaml", "full": "kubelet-full.yaml"}
#: settings of the snippets that are not endpoints: kubelet's own pull limits (docs/pulls.md)
PULL_SETTINGS = ("serializeImagePulls", "registryPullQPS")
#: the unit's StateDirectory= (the shim's state files); removed by uninstall when install made it
SHIM_STATE_DIR = "/var/lib/cri-shim"
VERSION_CALL_TIMEOUT = 5.0
#: switching back, kubelet is waited for this long at least (whatever --ready-timeout said)
SWITCH_BACK_WAIT = 60.0

EXIT_OK = 0
EXIT_ROLLED_BACK = 1  #: a check failed after changes; they were undone
EXIT_REFUSED = 2  #: nothing was changed


def shipped(name: str) -> bytes:
    """A file of systemd/ as the package ships it (package data of this package)."""
    return (resources.files(__package__) / "shipped" / name).read_bytes()


@dataclass(frozen=True)
class Options:
    mode: str = "image-only"
    config: str | None = None  #: a shim config file to install; None: keep the one in place or ship one
    kubelet_config: str | None = None  #: None: kubelet's --config
    kubeconfig: str | None = None  #: None: kubelet's --kubeconfig, else kubeadm's; "": none
    node_name: str | None = None  #: None: the kubeconfig's kubelet identity
    shim_timeout: float = 30.0
    ready_timeout: float = 120.0
    pull_settings: bool = True  #: also set the snippet's serializeImagePulls and registryPullQPS
    executable: str | None = None  #: the program the unit runs; None: SHIPPED_EXECUTABLE if there, else ``running``
    running: str | None = None  #: the cri-shim program running this command, if known
    dry_run: bool = False


def unit_path(ch: Changes, name: str) -> tuple[str, bool]:
    """Where the unit file ``name`` goes: (path, True when a package shipped it there)."""
    for d in PACKAGED_UNIT_DIRS:
        p = f"{d}/{name}"
        if ch.at(p).is_file():
            return p, True
    return f"{UNIT_DIR}/{name}", False


def main_pid(ch: Changes, unit: str) -> int:
    r = ch.query("show", unit, "-p", "MainPID", "--value")
    try:
        return int(r.out.strip() or 0) if r.rc == 0 else 0
    except ValueError:
        return 0


def is_active(ch: Changes, unit: str) -> bool:
    return ch.query("is-active", "--quiet", unit).rc == 0


def journal_tail(host: Host, unit: str, lines: int = 15) -> list[str]:
    """The last journal lines of the unit's latest run (all its runs when systemd does not say which)."""
    r = host.run(["systemctl", "show", unit, "-p", "InvocationID", "--value"], 30.0)
    invocation = r.out.strip() if r.rc == 0 else ""
    where = [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    r = host.run(["journalctl", *where, "-n", str(lines), "--no-pager", "-o", "cat"], 30.0)
    return r.out.splitlines()[-lines:] if r.rc == 0 else []


@dataclass(frozen=True)
class Plan:
    """What install found and will have in place; made without changing anything."""

    opts: Options
    before: State | None  #: what earlier installs did
    kubelet: Kubelet
    probe: readiness.Probe
    upstream: str  #: the runtime kubelet used before the shim: the shim's upstream
    runtime: Runtime  #: its answer to Version
    config: bytes  #: the shim's config file
    config_source: str
    listen: str  #: the shim's socket, from that config
    unit: tuple[str, bytes | None]  #: (path, bytes to write; None: the package's, used as it is)
    drop_in: tuple[str, bytes | None]
    #: (path, bytes) of the shim's drop-in ordering it after the runtime's unit; None: the shipped
    #: unit's After=containerd.service is the runtime's already
    runtime_drop_in: tuple[str, bytes] | None
    #: kubelet's config: key -> value as it will be written (only the keys that change)
    kubelet_keys: dict[str, str]
    kubelet_config: bytes  #: kubelet's config file as it will be
    #: the endpoint flags set in kubelet's flags files, each where it is (they beat the config file)
    flags: list[Place]
    #: each flags file with a flag in ``flags``: path -> (its bytes now, its bytes as they will be)
    flag_files: dict[str, tuple[bytes, bytes]]


@dataclass
class _Progress:
    """What this run changed, for the rollback."""

    state: State
    state_written: bool = False
    shim_was_active: bool = False
    shim_was_enabled: bool = False
    config_changed: bool = False
    units_changed: bool = False
    enabled: bool = False
    started: bool = False  #: the shim was started or restarted
    kubelet_written: bool = False
    flag_files_written: list[str] = field(default_factory=list)
    kubelet_restarted: bool = False


def install(opts: Options, root: Path, host: Host, say: Say) -> int:
    """Returns the exit status: EXIT_OK, EXIT_ROLLED_BACK or EXIT_REFUSED."""
    return locked(root, host, say, opts.dry_run, lambda ch: _install(opts, ch, host, say))


def locked(root: Path, host: Host, say: Say, dry_run: bool, body: Callable[[Changes], int]) -> int:
    """One install or uninstall at a time: ``body`` runs holding the lock (released whatever
    happens), or the call is refused with nothing changed."""
    ch = Changes(root, host, say, dry_run)
    try:
        ch.lock()
    except HostError as e:
        say(f"refused, nothing changed: {e}")
        return EXIT_REFUSED
    try:
        return body(ch)
    finally:
        ch.unlock()


def _install(opts: Options, ch: Changes, host: Host, say: Say) -> int:
    try:
        plan = _plan(opts, ch, host, say)
    except (Refused, HostError, EditError, ConfigError) as e:
        say(f"refused, nothing changed: {e}")
        return EXIT_REFUSED
    progress = _Progress(State.from_json(plan.before.to_json()) if plan.before is not None
                         else State(opts.mode, plan.listen, plan.upstream))
    progress.state.listen = plan.listen
    try:
        _apply(plan, progress, ch, host, say)
    except (HostError, OSError) as e:
        say(f"failed: {e}")
        if not opts.dry_run:
            _roll_back(plan, progress, ch, host, say)
        return EXIT_ROLLED_BACK
    return EXIT_OK


# ---------------------------------------------------------------------------------- the plan

def _plan(opts: Options, ch: Changes, host: Host, say: Say) -> Plan:
    if opts.mode not in MODES:
        raise Refused(f"unknown mode {opts.mode} (one of {', '.join(MODES)})")
    try:
        before = state.load(str(ch.at(state.STATE_FILE)))
    except ValueError as e:
        raise Refused(f"{e}; remove it only if cri-shim is not installed") from None
    if before is not None and before.mode != opts.mode:
        raise Refused(f"installed in {before.mode} mode; run `cri-shim node uninstall` first to change the mode")
    pid = main_pid(ch, kubelet_mod.UNIT)
    kubelet = kubelet_mod.find(ch.root, pid, host.command_line(pid) if pid > 0 else None,
                               opts.kubelet_config or (before.kubelet.config if before and before.kubelet else None),
                               opts.kubeconfig)
    say(f"cri-shim node install, {opts.mode} mode{' (dry run: nothing is changed)' if opts.dry_run else ''}")
    say(f"kubelet: pid {kubelet.pid}, config {kubelet.config_path}, "
        f"kubeconfig {kubelet.kubeconfig or '(none: its /healthz only)'}")
    flags = _flags_to_switch(ch, kubelet, opts.mode, before)
    probe = readiness.Probe(kubelet.healthz, kubelet.kubeconfig, opts.node_name, kubelet.status_update_seconds)
    if probe.healthz is None and probe.kubeconfig is None:
        raise Refused("kubelet's healthz is off and it has no kubeconfig: nothing tells whether kubelet comes "
                      "back after the switch; pass --kubeconfig")
    why = readiness.check(host, probe, None)
    if why:
        raise Refused(f"{why}: install switches a healthy, Ready node only, so that it can tell whether it comes "
                      f"back")
    say(f"kubelet healthy: {probe.describe()}")
    if before is not None:
        upstream = before.upstream
    else:
        upstream = kubelet.image_endpoint if opts.mode == "image-only" else kubelet.runtime_endpoint
        if opts.mode == "full" and not same_endpoint(kubelet.image_endpoint, kubelet.runtime_endpoint):
            raise Refused(f"kubelet's {IMAGE_KEY} ({kubelet.image_endpoint}) is not its {RUNTIME_KEY} "
                          f"({kubelet.runtime_endpoint}): full mode puts both behind one shim; use image-only mode")
    config, config_source = _desired_config(opts, ch, upstream)
    cfg = config_mod.from_dict(safeyaml.load(config.decode()))
    switched_now = kubelet.image_endpoint if opts.mode == "image-only" else kubelet.runtime_endpoint
    if (before is None or before.kubelet is None) and same_endpoint(switched_now, cfg.listen):
        raise Refused(f"kubelet already uses {cfg.listen} (set by hand?): undo that first (docs/install.md, "
                      f"'A node, by hand')")
    try:
        runtime = host.cri_version(upstream, VERSION_CALL_TIMEOUT)
    except HostError as e:
        raise Refused(f"the runtime kubelet uses, {upstream}, does not answer Version ({e})") from None
    say(f"runtime: {upstream} answers Version: {runtime}")
    if not same_endpoint(cfg.upstream, upstream):
        say(f"note: the shim's upstream {cfg.upstream} is not the runtime kubelet uses ({upstream}); "
            f"the Version check tells whether it is the same runtime")
    unit, unit_packaged = unit_path(ch, UNIT_FILE)
    drop_in, drop_in_packaged = unit_path(ch, DROP_IN)
    keys = _kubelet_keys(opts, kubelet, cfg.listen)
    text = yamledit.decode(kubelet.config_data, kubelet.config_path)
    new = yamledit.edit(text, keys, kubelet.config_path).encode() if keys else kubelet.config_data
    return Plan(opts, before, kubelet, probe, upstream, runtime, config, config_source, cfg.listen,
                (unit, None if unit_packaged else _desired_unit(opts, ch)),
                (drop_in, None if drop_in_packaged else shipped(DROP_IN)), runtime_drop_in(runtime), keys, new,
                flags, _flag_files(ch, flags, cfg.listen))


def runtime_drop_in(runtime: Runtime) -> tuple[str, bytes] | None:
    """The shim's drop-in for a runtime whose unit the shipped unit does not name (CRI-O): the shim
    starts after it and pulls it in, as the unit does for containerd."""
    unit = RUNTIME_UNITS.get(runtime.name.lower())
    if unit is None:
        return None
    text = (f"# Written by `cri-shim node install`: the runtime behind this shim is {runtime.name}.\n"
            f"[Unit]\nAfter={unit}\nWants={unit}\n")
    return f"{UNIT_DIR}/{RUNTIME_DROP_IN}", text.encode()


def _flags_to_switch(ch: Changes, kubelet: Kubelet, mode: str, before: State | None) -> list[Place]:
    """The endpoint flags of the mode kubelet runs with, each where it is set: one place in one of
    kubelet's flags files, or Refused. A ``--config-dir`` drop-in setting an endpoint key: Refused."""
    flags = [f for f in ([IMAGE_FLAG] + ([RUNTIME_FLAG] if mode == "full" else [])) if f in kubelet.flags]
    found = []
    if flags:
        exec_start = ch.query("show", kubelet_mod.UNIT, "-p", "ExecStart", "--value")
        files = ch.query("show", kubelet_mod.UNIT, "-p", "EnvironmentFiles", "--value")
        if exec_start.rc != 0 or files.rc != 0:
            raise Refused(f"kubelet runs with {', '.join(flags)}, and systemd does not say where from "
                          f"(systemctl show {kubelet_mod.UNIT}: {(exec_start.err or files.err).strip()})")
        record = before.kubelet if before is not None else None
        for flag in flags:
            ours = next((f.flags[flag][1] for f in record.flag_files if flag in f.flags), None) if record else None
            place = flagfile.locate(ch.root, flag, kubelet.argv, flagfile.exec_words(exec_start.out),
                                    flagfile.env_files(files.out), ours)
            ch.say(f"kubelet's {flag} is set in {place}: switched there (a flag beats {kubelet.config_path})")
            found.append(place)
    for key in (IMAGE_KEY, RUNTIME_KEY) if mode == "full" else (IMAGE_KEY,):
        drop_ins = kubelet.endpoint_overrides(key)
        if drop_ins:
            raise Refused(f"{', '.join(drop_ins)} (kubelet's --config-dir) sets {key}, which beats "
                          f"{kubelet.config_path}: remove it there, restart kubelet and run install again")
    return found


def _flag_files(ch: Changes, flags: list[Place], listen: str) -> dict[str, tuple[bytes, bytes]]:
    """Each flags file with its endpoint flags set to ``listen``: path -> (bytes now, bytes then)."""
    if flags and not flagfile.writable(listen):
        raise Refused(f"the shim's listen {listen!r} cannot be written into {flags[0].path} as it is "
                      f"(quotes, spaces, $ or escapes)")
    out: dict[str, tuple[bytes, bytes]] = {}
    for path in dict.fromkeys(p.path for p in flags):
        data = ch.read(path) or b""
        text = flagfile.decode(data)
        if any(text[p.start:p.end] != p.value for p in flags if p.path == path):
            raise Refused(f"{path} changed while install read it: run install again")
        text = flagfile.replace(text, [(p, listen) for p in flags if p.path == path])
        out[path] = (data, flagfile.encode(text))
    return out


def _desired_config(opts: Options, ch: Changes, upstream: str) -> tuple[bytes, str]:
    """The shim config to have in place, and where it comes from."""
    if opts.config is not None:
        try:
            data = Path(opts.config).read_bytes()
        except OSError as e:
            raise Refused(f"--config {opts.config}: {e.strerror}") from None
        try:
            config_mod.load(opts.config)
        except ConfigError as e:
            raise Refused(f"--config {opts.config}: {e}") from None
        return data, f"from {opts.config}"
    current = ch.read(SHIM_CONFIG)
    if current is not None:
        try:
            config_mod.load(ch.at(SHIM_CONFIG))
        except ConfigError as e:
            raise Refused(f"{SHIM_CONFIG} (in place) does not validate: {e}; fix it or pass --config") from None
        return current, "the one in place"
    text = yamledit.decode(shipped("config.example.yaml"), "config.example.yaml")
    if yamledit.parse(text, "config.example.yaml").get("upstream") != upstream:
        text = yamledit.edit(text, {"upstream": yamledit.render(upstream)}, "config.example.yaml")
    return text.encode(), f"the shipped config.example.yaml, upstream {upstream}"


def _desired_unit(opts: Options, ch: Changes) -> bytes:
    """The shipped unit, its ExecStart= naming the cri-shim program of this node."""
    unit = shipped(UNIT_FILE).decode()
    exe = opts.executable
    if exe is None:
        exe = SHIPPED_EXECUTABLE if ch.at(SHIPPED_EXECUTABLE).exists() else opts.running
    if exe is None:
        raise Refused(f"no {SHIPPED_EXECUTABLE}, and which cri-shim program runs this is unknown: "
                      f"pass --executable")
    old = f"ExecStart={SHIPPED_EXECUTABLE} "
    if exe != SHIPPED_EXECUTABLE:
        if unit.count(old) != 1:
            raise Refused(f"the shipped {UNIT_FILE} has no one '{old}...' line to point at {exe}")
        unit = unit.replace(old, f"ExecStart={exe} ")
    return unit.encode()


def _kubelet_keys(opts: Options, kubelet: Kubelet, listen: str) -> dict[str, str]:
    """The mode's snippet of kubelet settings, endpoints pointed at ``listen``: key -> value as
    written, for the keys whose value is not that already."""
    snippet = yaml.safe_load(shipped(MODES[opts.mode]))
    keys: dict[str, str] = {}
    for key, value in snippet.items():
        if key in ("apiVersion", "kind") or (key in PULL_SETTINGS and not opts.pull_settings):
            continue
        if key == RUNTIME_KEY and opts.mode == "image-only":
            continue  # kubelet's runtime endpoint stays as it is
        if key == IMAGE_KEY and opts.mode == "full" and not kubelet.settings.get(IMAGE_KEY):
            continue  # absent or empty already means "the runtime endpoint": the shim
        if {IMAGE_KEY: IMAGE_FLAG, RUNTIME_KEY: RUNTIME_FLAG}.get(key) in kubelet.flags:
            continue  # set by its flag, in the flags file, instead: the key would change nothing
        if key == (IMAGE_KEY if opts.mode == "image-only" else RUNTIME_KEY):
            value = listen
        if kubelet.settings.get(key, object()) != value:
            keys[key] = yamledit.render(value)
    return keys


# ---------------------------------------------------------------------------------- the changes

def _apply(plan: Plan, progress: _Progress, ch: Changes, host: Host, say: Say) -> None:
    opts = plan.opts
    progress.shim_was_active = is_active(ch, SHIM_UNIT)
    progress.shim_was_enabled = ch.query("is-enabled", "--quiet", SHIM_UNIT).rc == 0
    # 2. files, the shim started
    ch.makedirs(state.BACKUP_DIR, mode=0o700)  # /var/lib/cri-shim: 0700, as the unit's StateDirectory=
    progress.config_changed = _put(progress, ch, SHIM_CONFIG, plan.config,
                                   f"the shim's config ({plan.config_source})")
    units_changed = False
    for (path, data), what in ((plan.unit, "the shim's unit (the shipped cri-shim.service)"),
                               (plan.drop_in, "kubelet drop-in: Wants=/After=cri-shim.service")):
        if data is None:
            say(f"{path}: shipped by the package, used as it is")
        else:
            units_changed = _put(progress, ch, path, data, what) or units_changed
    if plan.runtime_drop_in is not None:
        path, data = plan.runtime_drop_in
        ch.makedirs(path.rsplit("/", 1)[0])
        what = f"the shim's drop-in: Wants=/After= the runtime's unit ({plan.runtime.name})"
        units_changed = _put(progress, ch, path, data, what) or units_changed
    if units_changed:
        progress.units_changed = True
        ch.systemctl("daemon-reload")
    if not progress.shim_was_enabled:
        ch.systemctl("enable", SHIM_UNIT)
        progress.enabled = True
        progress.state.enabled = True
    if not progress.shim_was_active:
        ch.systemctl("start", SHIM_UNIT)
        progress.started = True
    elif progress.config_changed or units_changed:
        ch.systemctl("restart", SHIM_UNIT)
        progress.started = True
    # 3. the shim answers for the runtime kubelet uses
    if ch.dry_run:
        say(f"would check: Version through {plan.listen} answers {plan.runtime} (within {opts.shim_timeout:g} s)")
    else:
        _check_shim(plan, host, say)
    # 4, 5. kubelet
    _switch_kubelet(plan, progress, ch, host, say)
    if ch.dry_run:
        say("dry run: nothing was changed")
        return
    _save(progress, ch)
    if not (progress.config_changed or units_changed or progress.enabled or progress.started
            or progress.kubelet_restarted):
        say(f"nothing to change: cri-shim is installed ({opts.mode} mode) and kubelet uses {plan.listen}")
    else:
        calls = "image calls" if opts.mode == "image-only" else "CRI calls"
        say(f"done: kubelet's {calls} go through cri-shim ({plan.listen}); undo: cri-shim node uninstall")


def _save(progress: _Progress, ch: Changes) -> None:
    """state.json as the run has it now (its first write is a change of the dry run too)."""
    s = progress.state
    s.dirs += [d for d in ch.made_dirs if d not in s.dirs]
    data = (json.dumps(s.to_json(), indent=1, sort_keys=True) + "\n").encode()
    if ch.dry_run and progress.state_written:
        return
    ch.write(state.STATE_FILE, data, "what install did, for uninstall", mode=0o600, bookkeeping=True)
    progress.state_written = True


def _put(progress: _Progress, ch: Changes, path: str, data: bytes, what: str) -> bool:
    """Write a file of the shim's, keeping a copy of what was there before the first install."""
    old = ch.read(path)
    if old == data:
        return False
    rec = progress.state.file(path)
    if rec is None:
        backup = None
        if old is not None:
            backup = state.backup_path(path)
            ch.write(backup, old, f"copy of {path} as it was, for uninstall", mode=0o600, show=False)
        rec = FileRecord(path, backup, "")
        progress.state.files.append(rec)
    rec.sha256 = state.sha256(data)
    _save(progress, ch)  # before the file: a run cut short is undone by uninstall
    return ch.write(path, data, what)


def _check_shim(plan: Plan, host: Host, say: Say) -> None:
    deadline = host.monotonic() + plan.opts.shim_timeout
    while True:
        try:
            got = host.cri_version(plan.listen, VERSION_CALL_TIMEOUT)
        except HostError as e:
            if host.monotonic() >= deadline:
                raise HostError(f"the shim does not answer Version on {plan.listen} within "
                                f"{plan.opts.shim_timeout:g} s ({e})") from None
            host.sleep(0.5)
            continue
        if (got.name, got.version) != (plan.runtime.name, plan.runtime.version):
            raise HostError(f"Version through the shim answers {got}, not {plan.runtime} (the runtime kubelet "
                            f"uses, at {plan.upstream}): check `upstream` in {SHIM_CONFIG}")
        say(f"checked: Version through {plan.listen} answers {got}")
        return


def _switch_kubelet(plan: Plan, progress: _Progress, ch: Changes, host: Host, say: Say) -> None:
    k = plan.kubelet
    record = progress.state.kubelet
    config_changes = plan.kubelet_config != k.config_data
    flag_changes = {path: (old, new) for path, (old, new) in plan.flag_files.items() if old != new}
    if not config_changes and not flag_changes and record is not None and record.confirmed:
        return  # switched and confirmed by an earlier run
    if config_changes or flag_changes:
        if record is None:
            record = KubeletRecord(k.config_path, edited.keep_copy(ch, k.config_path, k.config_data),
                                   state.sha256(k.config_data), "", {})
            progress.state.kubelet = record
        if config_changes:
            _record_keys(plan, record)
        for path, (old, new) in flag_changes.items():
            _record_flags(plan, record, path, old, new, ch)
        record.confirmed = False
        _save(progress, ch)  # before kubelet's files: a run cut short is undone by uninstall
        if config_changes:
            ch.write(k.config_path, plan.kubelet_config,
                     "kubelet's config: " + ", ".join(f"{key}: {v}" for key, v in plan.kubelet_keys.items()))
            progress.kubelet_written = True
        for path, (_, new) in flag_changes.items():
            ch.write(path, new, "kubelet's flags: " + ", ".join(f"{p.flag}={plan.listen}" for p in plan.flags
                                                               if p.path == path))
            progress.flag_files_written.append(path)
    # else: written by a run cut short before kubelet was back: restart and check again
    since = host.wall()
    ch.systemctl("restart", kubelet_mod.UNIT)
    progress.kubelet_restarted = True
    if ch.dry_run:
        say(f"would wait up to {plan.opts.ready_timeout:g} s for {plan.probe.describe()}")
        return
    _check_flags(plan, ch, host)
    why, took = readiness.wait(host, plan.probe, since, plan.opts.ready_timeout)
    if why:
        raise HostError(f"kubelet not back within {plan.opts.ready_timeout:g} s of the switch: {why}")
    say(f"checked: kubelet back after {took:.1f} s: {plan.probe.describe()}")
    assert record is not None
    record.confirmed = True


def _record_keys(plan: Plan, record: KubeletRecord) -> None:
    """What install sets in kubelet's config file."""
    k = plan.kubelet
    found = yamledit.entries(yamledit.decode(k.config_data, k.config_path), k.config_path)
    sets = {key: (found[key].raw if key in found else None, value) for key, value in plan.kubelet_keys.items()}
    edited.record(record, record.keys, k.config_data, plan.kubelet_config, sets)


def _record_flags(plan: Plan, record: KubeletRecord, path: str, old: bytes, new: bytes, ch: Changes) -> None:
    """What install sets in the flags file ``path`` (``old`` -> ``new``), its copy kept the first time."""
    rec = record.flag_file(path)
    if rec is None:
        rec = FlagRecord(path, edited.keep_copy(ch, path, old), state.sha256(old), "", {})
        record.flag_files.append(rec)
    sets = {p.flag: (p.value, plan.listen) for p in plan.flags if p.path == path}
    edited.record(rec, rec.flags, old, new, sets)


def _check_flags(plan: Plan, ch: Changes, host: Host) -> None:
    """The restarted kubelet runs with the endpoint flags install set (its unit reads the flags file)."""
    if not plan.flags:
        return
    pid = main_pid(ch, kubelet_mod.UNIT)
    argv = host.command_line(pid) if pid > 0 else None
    now = parse_flags(argv or [])
    for p in plan.flags:
        if not same_endpoint(now.get(p.flag, ""), plan.listen):
            raise HostError(f"kubelet restarted with {p.flag}={now.get(p.flag, '(none)')}, not {plan.listen} as "
                            f"set in {p.path}: its unit did not read that file as install expected")


# ---------------------------------------------------------------------------------- the way back

def _roll_back(plan: Plan, progress: _Progress, ch: Changes, host: Host, say: Say) -> None:
    say("switching back: every change of this run is undone")
    k = plan.kubelet
    try:
        if progress.kubelet_written:
            ch.put_back(k.config_path)
        for path in progress.flag_files_written:
            ch.put_back(path)
        if progress.kubelet_restarted:
            since = host.wall()
            ch.systemctl("restart", kubelet_mod.UNIT)
            why, took = readiness.wait(host, plan.probe, since, max(plan.opts.ready_timeout, SWITCH_BACK_WAIT))
            say(f"kubelet back on its own config after {took:.1f} s" if not why else f"kubelet not back yet: {why}")
        if progress.started and not progress.shim_was_active:
            lines = journal_tail(host, SHIM_UNIT) if not progress.kubelet_written else []
            if lines:
                say(f"{SHIM_UNIT}'s last journal lines:")
                for line in lines:
                    say("    " + line)
            ch.systemctl("stop", SHIM_UNIT)
        if progress.enabled:  # while its unit file is there: disable removes the links to it
            ch.systemctl("disable", SHIM_UNIT)
        made_state_dir = SHIM_STATE_DIR in ch.made_dirs
        ch.put_back(purge=(SHIM_STATE_DIR,) if made_state_dir else ())
        if progress.units_changed:
            ch.systemctl("daemon-reload")
        if progress.started and progress.shim_was_active:
            ch.systemctl("restart", SHIM_UNIT)
    except (HostError, OSError) as e:
        say(f"could not switch everything back: {e}; `cri-shim node uninstall` undoes what is left")
        return
    data = ch.read(k.config_path)
    said = "as it was, byte for byte" if data == k.config_data else "CHANGED (see above)"
    for path, (old, _) in plan.flag_files.items():
        say(f"switched back: kubelet's flags file {path} is "
            f"{'as it was, byte for byte' if ch.read(path) == old else 'CHANGED (see above)'}")
    say(f"switched back: kubelet's config {k.config_path} is {said}")
