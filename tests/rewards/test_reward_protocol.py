"""Protocol 1's request ids, and the fleet's missing-extra message (no LitServe needed).

A client sends a fresh id with every request (the same id on each retry); servers echo it; a
reply that names another request is refused rather than used. Old clients (no id) and old
servers (no echo) keep working.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from reward_helpers import PROMPTS, fixed_images

from flowrl.interfaces import RewardOutput
from flowrl.serving.protocol import (
    REQUEST_ID_HEADER,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    request_id_of,
    safetensors_metadata,
)
from flowrl_plugins.rewards.http import HttpReward, HttpRewardConfig, RewardServerError, make_server


def test_request_ids_round_trip_and_are_validated():
    images = fixed_images(2, size=(4, 4))
    body = encode_request(images, PROMPTS[:2], None, "uint8", request_id="abc-123_x")
    assert request_id_of(body) == "abc-123_x"
    assert request_id_of(encode_request(images, PROMPTS[:2], None, "uint8")) is None
    assert request_id_of(b"garbage") is None
    decoded, prompts, _ = decode_request(body)
    assert torch.equal(decoded, images) and prompts == PROMPTS[:2]
    for bad in ("", "a b", "x" * 65, "../etc"):
        with pytest.raises(ValueError, match="request id"):
            encode_request(images, PROMPTS[:2], None, "uint8", request_id=bad)
    from safetensors.torch import save

    forged = save({"images": torch.zeros(1, 3, 2, 2, dtype=torch.uint8)},
                  metadata={"prompts": json.dumps(["a"]), "request_id": "../../x"})
    with pytest.raises(ValueError, match="'request_id' must be"):
        decode_request(forged)
    reply = encode_response(RewardOutput(scores=torch.ones(2)), request_id="abc-123_x", info={"replica": "0"})
    assert safetensors_metadata(reply) == {"protocol": "1", "request_id": "abc-123_x", "replica": "0"}
    assert decode_response(reply, 2, "u", request_id="abc-123_x").scores.tolist() == [1.0, 1.0]
    assert decode_response(encode_response(RewardOutput(scores=torch.ones(2))), 2, "u", request_id="q").scores.shape == (2,)
    with pytest.raises(RewardServerError, match="answered request 'abc-123_x' to request 'other'"):
        decode_response(reply, 2, "u", request_id="other")


class Recorder:
    name = "mean"

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(scores=images.mean((1, 2, 3)))


def test_simple_server_echoes_the_client_id():
    server = make_server(Recorder(), name="mean", port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        reward = HttpReward(HttpRewardConfig(url=server.url, batch_size=2))
        sent = []
        original = reward._request

        def spy(method, path, body, headers=None):
            reply = original(method, path, body, headers)
            if path == "/score":
                sent.append((request_id_of(body), (headers or {}).get(REQUEST_ID_HEADER), request_id_of(reply)))
            return reply

        reward._request = spy
        images = fixed_images(5, size=(8, 8))
        torch.testing.assert_close(reward(images, PROMPTS[:5]).scores, images.mean((1, 2, 3)))
        assert len(sent) == 3 and len({s[0] for s in sent}) == 3  # a fresh id per request
        assert all(body_id == header_id == echoed and body_id for body_id, header_id, echoed in sent)
    finally:
        server.shutdown()
        server.server_close()


def test_a_reply_to_another_request_is_refused():
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body, ctype):
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._reply(json.dumps({"status": "ok", "reward": "mixup", "protocol": 1}).encode(), "application/json")

        def do_POST(self):
            images, _, _ = decode_request(self.rfile.read(int(self.headers["Content-Length"])))
            out = RewardOutput(scores=torch.zeros(images.shape[0]))
            self._reply(encode_response(out, request_id="someone-else"), "application/octet-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        reward = HttpReward(HttpRewardConfig(url=f"http://127.0.0.1:{server.server_address[1]}"))
        with pytest.raises(RewardServerError, match="answered request 'someone-else' to request '[0-9a-f]{32}'"):
            reward(fixed_images(2, size=(8, 8)), PROMPTS[:2])
    finally:
        server.shutdown()
        server.server_close()


# litserve is hidden the way a missing package is: `import litserve` raises ImportError.
HIDDEN_LITSERVE = """
import sys
sys.modules["litserve"] = None
from flowrl import cli
cli.main(["reward", "serve", "brightness", "--backend", "litserve", "--port", "0"])
"""


@pytest.mark.slow
def test_fleet_without_its_extra_names_the_pip_command(flowrl_cli):
    proc = subprocess.run([sys.executable, "-c", HIDDEN_LITSERVE], capture_output=True, text=True, timeout=120,
                          env=flowrl_cli.env())
    assert proc.returncode == 2, proc.stderr
    flat = " ".join(proc.stderr.split())
    assert "`flowrl reward serve --backend litserve` (a reward fleet) needs the optional package 'litserve'" in flat
    assert 'pip install "flowrl-diffusion[fleet]"' in flat
    assert "Traceback" not in proc.stderr
