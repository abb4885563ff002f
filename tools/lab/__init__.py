"""Lab tools: measurements that name where a step's costs go (docs/performance.md)."""

from __future__ import annotations

from typing import Any


def next_result(processes: Any, results: Any) -> Any:
    """The next item a process of the group (torch.multiprocessing's ProcessContext) put on
    ``results`` (a SimpleQueue), read while they run (a big item blocks its writer until it is
    read); where one of them fails first, its error; never a hang."""
    while results.empty():
        if processes.join(timeout=0.2):  # all ended (raises if one failed)
            raise RuntimeError("the processes ended without a result")
    return results.get()
