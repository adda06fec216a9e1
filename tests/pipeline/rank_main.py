"""One rank of the demo trainer (otel_straggler/demo/trainer.py), unchanged, that prints the
instrumentation's final counters when it is done:

    rank-status {"intervals": ..., "spans_built": ..., "exported": ..., "lost": {"export_failed": ...}}

The end-to-end tests start it once per rank (training.py) to check that spans lost on the way
are counted on the rank. Run as a script: `python rank_main.py --steps 40 --log-every 1`.
"""

from __future__ import annotations

import json

import otel_straggler

STATUS_PREFIX = "rank-status "

_handles = []
_configure = otel_straggler.configure


def _configure_and_keep(*args, **kwargs):
    # The trainer shuts its handle down before it returns, and current() is None after that;
    # the handle itself keeps answering status() with the final counters.
    handle = _configure(*args, **kwargs)
    _handles.append(handle)
    return handle


def main() -> None:
    from otel_straggler.demo import trainer  # torch: only in the rank, not in whoever imports this file

    otel_straggler.configure = _configure_and_keep
    trainer.train(trainer.parse_args())
    if _handles:
        print(STATUS_PREFIX + json.dumps(_handles[0].status(), sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
