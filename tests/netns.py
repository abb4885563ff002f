"""Processes on the separate 'hosts' of tools/netns.py, for the multi-host tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from tools.netns import SUBNET, Unavailable, bridged_hosts, sh

__all__ = ["SUBNET", "Unavailable", "bridged_hosts", "outputs_of", "sh", "start_in"]


def start_in(namespace: str, args: list[str], env: dict[str, str], cwd: str,
             own_pid_namespace: bool = False) -> subprocess.Popen:
    """This Python running ``args`` on host ``namespace``, its output captured as text. With
    ``own_pid_namespace``, in a pid namespace of its own as well (``unshare``), as on another
    machine: no peer can read its memory, so nothing is lent or put in a ring to it. Its
    own session either way, so that ending it ends what ``unshare`` forked."""
    unshare = ["unshare", "--pid", "--fork"] if own_pid_namespace else []
    return subprocess.Popen(["ip", "netns", "exec", namespace, *unshare, sys.executable, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def outputs_of(processes: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ended, waiting ``timeout`` seconds for each in
    turn; whatever still runs when this returns or raises (a timeout) is killed, so no
    process outlives its test (deleting a namespace does not end its processes)."""
    try:
        return [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its session: unshare's child too
