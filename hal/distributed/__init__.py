"""Draft and target on different ranks or hosts: where each side runs (`placement`; chosen
from measured profiles by `auto`, measured at start-up by `measure`), the wire protocol between
them (`protocol`), how the ranks meet and meet again after a lost link (`rendezvous`), the
target's `RemoteDrafter` (`remote`), the draft rank's loop (`worker`) and the two-rank launcher
(`launcher`, ``python -m hal.distributed.launcher``)."""
