"""Ports of torch's faulty-agent tests (faulty_agent_rpc_test.py, and the seed's
FaultyAgentDistAutogradTest) to zmqautograd's fault injection. Run by
tests/upstream/test_faulty_agent.py on 4 worker processes (tests/spmd.py).

The group's options mirror torch's FaultyRpcAgentTestFixture: 8 threads, the first 3 sends of
each retryable message type fail, Python (and builtin, "SCRIPT_CALL") calls are delayed 1.5 s.
``@options(...)`` stands for torch's ``dist_init(faulty_messages=..., messages_to_delay=...)``.
"""

# ruff: noqa
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc

from . import dist_autograd_cases as base
from .dist_autograd_cases import SpmdCase, _all_contexts_cleaned_up, _set_rpc_done, worker_name

RETRYABLE = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE", "CLEANUP_AUTOGRAD_CONTEXT_REQ"]
DEFAULT_DELAYS = {"PYTHON_CALL": 1.5, "SCRIPT_CALL": 1.5}
GROUP_OPTIONS = {"num_worker_threads": 8, "num_fail_sends": 3, "messages_to_fail": RETRYABLE,
                 "messages_to_delay": DEFAULT_DELAYS}


def options(faulty_messages=None, messages_to_delay=None):
    def mark(test):
        own = {}
        if faulty_messages is not None:
            own["messages_to_fail"] = faulty_messages
        if messages_to_delay is not None:
            own["messages_to_delay"] = messages_to_delay
        test._options = own
        return test

    return mark


def reset_state():
    base.reset_state()


def my_sleep_func(seconds=1):
    import time

    time.sleep(seconds)
    return torch.mul(torch.tensor(1), torch.tensor(1))


@torch.jit.script
def my_script_func(tensor):
    return torch.add(tensor, tensor)


def add_rref_to_value(rref, value):
    return rref.to_here() + value


class FaultyCase(SpmdCase):
    @property
    def rpc_backend_options(self):
        return rpc.api._current().options

    def assert_faults_injected(self):
        self.assertIsNotNone(rpc.api._current().endpoint.faults)

    def get_timeout_error_regex(self):
        return "RPC ran for more than"


class FaultyAgentDistAutogradTest(FaultyCase):
    def context_cleanup_test_helper(self, rpc_args, func):
        dst_ranks = {rank for rank in range(self.world_size) if rank != self.rank}
        with dist_autograd.context() as context_id:
            for dst_rank in dst_ranks:
                rpc.rpc_sync(worker_name(dst_rank), func, args=rpc_args)
                rpc.rpc_sync(worker_name(dst_rank), _set_rpc_done, args=(context_id, 1))
        # the thread's context id should be cleaned up
        with self.assertRaises(RuntimeError):
            dist_autograd._retrieve_context(context_id)
        import torch.distributed as dist

        dist.barrier()
        # Cleanup messages fail 3 times each and are retried: every context still goes.
        self.assertTrue(_all_contexts_cleaned_up())
        injected = rpc.api._current().endpoint.faults.injected["failed"]
        self.assertGreaterEqual(injected, 3)

    def test_context_cleanup_tensor_with_grad(self):
        t1 = torch.ones(3, 3, requires_grad=True)
        t2 = torch.zeros(3, 3, requires_grad=True)
        self.context_cleanup_test_helper(rpc_args=(t1, t2), func=torch.add)

    def test_verify_backend_options(self):
        self.assert_faults_injected()
        self.assertEqual(self.rpc_backend_options.num_worker_threads, 8)
        self.assertEqual(self.rpc_backend_options.num_fail_sends, 3)
        self.assertEqual(len(self.rpc_backend_options.messages_to_fail), 4)


