"""Cases for tests/test_spmd_harness.py: a rank that hangs and a rank that crashes."""

import faulthandler
import threading


def reset_state() -> None:
    pass


class HarnessCases:
    def __init__(self, rank: int, world_size: int):
        self.rank = rank

    def test_one_rank_hangs_and_one_crashes(self):
        if self.rank == 1:
            threading.Event().wait()  # never set: this line must show in the report
        if self.rank == 2:
            faulthandler._sigsegv()
