"""Run a prefill worker."""

from __future__ import annotations

from prefill_worker.service import SERVICE_NAME, PrefillWorker, add_to_server
from plumbing.config import WorkerConfig
from plumbing.engine_service import serve_worker


async def serve_prefill(config: WorkerConfig) -> None:
    await serve_worker(config, PrefillWorker, add_to_server, SERVICE_NAME)
