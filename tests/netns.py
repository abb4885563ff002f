"""Processes on the separate 'hosts' of tools/netns.py, for the multi-host tests."""

from __future__ import annotations

import subprocess
import sys

from tools.netns import SUBNET, Unavailable, bridged_hosts, sh

__all__ = ["SUBNET", "Unavailable", "bridged_hosts", "outputs_of", "sh", "start_in"]


def start_in(namespace: str, args: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
    """This Python running ``args`` on host ``namespace``, its output captured as text."""
    return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outputs_of(processes: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ended, waiting ``timeout`` seconds for each in
    turn; whatever still runs when this returns or raises (a timeout) is killed, so no
    process outlives its test (deleting a namespace does not end its processes)."""
    try:
        return [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
