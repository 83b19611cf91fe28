"""``cri-shim node uninstall``: undo what ``cri-shim node install`` did, from its state file,
in the order that never points kubelet at a socket that is going away.

1. kubelet's config file back: its bytes from before install, byte for byte, when it is as
   install left it; when someone changed it since, only the keys install set go back to their
   values before (the rest of their change stays, and that is said). The same for each flags
   file install set an endpoint flag in (only the flag's value goes back, when it changed since):
   ``edited.put_back``. kubelet restarted and waited for (healthy, Node Ready) when it runs and
   one of those files is not as it was before install, or its command line names the shim's
   socket (a flags file put back by someone else since kubelet started).
2. Then, and only then, the shim stops (and is disabled if install enabled it): its pins are
   given up from this moment, and the images it kept pinned that the runtime does not are named.
3. Every file install wrote: put back as it was, or removed when install added it;
   ``daemon-reload``; the directories install made, removed (``/var/lib/cri-shim`` with the
   shim's state files in it, when install made it).

The state file is rewritten after each step, so a run cut short is finished by the next;
once it is gone, uninstall has nothing to do and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import edited, flagfile, readiness, state, yamledit
from . import kubelet as kubelet_mod
from .changes import Changes, Say
from .host import Host, HostError
from .install import EXIT_OK, EXIT_REFUSED, EXIT_ROLLED_BACK, SHIM_STATE_DIR, SHIM_UNIT, is_active, locked, main_pid
from .kubelet import Refused
from .state import FlagRecord, KubeletRecord, State
from .yamledit import EditError

#: how many of the images whose pin is given up are named
NAMED_PINS = 10
#: how what uninstall says names the files of kubelet's that install edited
CONFIG = edited.Kind("kubelet's config", "kubelet's config", "it was", "keys")
FLAGS = edited.Kind("kubelet's flags file", "kubelet's flags", "they were", "flags")


@dataclass(frozen=True)
class Options:
    kubeconfig: str | None = None  #: None: kubelet's --kubeconfig, else kubeadm's; "": none
    node_name: str | None = None  #: None: the kubeconfig's kubelet identity
    ready_timeout: float = 120.0
    dry_run: bool = False


def uninstall(opts: Options, root: Path, host: Host, say: Say) -> int:
    return locked(root, host, say, opts.dry_run, lambda ch: _uninstall(opts, ch, host, say))


def _uninstall(opts: Options, ch: Changes, host: Host, say: Say) -> int:
    try:
        st = state.load(str(ch.at(state.STATE_FILE)))
    except ValueError as e:
        say(f"refused, nothing changed: {e}")
        return EXIT_REFUSED
    if st is None:
        say(f"nothing to undo: no {state.STATE_FILE} (`cri-shim node install` did not run here, or this was "
            f"undone already)")
        return EXIT_OK
    say(f"cri-shim node uninstall, {st.mode} mode{' (dry run: nothing is changed)' if opts.dry_run else ''}")
    status = EXIT_OK
    try:
        if st.kubelet is not None:
            if not _kubelet_back(opts, st.kubelet, st.listen, ch, host, say):
                status = EXIT_ROLLED_BACK
            st.kubelet = None
            _save(st, ch)
        _stop_shim(st, ch, host, say)
        _files_back(st, ch)
    except (HostError, OSError, EditError) as e:
        say(f"failed: {e}; what is done stays done, and running `cri-shim node uninstall` again goes on from here")
        return EXIT_ROLLED_BACK
    if opts.dry_run:
        say("dry run: nothing was changed")
    else:
        say("uninstalled: cri-shim is off this node" + ("" if status == EXIT_OK else ", but kubelet is not back yet"))
    return status


def _save(st: State, ch: Changes) -> None:
    if not ch.dry_run:
        data = (json.dumps(st.to_json(), indent=1, sort_keys=True) + "\n").encode()
        ch.write(state.STATE_FILE, data, "what is left to undo", mode=0o600, bookkeeping=True)


def _kubelet_back(opts: Options, rec: KubeletRecord, listen: str, ch: Changes, host: Host, say: Say) -> bool:
    """kubelet's config (and flags files) as it was, kubelet restarted: whether it came back (True when
    not restarted). Restarted when a file is not as it was before install, or when the running kubelet
    has an endpoint flag naming the shim's socket (``listen``): its flags file was put back by someone
    else (``kubeadm upgrade node``) and kubelet not restarted since."""
    changed = edited.put_back(ch, rec.config, rec, CONFIG, partial(_keys_back, rec, say=say))
    for f in rec.flag_files:
        changed = edited.put_back(ch, f.path, f, FLAGS, partial(_flags_back, f, say=say)) or changed
    if not changed and not _runs_on(listen, ch, host):
        return True
    if not changed:
        say(f"kubelet runs with an endpoint flag naming {listen}, from its flags file as it was when kubelet "
            f"started: kubelet is restarted on its flags as they are now")
    if not is_active(ch, kubelet_mod.UNIT):
        say(f"{kubelet_mod.UNIT} is not running: it reads its config as it is now when it starts")
        return True
    probe = _probe(opts, rec, ch, host)
    since = host.wall()
    ch.systemctl("restart", kubelet_mod.UNIT)
    if ch.dry_run:
        say(f"would wait up to {opts.ready_timeout:g} s for {probe.describe()}")
        return True
    why, took = readiness.wait(host, probe, since, opts.ready_timeout)
    if why:
        say(f"kubelet not back within {opts.ready_timeout:g} s: {why}")
        return False
    say(f"checked: kubelet back on its own config after {took:.1f} s: {probe.describe()}")
    return True


def _runs_on(listen: str, ch: Changes, host: Host) -> bool:
    """The running kubelet has an endpoint flag naming ``listen`` on its command line."""
    pid = main_pid(ch, kubelet_mod.UNIT)
    flags = kubelet_mod.parse_flags((host.command_line(pid) if pid > 0 else None) or [])
    return any(f in flags and kubelet_mod.same_endpoint(flags[f], listen)
               for f in (kubelet_mod.IMAGE_FLAG, kubelet_mod.RUNTIME_FLAG))


def _keys_back(rec: KubeletRecord, current: bytes, say: Say) -> bytes:
    """kubelet's config changed since install: each key install set back to its value before, if it
    still has the value install wrote."""
    text = yamledit.decode(current, rec.config)
    found = yamledit.entries(text, rec.config)
    changes: dict[str, str | None] = {}
    for key, (before, after) in rec.keys.items():
        now = found.get(key)
        if now is not None and now.raw == after:
            changes[key] = before if before is not None else yamledit.REMOVE
        else:
            say(f"left {key} in {rec.config} as it is ({now.raw if now else 'absent'}): not what install wrote")
    return yamledit.edit(text, changes, rec.config).encode()


def _flags_back(rec: FlagRecord, current: bytes, say: Say) -> bytes:
    """A flags file changed since install: each flag install set back to its value before, where it
    still has the value install wrote."""
    text = flagfile.decode(current)
    edits = []
    for flag, (before, after) in rec.flags.items():
        mine = [p for p in flagfile.every_place(rec.path, text, flag) if p.value == after]
        if not mine:
            say(f"left {flag} in {rec.path} as it is: not what install wrote ({after})")
        edits += [(p, before) for p in mine]
    return flagfile.encode(flagfile.replace(text, edits))


def _probe(opts: Options, rec: KubeletRecord, ch: Changes, host: Host) -> readiness.Probe:
    pid = main_pid(ch, kubelet_mod.UNIT)
    try:
        k = kubelet_mod.find(ch.root, pid, host.command_line(pid) if pid > 0 else None, rec.config, opts.kubeconfig)
        return readiness.Probe(k.healthz, k.kubeconfig, opts.node_name, k.status_update_seconds)
    except Refused:
        return readiness.Probe(("127.0.0.1", 10248), opts.kubeconfig or None, opts.node_name)


def _stop_shim(st: State, ch: Changes, host: Host, say: Say) -> None:
    if is_active(ch, SHIM_UNIT):
        pins = _pins_given_up(st, host)
        ch.systemctl("stop", SHIM_UNIT)
        if pins is None:
            say("the shim is stopped: whatever it kept pinned is not protected any more")
        elif not pins:
            say("the shim is stopped: it kept no image pinned that the runtime does not pin itself")
        else:
            named = ", ".join(pins[:NAMED_PINS]) + (f" and {len(pins) - NAMED_PINS} more" if len(pins) > NAMED_PINS
                                                    else "")
            say(f"the shim is stopped: its pins are given up; kubelet's image GC may now remove the {len(pins)} "
                f"image(s) it kept: {named}")
    if st.enabled:
        ch.systemctl("disable", SHIM_UNIT)
        st.enabled = False
        _save(st, ch)


def _pins_given_up(st: State, host: Host) -> list[str] | None:
    """The images the shim marks pinned and the runtime does not: what stops being protected."""
    try:
        through_shim = host.pinned_images(st.listen, 10.0)
        runtime = host.pinned_images(st.upstream, 10.0)
    except HostError:
        return None
    return sorted((tags[0] if tags else image_id) for image_id, tags in through_shim.items() if image_id not in runtime)


def _files_back(st: State, ch: Changes) -> None:
    units = False
    for rec in reversed(st.files):
        if rec.backup is not None:
            original = ch.read(rec.backup)
            if original is None:
                ch.say(f"left {rec.path}: its copy from before install ({rec.backup}) is gone")
                continue
            ch.write(rec.path, original, "as it was before install")
        else:
            ch.remove(rec.path, "added by install")
        units = units or rec.path.startswith(("/etc/systemd/", "/usr/lib/systemd/", "/lib/systemd/"))
    if units:
        ch.systemctl("daemon-reload")
    st.files = []
    _save(st, ch)
    backups = ch.at(state.BACKUP_DIR)
    for f in sorted(backups.iterdir()) if backups.is_dir() else []:
        ch.remove(f"{state.BACKUP_DIR}/{f.name}", "copy kept for uninstall")
    ch.remove(state.STATE_FILE, "what install did")
    for d in reversed(st.dirs):
        ch.remove_dir(d, recursive=d == SHIM_STATE_DIR)

