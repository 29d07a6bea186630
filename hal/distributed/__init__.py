"""Draft and target on different ranks or hosts, the mechanics only: where each side runs
(`placement`; chosen from measured profiles by `auto`), the wire protocol between them
(`protocol`), how the ranks meet and meet again after a lost link (`rendezvous`), the target's
`RemoteDrafter` (`remote`) and the draft rank's loop (`worker`). A rank's start-up, and the
two-rank launcher ``python -m hal.launch``, are `hal.launch`."""
