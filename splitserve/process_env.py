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
  docs/measurements.md ("A twenty-first sitting") has the measurements: the c=1 ITL through
  the front 4-5% lower, in-process steps unchanged.
* ``MALLOC_ARENA_MAX=1``: one glibc malloc arena for every thread, so that the engine
  thread's large activations come from the main heap, which keeps them between steps, not
  from heaps of their own that glibc unmaps once free (``engine.cpu_tuning.limit_malloc_arenas``
  and docs/measurements.md, "A twenty-third sitting"). glibc reads the variable only when a
  process starts: ``apply`` sets it for the processes this one starts, and for this one
  asks glibc directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from engine.cpu_tuning import limit_malloc_arenas

GOMP_SPINCOUNT = 20000
MALLOC_ARENA_MAX = 1


def defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``apply`` would set in ``environ``: those it does not set already."""
    out: dict[str, str] = {}
    if "GRPC_VERBOSITY" not in environ:
        out["GRPC_VERBOSITY"] = "ERROR"
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        out["GOMP_SPINCOUNT"] = str(GOMP_SPINCOUNT)
    if "MALLOC_ARENA_MAX" not in environ:
        out["MALLOC_ARENA_MAX"] = str(MALLOC_ARENA_MAX)
    return out


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``defaults(environ)`` in ``environ`` (the process's own by default): before gRPC
    and torch load, or they take no effect; and, where it sets ``MALLOC_ARENA_MAX`` in the
    process's own environment, the same limit in glibc (before a second thread allocates)."""
    new = defaults(environ)
    environ.update(new)
    if "MALLOC_ARENA_MAX" in new and environ is os.environ:
        limit_malloc_arenas(MALLOC_ARENA_MAX)
