"""Draft and target on different ranks or hosts: where each side runs (`placement`), the
wire protocol between them (`protocol`), the target's `RemoteDrafter` (`remote`), the draft
rank's loop (`worker`) and the two-rank launcher (`launcher`, ``python -m hal.distributed.launcher``)."""
