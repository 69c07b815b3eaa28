"""What a splitserve process sets in its own environment before it loads gRPC or torch.

Both libraries read these variables once, when they load, so ``splitserve.cli.main`` applies
them first thing (importing ``splitserve.cli`` loads neither). A variable the environment
already sets is left as it is.

* ``GRPC_VERBOSITY=ERROR``: gRPC's C core logs to stderr on its own (a refused TLS handshake
  is an INFO line), outside the JSON lines; errors only.
* ``GOMP_SPINCOUNT=20000`` (unless ``OMP_WAIT_POLICY`` is set, which has its own count):
  how long an idle OpenMP thread of torch's libgomp spins before it sleeps, about 0.3 ms on
  the Zen 5 where it was measured, instead of libgomp's default (300000, several ms). A
  served worker's engine steps while the worker's event loop, the gateway and the HTTP front
  handle the last token on the same cores; between two steps the engine's helper thread
  then sleeps, its core looks idle, and the scheduler puts those service threads there
  instead of on the core of the thread that is about to start the next step. Inside a step
  the gaps between parallel regions are far shorter, so the helper still spins through them.
  docs/architecture.md ("A twenty-first sitting") has the measurements: the c=1 ITL through
  the front 4-5% lower, in-process steps unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

GOMP_SPINCOUNT = 20000


def defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``apply`` would set in ``environ``: those it does not set already."""
    out: dict[str, str] = {}
    if "GRPC_VERBOSITY" not in environ:
        out["GRPC_VERBOSITY"] = "ERROR"
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        out["GOMP_SPINCOUNT"] = str(GOMP_SPINCOUNT)
    return out


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``defaults(environ)`` in ``environ`` (the process's own by default): before gRPC
    and torch load, or they take no effect."""
    environ.update(defaults(environ))
