"""Run a decode worker."""

from __future__ import annotations

from decode_worker.service import SERVICE_NAME, DecodeWorker, add_to_server
from plumbing.config import WorkerConfig
from plumbing.engine_service import serve_worker


async def serve_decode(config: WorkerConfig) -> None:
    await serve_worker(config, DecodeWorker, add_to_server, SERVICE_NAME)
