"""``python -m zmqautograd.run``: a program that imports torch's RPC modules gets zmqautograd's,
in its own process and in the processes it starts; a process that never imports torch is not
made to import it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = ["zmqautograd.rpc", "zmqautograd.autograd", "zmqautograd.optim.optimizer"]


@pytest.mark.timeout(120)
def test_a_program_run_by_zmqautograd_run_gets_ours_in_every_process():
    program = os.path.join(ROOT, "tests", "alias_program.py")
    done = subprocess.run([sys.executable, "-m", "zmqautograd.run", program],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"main": OURS, "child": OURS, "plain_imported_torch": "False"}, seen


@pytest.mark.timeout(60)
def test_without_it_torchs_own_modules_stay():
    done = subprocess.run([sys.executable, "-c", "import torch.distributed.rpc as r; print(r.__name__)"],
                          capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert done.stdout.strip().splitlines()[-1] == "torch.distributed.rpc", done.stderr[-2000:]
