"""Giving the shim's socket its name (shim/process/unixsock.py): bound under a hidden name beside
the path, then linked, never over a socket another process made meanwhile."""

from __future__ import annotations

import os
import socket

import pytest

from shim.process.unixsock import StartupError, publish, staging_path


def _bound(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    return s


def test_publish_links_the_staged_socket_and_drops_the_staging_name(short_tmp) -> None:
    path = str(short_tmp / "s.sock")
    tmp = staging_path(path)
    assert os.path.dirname(tmp) == str(short_tmp) and os.path.basename(tmp).startswith(".")
    with _bound(tmp):
        publish(tmp, path)
        assert not os.path.exists(tmp)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(path)  # the same listening socket, under its real name


def test_publish_never_replaces_a_socket_another_process_made(short_tmp) -> None:
    path = str(short_tmp / "s.sock")
    tmp = staging_path(path)
    with _bound(path) as other, _bound(tmp):
        before = os.stat(path).st_ino
        with pytest.raises(StartupError, match="another process listens there"):
            publish(tmp, path)
        assert os.stat(path).st_ino == before  # still the other process's socket
        assert not os.path.exists(tmp)
        other.close()


def test_a_path_too_long_for_a_staging_name_is_bound_as_it_is(short_tmp) -> None:
    path = str(short_tmp / ("x" * (107 - len(str(short_tmp)) - 1)))
    assert len(path.encode()) == 107
    assert staging_path(path) == path
    publish(path, path)  # nothing to link
