"""The halo exchange's wait on the host, with the process group's works faked: over NCCL (a GPU
``comm_device``) a timeout is kept by polling the work, since NCCL's own ``wait`` does not block
the host; a work not done in time names its peer."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from torch_sparserl.distributed.halo import HaloExchange, HaloExchangeError, HaloPlan, _Pending


class FakeWork:
    """A P2P work that is done after ``done_after_s`` (never, with None)."""

    def __init__(self, done_after_s: float | None):
        self.started = time.monotonic()
        self.done_after_s = done_after_s
        self.waited = False

    def is_completed(self) -> bool:
        return self.done_after_s is not None and time.monotonic() - self.started >= self.done_after_s

    def wait(self, timeout=None) -> bool:
        assert timeout is None, "over NCCL the timeout is the host's to keep"
        self.waited = True
        return True


def exchange(timeout_s: float | None) -> HaloExchange:
    plan = HaloPlan(0, {}, {})
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return HaloExchange(plan, None, torch.device("cuda", 0), torch.device("cpu"), timeout, "DistributedCSRMatrix.matmul")


def test_a_timeout_over_nccl_is_kept_by_polling_and_names_the_peer():
    work = FakeWork(None)
    pending = _Pending([work], [[1]], None, [])
    started = time.monotonic()
    with pytest.raises(HaloExchangeError, match=r"the halo exchange with rank 1 failed or did not finish within "
                                                r"0:00:00.200000.*TimeoutError: not done after 0.2 s"):
        exchange(0.2).wait(pending, "halo exchange")
    assert 0.2 <= time.monotonic() - started < 2.0 and not work.waited


def test_a_work_done_in_time_is_waited_for_and_its_rows_returned():
    work = FakeWork(0.05)
    received = torch.arange(6.0).view(3, 2)
    rows = exchange(5.0).wait(_Pending([work], [1], received, []), "halo exchange")
    assert work.waited and torch.equal(rows, received)


def test_without_a_timeout_the_host_does_not_poll():
    work = FakeWork(None)  # never done: a poll would never return
    assert exchange(None).wait(_Pending([work], [[1, 2]], None, []), "halo exchange") is None
    assert work.waited
