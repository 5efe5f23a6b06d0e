"""The http reward and `flowrl reward serve`: round trips, and every failure raises clearly.

Servers bind to 127.0.0.1 on a free port; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from reward_helpers import PROMPTS, fixed_images
from tiny_recipe import tiny_recipe

from flowrl.interfaces import RewardOutput
from flowrl.rewards import score
from flowrl_plugins.rewards.http import (
    HttpReward,
    HttpRewardConfig,
    RewardServerError,
    encode_request,
    make_server,
)


class MeanReward:
    """Mean brightness, plus the red channel's mean as an extra; records each batch size."""

    name = "mean"

    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.delay, self.fail, self.batches = delay, fail, []

    def __call__(self, images, prompts, metadata=None):
        self.batches.append(len(prompts))
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise ValueError("the model exploded")
        return RewardOutput(scores=images.mean((1, 2, 3)), extras={"red": images[:, 0].mean((1, 2))})


class Serving:
    """A reward server in a background thread for one test."""

    def __init__(self, reward):
        self.server = make_server(reward, name="mean", port=0)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return self.server.url

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    started = []

    def start(reward):
        s = Serving(reward)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def client(url, **kw):
    kw.setdefault("retry_wait", 0.01)
    return HttpReward(HttpRewardConfig(url=url, **kw))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype, atol", [("uint8", 0), ("float16", 1e-3), ("float32", 1e-7)])
def test_round_trip_batches_and_extras(serve, dtype, atol):
    reward = MeanReward()
    s = serve(reward)
    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    if dtype == "uint8":
        images = fixed_images(5, size=(8, 8))
    remote = client(s.url, batch_size=2, image_dtype=dtype)
    assert remote.remote_name == "mean"
    out = score(remote, images, PROMPTS[:5])
    torch.testing.assert_close(out.scores, images.mean((1, 2, 3)), atol=atol + 1e-7, rtol=0)
    torch.testing.assert_close(out.extras["red"], images[:, 0].mean((1, 2)), atol=atol + 1e-7, rtol=0)
    assert reward.batches == [2, 2, 1]


def test_no_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RewardServerError, match=r"failed after 2 attempt\(s\): cannot connect"):
        client(url, retries=1)
    assert time.monotonic() - t0 < 10


def test_slow_server_times_out(serve):
    s = serve(MeanReward(delay=1.5))
    remote = client(s.url, timeout=0.3, retries=1)
    with pytest.raises(RewardServerError, match="no reply within timeout = 0.3 s"):
        remote(fixed_images(2, size=(8, 8)), PROMPTS[:2])


def test_reward_exception_is_reported_not_retried(serve):
    reward = MeanReward(fail=True)
    s = serve(reward)
    with pytest.raises(RewardServerError, match="HTTP 500: reward 'mean' raised ValueError: the model exploded"):
        client(s.url, retries=3)(fixed_images(2, size=(8, 8)), PROMPTS[:2])
    assert reward.batches == [2]  # not retried: a deterministic failure


class FakeServer:
    """A server that answers /health correctly and /score with ``body_for(n_images)``."""

    def __init__(self, body_for):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body, ctype="application/octet-stream"):
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._reply(json.dumps({"status": "ok", "reward": "fake", "protocol": 1}).encode(), "application/json")

            def do_POST(self):
                from flowrl_plugins.rewards.http import decode_request

                images, _, _ = decode_request(self.rfile.read(int(self.headers["Content-Length"])))
                self._reply(body_for(images.shape[0]))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "body_for, message",
    [
        (lambda n: b"<html>502 Bad Gateway</html>", "malformed response .* not a safetensors body"),
        (lambda n: __import__("safetensors.torch").torch.save({"score": torch.zeros(n)}), "no 'scores' tensor"),
        (lambda n: __import__("safetensors.torch").torch.save({"scores": torch.zeros(n - 1)}),
         r"returned 'scores' of shape \(1,\) for a batch of 2 images"),
        (lambda n: __import__("safetensors.torch").torch.save({"scores": torch.zeros(n, dtype=torch.int64)}),
         "'scores' has dtype torch.int64"),
    ],
    ids=["not-safetensors", "no-scores", "wrong-length", "wrong-dtype"],
)
def test_bad_responses_raise(body_for, message):
    fake = FakeServer(body_for)
    try:
        with pytest.raises(RewardServerError, match=message):
            client(fake.url)(fixed_images(2, size=(8, 8)), PROMPTS[:2])
    finally:
        fake.close()


