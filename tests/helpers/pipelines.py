"""Pipelines for tests (the micro model, a store in a temporary folder) and stand-in components."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import zmq

from dsv41 import messages as m
from dsv41.components.runtime import make_socket
from dsv41.pipelines.launch import ProcessChild, Supervisor, ThreadChild, prepare_runtime_dir, with_overrides
from dsv41.pipelines.schema import Pipeline, load_pipeline, resolve_endpoints


def short_dir() -> Path:
    """A fresh folder with a short path (Unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="d41", dir="/tmp"))


def pipeline_for(placement: str, root: Path, config: str = "micro", block_tokens: int = 16, **options) -> Pipeline:
    base = load_pipeline("inproc" if placement == "thread" else "local")
    # model processes compute with this process's thread count, so their numbers can be compared
    # bit for bit with the in-process core (a GEMM splits its sums by thread count)
    same_threads = {"threads": torch.get_num_threads()}
    components = {name: msgspec.structs.replace(spec, options={**(same_threads if name in ("encoder", "decoder")
                                                                   else {}), **options.get(name, {})})
                  for name, spec in base.components.items()}
    return with_overrides(base, model={"config": config, "seed": 3, "checkpoint": None},
                          store={"path": str(root / "kv"), "block_tokens": block_tokens},
                          supervisor={"ready_timeout_s": 120.0, "backoff_s": 0.1},
                          generation={"request_timeout_s": 60.0}, components=components)


def start_alone(name: str, pipeline: Pipeline, runtime_dir: Path) -> ProcessChild | ThreadChild:
    """One component, in the placement its pipeline gives it, started and answering pings."""
    prepare_runtime_dir(runtime_dir)
    supervisor = Supervisor(pipeline, runtime_dir)
    if pipeline.placement == "thread":
        child = ThreadChild(name, pipeline, runtime_dir)
    else:
        pipeline_file = runtime_dir / "pipeline.yaml"
        pipeline_file.write_bytes(msgspec.yaml.encode(pipeline))
        child = ProcessChild(name, pipeline_file, runtime_dir)
    supervisor.children[name] = child
    child.start()
    supervisor.wait_ready(name, deadline=time.monotonic() + 120)
    return child


Answer = Callable[[m.Message, list[memoryview]], "tuple[m.Message, m.Frames | None] | None"]


class StandIn:
    """A ROUTER at another component's endpoint that records what arrives and answers with `answer`."""

    def __init__(self, endpoint: str, answer: Answer):
        self.answer, self.received = answer, []
        self.sock = make_socket(zmq.Context.instance(), zmq.ROUTER, endpoint, bind=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *parts = self.sock.recv_multipart()
            message, frames = m.decode(parts)
            self.received.append((message, [bytes(f) for f in frames]))
            answer = self.answer(message, frames)  # None (no reply), a reply, or a list of replies
            for reply in answer if isinstance(answer, list) else [answer] if answer is not None else []:
                try:
                    self.sock.send_multipart([identity, *m.encode(*reply)])
                except zmq.ZMQError as e:  # the asker has gone (a test ending, a killed component)
                    if e.errno != zmq.EHOSTUNREACH:
                        raise

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)


def endpoints(pipeline: Pipeline, runtime_dir: Path) -> dict[str, str]:
    return resolve_endpoints(pipeline, runtime_dir)
