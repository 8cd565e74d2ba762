"""Run one component: in this process's main thread (its own OS process) or in a thread.

`python -m dsv41.components.host NAME PIPELINE_FILE RUNTIME_DIR` is what the supervisor starts
for a `process` component; `dsv41 component NAME` runs the same in the foreground.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from dsv41.components.context import ComponentContext
from dsv41.components.registry import component_class
from dsv41.components.runtime import Server
from dsv41.pipelines.schema import Pipeline, load_pipeline, resolve_endpoints


def build_server(name: str, pipeline: Pipeline, runtime_dir: Path) -> Server:
    """Build the component (loading its model) and bind its endpoint: once this returns, it is ready."""
    context = ComponentContext(pipeline, resolve_endpoints(pipeline, runtime_dir), runtime_dir)
    component = component_class(name)(context)
    return Server(component, context.endpoints[name], context.keys_dir, limits=context.limits)


def serve_forever(server: Server) -> None:
    """The compute loop until SIGTERM/SIGINT (main thread) or `server.stop()`; then a clean close."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.stop())
    try:
        server.run()
    finally:
        server.join()


LIGHT = ("tokenizer", "engram", "dspark", "kvstore")  # small tensor work: one thread leaves the cores to the model


def compute_threads(name: str, pipeline: Pipeline) -> int:
    """Torch threads of a component process: the `threads` option, else one for the light
    components and half the cores for the encoder and the decoder (they take turns on a
    request, and passively waiting threads wake slowly on the many small ops of a decode step)."""
    given = pipeline.components[name].options.get("threads")
    if given:
        return int(given)
    return 1 if name in LIGHT else max(1, (os.cpu_count() or 2) // 2)


def main(argv: list[str]) -> int:
    import torch

    name, pipeline_file, runtime_dir = argv
    pipeline = load_pipeline(Path(pipeline_file))
    torch.set_num_threads(compute_threads(name, pipeline))
    serve_forever(build_server(name, pipeline, Path(runtime_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