def test_server_rejects_malformed_requests(serve):
    s = serve(MeanReward())
    bad = [b"not safetensors", encode_request(fixed_images(2, size=(8, 8)), ["only one", "x"], None, "uint8")[:-5]]
    from safetensors.torch import save

    bad.append(save({"images": torch.zeros(2, 3, 4, 4, dtype=torch.uint8)}, metadata={"prompts": json.dumps(["a"])}))
    for body in bad:
        request = urllib.request.Request(s.url + "/score", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 400
        assert "malformed request" in json.loads(info.value.read())["error"]


SLOW_SERVER = textwrap.dedent('''
    import sys, time
    from flowrl.interfaces import RewardOutput
    from flowrl_plugins.rewards.http import make_server

    class Slow:
        name = "slow"
        def __call__(self, images, prompts, metadata=None):
            print("scoring", flush=True)
            time.sleep(60)
            return RewardOutput(scores=images.mean((1, 2, 3)))

    server = make_server(Slow(), name="slow", port=0)
    print(server.url, flush=True)
    server.serve_forever()
''')


def _read_line(proc, timeout: float) -> str:
    box = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert box and box[0], f"no output from the server within {timeout} s: {proc.stderr.read() if proc.poll() is not None else ''}"
    return box[0].strip()


def test_server_killed_mid_request_raises():
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        url = _read_line(proc, 60)
        remote = client(url, timeout=60, retries=2, retry_wait=0.05)
        errors = []

        def call():
            try:
                remote(fixed_images(2, size=(8, 8)), PROMPTS[:2])
            except Exception as exc:  # recorded for the main thread
                errors.append(exc)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        assert _read_line(proc, 30) == "scoring"  # the request is in flight
        proc.kill()
        worker.join(30)
        assert not worker.is_alive(), "the client hung after the server died"
        assert len(errors) == 1 and isinstance(errors[0], RewardServerError), errors
        assert "failed after 3 attempt(s)" in str(errors[0])
        assert "cannot connect" in str(errors[0])  # the last retry found nothing listening
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_cli_serve_round_trip_and_errors(flowrl_cli, tmp_path):
    from flowrl_plugins.embedded.rewards import brightness

    proc = subprocess.Popen([str(flowrl_cli.script), "reward", "serve", "brightness", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=flowrl_cli.env())
    try:
        line = _read_line(proc, 90)
        assert line.startswith("serving reward 'brightness' on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].split()[0]
        images = fixed_images(3, size=(32, 32), seed=4)
        remote = client(url)
        assert remote.remote_name == "brightness"
        torch.testing.assert_close(remote(images, PROMPTS[:3]).scores, brightness(images, PROMPTS[:3]))
    finally:
        proc.terminate()
        proc.wait(10)
    recipe = tmp_path / "remote.toml"
    recipe.write_text(tiny_recipe(run=None, sampler=None, chunker=None, log=None,
                                  train={"iterations": 1, "prompts_per_iteration": None, "group_size": None,
                                         "micro_batch_size": None},
                                  rewards=[{"use": "http", "url": f"http://127.0.0.1:{free_port()}", "retries": 0}]))
    bad_key, bad_set, unknown, train = flowrl_cli.batch([
        ["reward", "serve", "pickscore", "--set", "nosuchkey=1", "--port", "0"],
        ["reward", "serve", "pickscore", "--set", "scale", "--port", "0"],
        ["reward", "serve", "pikscore", "--port", "0"],
        ["train", str(recipe), "-o", str(tmp_path / "run")],
    ])
    assert bad_key.returncode == 2 and "unknown key 'nosuchkey'" in bad_key.flat_err and "Traceback" not in bad_key.stderr
    assert bad_set.returncode == 2 and "must look like key=value" in bad_set.flat_err
    assert unknown.returncode == 2 and "did you mean 'pickscore'" in unknown.flat_err
    # a training run whose reward server is down stops before training, with one clear message
    assert train.returncode == 2, train.stderr
    assert "failed after 1 attempt(s): cannot connect" in train.flat_err and "Traceback" not in train.stderr
