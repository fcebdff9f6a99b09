"""What the serving tests share: the test model (a random llama with GPT-2's vocabulary and a ChatML template written
into its GGUF) and a server on an ephemeral loopback port, run on a thread of the test process."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from kvcache_ggml.runtime.modelmaker import make_model

HERE = Path(__file__).resolve().parent
GPT2_VOCAB = HERE / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_chat_model(path: Path, template: str = CHATML) -> Path:
    """A 2-layer random llama (n_embd 64) with GPT-2's 50257-token vocabulary and ``template`` in its GGUF."""
    return make_model(path, layers=2, embd=64, heads=4, heads_kv=2, ff=128, seed=3, vocab_from=str(GPT2_VOCAB),
                      chat_template=template)


class LiveServer:
    """``python -m kvcache_ggml serve`` in-process: the CLI's own set-up, uvicorn on a thread; close() stops it."""

    def __init__(self, argv: list[str]) -> None:
        import uvicorn

        from kvcache_ggml.serve.cli import open_service, parse_args, uvicorn_config

        self.args = parse_args(argv)
        self.model, self.ctx, self.svc = open_service(self.args)
        self.engine = self.svc.engine
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.svc))  # (the serve command's configuration)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started or not self.engine.ready.is_set():  # (/health answers 503 until then)
            if not self.thread.is_alive() or time.monotonic() - t0 > 60:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             timeout=kwargs.pop("timeout", 120), **kwargs)

    def used_cells(self) -> int:
        """Cells holding a token, every stream (the Memory protocol's count: the base cache's for iSWA)."""
        return self.ctx.kv.get_used()

    def wait_idle(self, timeout: float = 30) -> None:
        """Until the engine runs and queues nothing (a cancelled request is released at the next step)."""
        t0 = time.monotonic()
        while self.engine.n_running or self.engine.queue_depth:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{self.engine.n_running} requests still running")
            time.sleep(0.01)

    def drop_parked(self) -> None:
        """Evict every parked sequence (the engine idle): the next admissions find free sequences."""
        self.wait_idle()
        pc = self.engine.prefix
        for e in pc.entries():
            pc.evict(e.seq_id, keep=False)
        assert self.used_cells() == 0

    def close(self) -> None:
        from kvcache_ggml.serve.speculative import close_drafter

        self.server.should_exit = True
        self.thread.join(30)
        close_drafter(self.engine.drafter)
        self.ctx.close()
        self.model.close()


class Reply:
    """An HTTP answer: status, headers (lower-case names) and body."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, body

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self):
        import json
        return json.loads(self.content)


def http(url: str, body=None, headers: dict[str, str] | None = None, timeout: float = 60) -> Reply:
    """GET ``url`` (no body) or POST ``body`` (bytes as they are, anything else as JSON), with the standard
    library: a raw request for what the openai client will not send (bad JSON, huge bodies, wrong keys)."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())
