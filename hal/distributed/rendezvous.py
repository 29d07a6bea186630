"""Epochs: how the two ranks meet, and meet again after the link was lost.

Both ranks reach one key-value store: the target rank's (``MASTER_ADDR:MASTER_PORT``), or
torchrun's agent store under torchrun. Each meeting is an *epoch* with its own process group:

- the target announces epoch ``e`` (key ``hal/epoch/<e>``), and ``hal/epoch`` holds the newest;
- the worker reads the newest epoch, says it joins (``hal/join/<e>``), and both build that
  epoch's group (gloo, under the prefix ``hal/group/<e>``), bounded in time;
- when the target loses the worker (a reset or a timeout), it drops the group and announces
  ``e + 1``; the worker sees it (it watches the store) and joins again once the link is back.

Every message carries its epoch (`hal.distributed.protocol`): a message of another epoch is
refused. The first epoch may use the backends' own collective (nccl, hccl); later ones are
gloo over the host, which every pair of devices has."""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

from hal.errors import HalError

EPOCH, JOIN, GROUP = "hal/epoch", "hal/join/", "hal/group/"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Rendezvous:
    """One rank's view of the store (see the module docstring). ``timeout``: the first
    meeting's bound, in seconds; the target (rank 0) hosts the store unless torchrun's agent does."""

    def __init__(self, rank: int, backend: str, timeout: float, host: str | None = None, port: int | None = None):
        self.rank, self.backend, self.timeout = rank, backend, timeout
        self.host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(port or os.environ.get("MASTER_PORT", "29500"))
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:   # the target's server must outlive a worker that came late or left: it waits for nobody
            self.store = dist.TCPStore(self.host, self.port, 2, rank == 0 and not agent, timeout=_td(timeout),
                                       wait_for_workers=False, multi_tenant=True)
        except (RuntimeError, ValueError) as e:   # DistStoreError: nobody listening within the timeout
            raise HalError(f"the rendezvous store at {self.host}:{self.port}: expected it reachable within "
                           f"{timeout} s, got {type(e).__name__}") from e

    # -- the target --------------------------------------------------------------------------
    def announce(self, epoch: int) -> None:
        """Open ``epoch`` for the worker to join."""
        self.store.set(f"{EPOCH}/{epoch}", "1")
        self.store.set(EPOCH, str(epoch))

    def joining(self, epoch: int) -> bool:
        """Whether the worker said it joins ``epoch`` (does not block)."""
        return self.store.check([f"{JOIN}{epoch}"])

    # -- the worker --------------------------------------------------------------------------
    def newest(self, wait_for: int | None = None, timeout: float = 1.0) -> int | None:
        """The newest epoch the target announced; with ``wait_for``, first wait up to
        ``timeout`` s for that epoch to be announced. -1 when the store answers but no epoch
        is announced yet (the target is still loading: it announces once it is ready to meet).
        None when the store cannot be reached within ``timeout`` (a partition): the next call
        connects afresh, so a healed link is seen at once rather than after TCP's
        retransmission backoff. Raises `HalError` when the target is gone (its port refuses
        connections)."""
        try:
            if self.store is None:
                self.store = dist.TCPStore(self.host, self.port, 2, False, timeout=_td(timeout),
                                           wait_for_workers=False)
            self.store.set_timeout(_td(timeout))
            if wait_for is not None:   # polled: a timed-out store wait logs a warning each time
                end = time.monotonic() + timeout
                while not self.store.check([f"{EPOCH}/{wait_for}"]) and time.monotonic() < end:
                    time.sleep(0.05)
            if not self.store.check([EPOCH]):
                return -1
            return int(self.store.get(EPOCH))
        except (RuntimeError, ValueError):
            self.store = None
            if self._refused(timeout):
                raise HalError(f"the target at {self.host}:{self.port}: expected its store listening, "
                               "got connections refused (the target is gone)") from None
            return None

    def _refused(self, timeout: float) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            pass
        return False

    def join(self, epoch: int) -> None:
        self.store.set(f"{JOIN}{epoch}", "1")

    # -- both ----------------------------------------------------------------------------------
    def group(self, epoch: int, timeout: float):
        """``epoch``'s process group, built by both ranks within ``timeout`` s (`HalError` else),
        which is also its operations' default bound. Epoch 0 uses ``backend``; later epochs gloo."""
        store = dist.PrefixStore(f"{GROUP}{epoch}", self.store)
        self.store.set_timeout(_td(timeout))
        t0 = time.monotonic()
        try:
            if epoch == 0 and self.backend != "gloo":
                dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=2,
                                        timeout=_td(timeout))
                return dist.group.WORLD
            return dist.ProcessGroupGloo(store, self.rank, 2, _td(timeout))
        except (RuntimeError, ValueError) as e:
            raise HalError(f"epoch {epoch}'s rendezvous: expected both ranks within {timeout} s, got "
                           f"{type(e).__name__} after {time.monotonic() - t0:.1f} s") from e
        finally:
            self.store.set_timeout(_td(self.timeout))

    def backend_of(self, epoch: int) -> str:
        return self.backend if epoch == 0 else "gloo"
