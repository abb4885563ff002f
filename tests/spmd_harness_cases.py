"""Cases for tests/system/test_spmd_harness.py: a rank that hangs and a rank that crashes."""

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

    def test_rank_0_fails_before_its_rpc_shutdown(self):
        import zmqautograd.rpc as rpc

        rpc.init_rpc(f"worker{self.rank}", rank=self.rank, world_size=4, rpc_backend_options=self.rpc_backend_options)
        if self.rank == 0:
            raise ValueError("rank 0 failed before its shutdown")
        rpc.shutdown()  # waits at the shutdown barrier for rank 0
