"""torchrun for the two ranks: ``python -m hal.distributed.torchrun`` takes torchrun's own
arguments and runs its agent. The one difference: SIGTERM (or SIGINT) stops both ranks as
torchrun does (the target drains and exits 0, the draft rank exits 0) and then exits 0 with
one line, where torchrun itself re-raises the signal with a traceback and exits 1."""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run
    args = parse_args(argv)
    try:
        run(args)
    except SignalException as e:
        if e.sigval not in (signal.SIGTERM, signal.SIGINT):
            raise
        print(f"hal.distributed.torchrun: {signal.Signals(e.sigval).name}: both ranks stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
