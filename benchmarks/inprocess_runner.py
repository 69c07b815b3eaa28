"""One in-process peer (our Engine, transformers generate or generate_batch) in a fresh process.

    OMP_NUM_THREADS=N python -m benchmarks.inprocess_runner SYSTEM SETUP.json OUT.json

Every peer runs in its own process started with ``OMP_NUM_THREADS`` equal to its thread
count, as the deployments' workers and the vLLM runner are: the OpenMP runtime reads it when
torch loads, and a process that only calls ``torch.set_num_threads`` later ran the engine
benchmark about 1.5× slower on two cores. ``SETUP.json`` holds the workload, the engine
settings, the prompts and the thread count (``peers.write_setup``); ``OUT.json`` gets the
seconds, the output ids, the error (if any) and the details of the ``benchmarks.systems`` runner.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(system: str, setup: dict) -> dict:
    import torch

    from benchmarks import systems
    from bench.workload import ModelShape, Workload

    torch.set_num_threads(setup["threads"])
    workload = Workload(**{**setup["workload"], "model": ModelShape(**setup["workload"]["model"])})
    settings = systems.EngineSettings(**setup["settings"])
    model_dir, prompts = Path(setup["model_dir"]), setup["prompts"]
    if system == "engine":
        result = systems.run_ours(model_dir, prompts, workload, settings)
    elif system == "hf_generate":
        result = systems.run_hf_sequential(model_dir, prompts[: setup["num_hf_sequential"]], workload)
    elif system == "hf_generate_batch":
        kwargs = systems.hf_batch_cache_kwargs(workload, settings, page_size=256)
        result = systems.run_hf_batch(model_dir, prompts, workload, kwargs)
    else:
        raise ValueError(f"unknown in-process system {system!r}")
    details = {k: v for k, v in result.details.items() if k != "traceback"}
    return {"num_requests": result.num_requests, "seconds": result.seconds, "output_ids": result.output_ids,
            "error": result.error, "details": {**details, "torch_num_threads": torch.get_num_threads()}}


def main(argv: list[str] | None = None) -> int:
    system, setup_path, out_path = (argv if argv is not None else sys.argv[1:])
    result = run(system, json.loads(Path(setup_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
