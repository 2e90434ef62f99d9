"""``spawn_tied``: children die with their parent, even when it is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from shoal._spawn import DIES_WITH_PARENT

pytestmark = pytest.mark.skipif(not DIES_WITH_PARENT, reason="PR_SET_PDEATHSIG is Linux-only")

# A parent that starts one tied child from its main thread and one from a thread that has
# ended by the time the parent is killed (the kernel ties the signal to the forking thread),
# prints both pids, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from shoal._spawn import spawn_tied

    child = [sys.executable, "-c", "import time; time.sleep(120)"]
    first = spawn_tied(child, start_new_session=True)
    box = []
    thread = threading.Thread(target=lambda: box.append(spawn_tied(child)))
    thread.start()
    thread.join()
    print(first.pid, box[0].pid, flush=True)
    time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_children_of_a_sigkilled_parent_are_signalled_not_orphaned() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, "the parent did not start its children"
        time.sleep(0.5)  # the thread that forked the second child has ended by now
        assert not any(_gone(pid) for pid in pids), "a child died while its parent lived"
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 5
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not _gone(pid)] == []
    finally:
        parent.kill()
        parent.wait(5)
        assert parent.stdout is not None
        parent.stdout.close()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