class FaultyAgentRpcTest(FaultyCase):
    @options(messages_to_delay={})
    def test_check_failed_messages(self):
        # RRef forks to a third worker: RREF_FORK_REQUEST and RREF_CHILD_ACCEPT fail 3 times
        # each and are retried; the deletions too.
        if self.rank == 0:
            dst_worker_b = worker_name((self.rank + 1) % self.world_size)
            dst_worker_c = worker_name((self.rank + 2) % self.world_size)
            rref = rpc.remote(dst_worker_b, torch.add, args=(torch.ones(2, 2), torch.ones(2, 2)))
            rpc.remote(dst_worker_c, add_rref_to_value, args=(rref, torch.ones(2, 2)))
            self.assertEqual(rref.to_here(), torch.add(torch.ones(2, 2), torch.ones(2, 2)))

    def test_verify_backend_options(self):
        self.assert_faults_injected()
        self.assertEqual(self.rpc_backend_options.num_worker_threads, 8)
        self.assertEqual(self.rpc_backend_options.num_fail_sends, 3)
        self.assertEqual(len(self.rpc_backend_options.messages_to_fail), 4)
        self.assertEqual(len(self.rpc_backend_options.messages_to_delay), 2)
        self.assertEqual(self.rpc_backend_options.rpc_timeout, rpc.DEFAULT_RPC_TIMEOUT_SEC)

    @options(faulty_messages=["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT"])
    def test_custom_faulty_messages(self):
        self.assertEqual({"RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT"}, set(self.rpc_backend_options.messages_to_fail))

    @options(faulty_messages=[])
    def test_no_faulty_messages(self):
        self.assertEqual(len(self.rpc_backend_options.messages_to_fail), 0)

    @options(messages_to_delay={"SCRIPT_CALL": 1.5})
    def test_custom_messages_to_delay(self):
        self.assertEqual(self.rpc_backend_options.messages_to_delay, {"SCRIPT_CALL": 1.5})

    # torch waits here for the failed remote() to settle
    # (wait_until_pending_futures_and_users_flushed); a send that fails on purpose fails at
    # once here, so there is nothing to wait for. torch's ``rref._serialize()`` check is the
    # same as passing the RRef in a call, which is kept.
    def _test_remote_message_dropped_pickle(self, dst=None):
        if self.rank != 0:
            return
        dst_rank = dst if dst is not None else (self.rank + 1) % self.world_size
        dst_worker = f"worker{dst_rank}"
        rref = rpc.remote(dst_worker, my_sleep_func, args=(1,))
        with self.assertRaisesRegex(RuntimeError, "RRef creation"):
            rpc.rpc_async(dst_worker, add_rref_to_value, args=(rref, 1))
        # The call that could not be encoded is not left pending (shutdown would wait for it).
        self.assertEqual(rpc.api._current().outstanding(), 0)

    @options(faulty_messages=["PYTHON_REMOTE_CALL"])
    def test_remote_message_dropped_pickle(self):
        self._test_remote_message_dropped_pickle()

    @options(faulty_messages=["PYTHON_REMOTE_CALL"])
    def test_remote_message_dropped_pickle_to_self(self):
        self._test_remote_message_dropped_pickle(self.rank)

    def _test_remote_message_dropped_timeout(self, func, args, dst=None):
        if self.rank != 0:
            return
        dst_rank = dst if dst is not None else (self.rank + 1) % self.world_size
        dst_worker = f"worker{dst_rank}"
        rref = rpc.remote(dst_worker, func, args=args)
        with self.assertRaisesRegex(RuntimeError, "RRef creation"):
            rref.to_here()

    @options(faulty_messages=["SCRIPT_REMOTE_CALL"])
    def test_builtin_remote_message_dropped_timeout(self):
        self._test_remote_message_dropped_timeout(torch.add, (torch.tensor(1), torch.tensor(1)))

    @options(faulty_messages=["SCRIPT_REMOTE_CALL"])
    def test_builtin_remote_message_dropped_timeout_to_self(self):
        self._test_remote_message_dropped_timeout(torch.add, (torch.tensor(1), torch.tensor(1)), dst=0)

    @options(faulty_messages=["PYTHON_REMOTE_CALL"])
    def test_udf_remote_message_dropped_timeout(self):
        self._test_remote_message_dropped_timeout(my_sleep_func, (2,))

    @options(faulty_messages=["PYTHON_REMOTE_CALL"])
    def test_udf_remote_message_dropped_timeout_to_self(self):
        self._test_remote_message_dropped_timeout(my_sleep_func, (2,), dst=0)

    def _test_remote_message_delay_timeout(self, func, args, dst=None):
        if self.rank != 0:
            return
        # The remote() message is delayed 2 s: a 1 ms timeout fails the RRef's creation.
        dst_rank = dst if dst is not None else (self.rank + 1) % self.world_size
        dst_worker = f"worker{dst_rank}"
        rref = rpc.remote(dst_worker, func, args=args, timeout=0.001)
        expected_error = self.get_timeout_error_regex()
        with self.assertRaisesRegex(RuntimeError, expected_error):
            rref._get_future().wait()
        with self.assertRaisesRegex(RuntimeError, "RRef creation"):
            rref.to_here()
        if dst_rank != self.rank:
            slow_rref = rpc.remote(dst_worker, func, args=args, timeout=2)
            with self.assertRaisesRegex(RuntimeError, expected_error):
                slow_rref.to_here(0.001)  # its fetch times out
        # (torch then checks its owner/fork counts on the owner; here the leak check after
        # every test covers what is left behind.)

    @options(faulty_messages=[], messages_to_delay={"PYTHON_REMOTE_CALL": 2})
    def test_udf_remote_message_delay_timeout(self):
        self._test_remote_message_delay_timeout(my_sleep_func, (2,))

    @options(faulty_messages=[], messages_to_delay={"PYTHON_REMOTE_CALL": 2})
    def test_udf_remote_message_delay_timeout_to_self(self):
        self._test_remote_message_delay_timeout(my_sleep_func, (1,), dst=0)

    @options(faulty_messages=[], messages_to_delay={"SCRIPT_REMOTE_CALL": 2, "SCRIPT_RREF_FETCH_CALL": 1})
    def test_remote_message_builtin_delay_timeout(self):
        self._test_remote_message_delay_timeout(torch.add, (torch.tensor(1), torch.tensor(1)))

    @options(faulty_messages=[], messages_to_delay={"SCRIPT_REMOTE_CALL": 2, "SCRIPT_RREF_FETCH_CALL": 1})
    def test_remote_message_builtin_delay_timeout_to_self(self):
        self._test_remote_message_delay_timeout(torch.add, (torch.tensor(1), torch.tensor(1)), dst=0)

    @options(faulty_messages=[], messages_to_delay={"SCRIPT_REMOTE_CALL": 2, "SCRIPT_RREF_FETCH_CALL": 1})
    def test_remote_message_script_delay_timeout(self):
        self._test_remote_message_delay_timeout(my_script_func, (torch.tensor(1),))

    @options(faulty_messages=[], messages_to_delay={"SCRIPT_REMOTE_CALL": 2, "SCRIPT_RREF_FETCH_CALL": 1})
    def test_remote_message_script_delay_timeout_to_self(self):
        self._test_remote_message_delay_timeout(my_script_func, (torch.tensor(1),), dst=0)

    @options(faulty_messages=[], messages_to_delay={"SCRIPT_RREF_FETCH_CALL": 1})
    def test_rref_to_here_timeout(self):
        if self.rank != 0:
            return
        dst_worker = f"worker{(self.rank + 1) % self.world_size}"
        rref = rpc.remote(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)))
        with self.assertRaisesRegex(RuntimeError, self.get_timeout_error_regex()):
            rref.to_here(0.01)
        rref.to_here()

    @options(faulty_messages=[])
    def test_rpc_builtin_timeout(self):
        dst_worker = worker_name((self.rank + 1) % self.world_size)
        expected_error = self.get_timeout_error_regex()
        # PYTHON_CALL (and torch's SCRIPT_CALL) are delayed 1.5 s by the group's options.
        with self.assertRaisesRegex(RuntimeError, expected_error):
            rpc.rpc_sync(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)), timeout=1)
        fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)), timeout=1)
        with self.assertRaisesRegex(RuntimeError, expected_error):
            fut.wait()
        fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)))
        fut.wait()
        rpc._set_rpc_timeout(0.001)
        fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)))
        with self.assertRaisesRegex(RuntimeError, expected_error):
            fut.wait()
        fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)), timeout=0)
        fut.wait()
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT_SEC)

    @options(faulty_messages=[], messages_to_delay={"SCRIPT_CALL": 1.5})
    def test_rpc_script_timeout(self):
        dst_worker = worker_name((self.rank + 1) % self.world_size)
        expected_error = self.get_timeout_error_regex()
        with self.assertRaisesRegex(RuntimeError, expected_error):
            rpc.rpc_sync(dst_worker, my_script_func, args=(torch.tensor(1),), timeout=1)
        fut = rpc.rpc_async(dst_worker, my_script_func, args=(torch.tensor(1),), timeout=1)
        with self.assertRaisesRegex(RuntimeError, expected_error):
            fut.wait()
        fut = rpc.rpc_async(dst_worker, my_script_func, args=(torch.tensor(1),))
        fut.wait()
        rpc._set_rpc_timeout(0.001)
        fut = rpc.rpc_async(dst_worker, my_script_func, args=(torch.tensor(1),))
        with self.assertRaisesRegex(RuntimeError, expected_error):
            fut.wait()
        fut = rpc.rpc_async(dst_worker, my_script_func, args=(torch.tensor(1),), timeout=0)
        fut.wait()
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT_SEC)
