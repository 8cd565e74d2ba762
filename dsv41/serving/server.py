"""Running the HTTP front end: the app for a pipeline's endpoints, served by uvicorn.

`dsv41 serve` starts the pipeline's components under the supervisor and serves HTTP in the same
process (the front end is one more client of dspark); `HTTPServer` runs the same in a thread on an
already bound socket, for tests and benchmarks.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import uvicorn

from dsv41.components.context import COMPONENTS, ComponentContext
from dsv41.components.runtime import ComponentError, Peer
from dsv41.pipelines.schema import Pipeline
from dsv41.serving.app import ServingApp, Settings, create_app
from dsv41.serving.backend import Backend

DEFAULT_MAX_BODY_BYTES = 32 << 20
PING_TIMEOUT_S = 1.0


def served_model_name(pipeline: Pipeline) -> str:
    """The model's name in the API: its model directory's name, else its config's."""
    spec = pipeline.model
    return Path(spec.checkpoint).expanduser().name if spec.checkpoint else Path(spec.config).stem


def build_app(pipeline: Pipeline, endpoints: dict[str, str], runtime_dir: Path, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_name: str | None = None) -> ServingApp:
    context = ComponentContext(pipeline, endpoints, runtime_dir)
    config, generation = context.config, pipeline.generation
    backend = Backend(endpoints["dspark"], context.keys_dir, context.limits, generation.request_timeout_s)

    def ping(name: str) -> dict[str, int] | None:
        try:
            peer = Peer(endpoints[name], name, context.keys_dir, timeout_s=PING_TIMEOUT_S, limits=context.limits)
        except Exception:  # noqa: BLE001 - a component we cannot even reach is down
            return None
        try:
            return dict(peer.ping(PING_TIMEOUT_S).counters)
        except ComponentError:
            return None
        finally:
            peer.close()

    eos = config.eos_token_id
    settings = Settings(model=model_name or served_model_name(pipeline),
                        context=config.text_config.max_position_embeddings, vocab_size=config.text_config.vocab_size,
                        eos_id=eos, default_max_tokens=generation.max_new_tokens,
                        temperature=generation.temperature, top_p=generation.top_p,
                        prefill_mode=generation.prefill_mode, retry_after_s=pipeline.scheduling.retry_after_s,
                        max_body_bytes=max_body_bytes, api_key=api_key, image_token_id=config.image_token_id,
                        vision=config.vision_config if config.vision_config.num_hidden_layers else None)
    return ServingApp(backend, context.tokenizer, settings, ping, COMPONENTS)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_server(serving: ServingApp) -> uvicorn.Server:
    config = uvicorn.Config(create_app(serving), log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            lifespan="off")
    return uvicorn.Server(config)


class HTTPServer:
    """The front end served from a thread on a socket bound here (tests, benchmarks)."""

    def __init__(self, serving: ServingApp, host: str = "127.0.0.1", port: int = 0):
        self.serving = serving
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn_server(serving)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            threading.Event().wait(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.serving.backend.close()

    def __enter__(self) -> HTTPServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
