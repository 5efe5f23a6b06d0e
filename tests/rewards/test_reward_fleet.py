"""The reward fleet (`flowrl reward serve NAME --backend litserve`): two replicas on 127.0.0.1.

Concurrent clients (threads and processes) get exactly the scores the reward computes
in-process; requests from several clients are batched; a replica killed with SIGKILL in the
middle of scoring costs no score (its requests are answered 503 and retried elsewhere, each
reply matched to its request by id) and is replaced; a request that kills every replica fails
loudly after the client's retries; SIGKILL of the fleet's own process ends all its children.
Every wait is bounded; the servers stop at the end.

Needs the `fleet` extra (LitServe); skipped without it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from reward_helpers import fixed_images

pytest.importorskip("litserve", reason="the reward fleet needs the 'fleet' extra: pip install -c constraints/cpu.txt -e '.[fleet]'")

import fleet_helpers  # noqa: E402

from flowrl.serving.protocol import REQUEST_ID_HEADER, encode_request, safetensors_metadata  # noqa: E402
from flowrl_plugins.rewards.http import HttpReward, HttpRewardConfig, RewardServerError  # noqa: E402

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Fleet:
    """A fleet process; its output is drained by threads so that it never blocks on a pipe."""

    def __init__(self, argv, env, timeout: float = 90):
        self.proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                pytest.fail(f"the fleet did not start within {timeout} s:\n{''.join(self.stderr)[-3000:]}")
            if line.startswith("serving reward"):
                self.line = line.strip()
                self.url = self.line.split(" on ", 1)[1].split()[0]
                return

    @staticmethod
    def _drain(stream, sink):
        for line in stream:
            sink(line)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the fleet shuts its replicas down
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def health(url):
    try:
        with _OPENER.open(url + "/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_ready(url, replicas: int, timeout: float = 45):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, info = health(url)
        if status == 200 and info["ready"] >= replicas:
            return info
        time.sleep(0.2)
    pytest.fail(f"{url} did not have {replicas} ready replicas within {timeout} s: {info}")


def post(url, body, request_id=None):
    request = urllib.request.Request(url + "/score", data=body, method="POST")
    request.add_header("Content-Type", "application/octet-stream")
    if request_id:
        request.add_header(REQUEST_ID_HEADER, request_id)
    try:
        with _OPENER.open(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def remote(url, **kw):
    kw.setdefault("retry_wait", 0.2)
    return HttpReward(HttpRewardConfig(url=url, **kw))


CLIENT_PROCESS = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[3])
    from reward_helpers import fixed_images
    from flowrl_plugins.embedded.rewards import brightness
    from flowrl_plugins.rewards.http import HttpReward, HttpRewardConfig
    reward = HttpReward(HttpRewardConfig(url=sys.argv[1], batch_size=3))
    equal = []
    for call in range(4):
        images = fixed_images(7, seed=int(sys.argv[2]) * 100 + call)
        prompts = [f"p{call}-{i}" for i in range(7)]
        equal.append(torch.equal(reward(images, prompts).scores, brightness(images, prompts)))
    print(json.dumps(equal))
''')


@pytest.mark.slow
def test_cli_fleet_scores_concurrent_clients_exactly_as_in_process(flowrl_cli, tmp_path):
    from flowrl_plugins.embedded.rewards import brightness

    fleet = Fleet([flowrl_cli.script, "reward", "serve", "brightness", "--backend", "litserve", "--replicas", "2",
                   "--max-batch", "8", "--max-wait", "0.02", "--port", "0"], env=flowrl_cli.env())
    try:
        assert fleet.url.startswith("http://127.0.0.1:"), fleet.line
        assert "2 replica(s)" in fleet.line and "max batch 8" in fleet.line
        status, info = health(fleet.url)
        assert status == 200 and info == {"status": "ok", "reward": "brightness", "protocol": 1, "backend": "litserve",
                                          "replicas": 2, "ready": 2}
        helpers = os.path.dirname(fleet_helpers.__file__)
        processes = [subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, fleet.url, str(k), helpers],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=flowrl_cli.env())
                     for k in (1, 2)]
        results, errors = {}, []

        def client(k):
            try:
                reward = remote(fleet.url, batch_size=3)
                for call in range(5):
                    images = fixed_images(7, seed=1000 * k + call)
                    prompts = [f"t{k}-{call}-{i}" for i in range(7)]
                    results[(k, call)] = (reward(images, prompts), brightness(images, prompts))
            except Exception as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(results) == 20
        for out, reference in results.values():
            assert torch.equal(out.scores, reference)  # identical, not merely close
        for p in processes:
            stdout, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr
            assert json.loads(stdout) == [True] * 4
        # an old client that sends no request id is still served; a malformed body is a 400
        images = fixed_images(2, size=(8, 8))
        status, body = post(fleet.url, encode_request(images, ["a", "b"], None, "uint8"))
        assert status == 200 and "request_id" not in safetensors_metadata(body)
        status, body = post(fleet.url, b"not safetensors")
        assert status == 400 and json.loads(body)["error"].startswith("malformed request: body is not a safetensors file")
    finally:
        fleet.stop()
    assert fleet.proc.returncode is not None


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory):
    """Two replicas of fleet_helpers.SlowReward (0.4 s a call), max batch 4, devices cpu:a / cpu:b."""
    log_dir = tmp_path_factory.mktemp("fleet_log")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    fleet = Fleet(fleet_helpers.server_command(0.4, log_dir), env=env)
    yield fleet, log_dir
    fleet.stop()


@pytest.mark.slow
def test_requests_from_many_clients_are_batched(slow_fleet):
    fleet, log_dir = slow_fleet
    wait_ready(fleet.url, 2)
    replies, barrier = {}, threading.Barrier(7)

    def send(k):
        images = fixed_images(2, size=(8, 8), seed=k)
        body = encode_request(images, [f"b{k}", f"b{k}"], None, "uint8", request_id=f"batch-{k}")
        barrier.wait(10)
        replies[k] = (images, *post(fleet.url, body, request_id=f"batch-{k}"))

    def send_bad():
        barrier.wait(10)
        replies["bad"] = post(fleet.url, b"\x08" + b"\x00" * 7 + b"{}")

    threads = [threading.Thread(target=send, args=(k,)) for k in range(6)] + [threading.Thread(target=send_bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    status, body = replies.pop("bad")
    assert status == 400 and "malformed request" in json.loads(body)["error"]  # the others are unaffected
    sizes = []
    for k, (images, status, body) in replies.items():
        assert status == 200, body
        meta = safetensors_metadata(body)
        assert meta["request_id"] == f"batch-{k}"
        from safetensors.torch import load

        assert torch.equal(load(body)["scores"], fleet_helpers.expected(images))
        sizes.append(int(meta["batch_requests"]))
    assert max(sizes) > 1 and max(sizes) <= 4, sizes  # batched across clients, within --max-batch
    starts = [e for e in fleet_helpers.events(log_dir) if e["event"] == "start"]
    devices = {e["pid"]: e["device"] for e in starts}
    assert set(devices.values()) <= {"cpu:a", "cpu:b"} and len(set(devices.values())) == len(devices), devices


@pytest.mark.slow
def test_replica_killed_mid_run_loses_and_duplicates_nothing(slow_fleet):
    fleet, log_dir = slow_fleet
    wait_ready(fleet.url, 2)
    seen = fleet_helpers.log_positions(log_dir)
    results, errors = {}, []

    def client(k):
        try:
            reward = remote(fleet.url, batch_size=2, retries=3, timeout=40)
            for call in range(3):
                images = fixed_images(4, size=(8, 8), seed=100 * k + call)
                results[(k, call)] = (images, reward(images, [f"k{k}-c{call}-{i}" for i in range(4)]))
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    # the replicas hold every call after its `start` until the victim is dead, so the kill lands
    # in the middle of a call however late this thread sees the `start` on a loaded machine
    hold = log_dir / "hold"
    hold.touch()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    try:
        while True:  # the first replica to start scoring is the victim, killed in the middle of it
            started = [e for e in fleet_helpers.events(log_dir, after=seen) if e["event"] == "start"]
            if started:
                break
            assert time.monotonic() < deadline, "no replica started scoring"
            time.sleep(0.02)
        victim = started[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
    finally:
        hold.unlink()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(results) == [(k, c) for k in range(4) for c in range(3)]  # no call lost
    for images, out in results.values():  # each reply is its own request's (scores are unique per image)
        assert torch.equal(out.scores, fleet_helpers.expected(images))
        assert torch.equal(out.extras["red"], images[:, 0].mean((1, 2)))
    events = fleet_helpers.events(log_dir, after=seen)
    done_by_victim = {p for e in events if e["event"] == "done" and e["pid"] == victim for p in e["prompts"]}
    interrupted = [p for e in events if e["event"] == "start" and e["pid"] == victim for p in e["prompts"]
                   if p not in done_by_victim]
    assert interrupted, "the kill did not interrupt a request in flight"
    for prompt in interrupted:  # scored again by another replica, well before the client's 40 s timeout
        redone = [e for e in events if e["event"] == "done" and e["pid"] != victim and prompt in e["prompts"]]
        assert redone and redone[0]["t"] - killed_at < 15, (prompt, redone)
    assert wait_ready(fleet.url, 2)["ready"] == 2  # the killed replica was replaced


@pytest.mark.slow
def test_a_request_that_kills_every_replica_fails_loudly(slow_fleet):
    fleet, _ = slow_fleet
    wait_ready(fleet.url, 2)
    reward = remote(fleet.url, retries=1, timeout=40)
    with pytest.raises(RewardServerError,
                       match=r"failed after 2 attempt\(s\): HTTP 503: the replica \(pid \d+\) scoring request \w+ died"):
        reward(fixed_images(2, size=(8, 8)), ["crash", "x"])
    wait_ready(fleet.url, 2, timeout=50)  # both replicas restarted; the fleet serves on
    images = fixed_images(2, size=(8, 8), seed=5)
    assert torch.equal(reward(images, ["a", "b"]).scores, fleet_helpers.expected(images))


@pytest.mark.slow
def test_fleet_options_and_setup_errors_are_clear(flowrl_cli):
    bad_key, no_backend, bad_port, bad_replicas = flowrl_cli.batch([
        ["reward", "serve", "brightness", "--backend", "litserve", "--set", "nosuchkey=1", "--port", "0"],
        ["reward", "serve", "brightness", "--replicas", "2", "--max-batch", "4"],
        ["reward", "serve", "brightness", "--backend", "litserve", "--port", "80"],
        ["reward", "serve", "brightness", "--backend", "litserve", "--replicas", "0"],
    ], timeout=120)
    assert bad_key.returncode == 2, bad_key.stderr
    assert "a replica could not build the reward" in bad_key.flat_err and "unknown key 'nosuchkey'" in bad_key.flat_err
    assert "Traceback" not in bad_key.stderr
    assert no_backend.returncode == 2 and "--replicas, --max-batch need(s) --backend litserve" in no_backend.flat_err
    assert bad_port.returncode == 2 and "--port 80 is not in 1024-65535" in bad_port.flat_err
    assert bad_replicas.returncode == 2 and "--replicas must be at least 1" in bad_replicas.flat_err


def _children(pid: int) -> set[int]:
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found |= {int(c) for c in f.read().split()}
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_killing_the_fleet_process_ends_its_replicas(flowrl_cli):
    fleet = Fleet([flowrl_cli.script, "reward", "serve", "brightness", "--backend", "litserve", "--port", "0"],
                  env=flowrl_cli.env())
    children: set[int] = set()
    try:
        children = _children(fleet.proc.pid)
        assert len(children) >= 3, children  # LitServe's queue manager, a replica, the HTTP process
        fleet.proc.kill()  # SIGKILL: no chance to shut anything down itself
        fleet.proc.wait(10)
        deadline = time.monotonic() + 15
        while not all(_gone(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(c) for c in children), [c for c in children if not _gone(c)]
    finally:
        fleet.stop()
        for c in children:
            if not _gone(c):
                os.kill(c, signal.SIGKILL)
