"""`ray job submit` the way the docs say, as a new user would: a fresh `ray start --head` that finds
a token (Ray 2.60 then turns token authentication on), and examples/ray_job.sh run with nothing but
RAY_ADDRESS set. The job trains the tiny policy for one step on the CPU and writes its metrics.

The head runs on free loopback ports, with its own temporary folder and its own HOME (so its own
~/.ray/auth_token), in a session of its own: it is stopped with SIGTERM, then anything left in
that session is killed, never another Ray on the machine."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from rl_integration.config import load_config
from rl_integration.metrics import read_jsonl
from rl_integration.trainer import load_policy
from tests.rl_integration.conftest import TINY_RUN

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
              "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
              "runtime-env-agent-port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_ports() -> tuple[dict, range]:
    """Distinct free ports for the head's components, none inside the workers' port range."""
    low = free_port()
    workers, taken = range(low, low + 50), set()
    ports = {}
    for name in HEAD_PORTS:
        port = free_port()
        while port in workers or port in taken:
            port = free_port()
        ports[name] = port
        taken.add(port)
    return ports, workers


def start_head(ray: str, env: dict, temp_dir: str, log) -> tuple[subprocess.Popen, int]:
    ports, workers = head_ports()
    args = [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
            "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}", "--include-dashboard=true",
            "--disable-usage-stats", f"--min-worker-port={workers.start}", f"--max-worker-port={workers.stop - 1}",
            *[f"--{name}={port}" for name, port in ports.items()]]
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, ports["dashboard-port"]


def wait_for_dashboard(proc: subprocess.Popen, port: int, log_path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2):
                return
        except OSError as e:  # refused while starting; 401 once up with auth on
            if getattr(e, "code", None) in (401, 403):
                return
        time.sleep(1.0)
    pytest.fail(f"the Ray dashboard did not come up in {timeout:.0f}s:\n{open(log_path).read()[-3000:]}")


def stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` (it drains and stops what it started), then SIGKILL to
    whatever is still in its session (by process id, read from /proc)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_pids(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # fields after the command: state, ppid, pgrp, session
                pids.append(int(name))
    return pids


def test_ray_job_submit_with_token_authentication(tmp_path):
    ray = shutil.which("ray", path=os.path.dirname(sys.executable))
    if ray is None or not sys.platform.startswith("linux"):
        pytest.skip("needs the `ray` command beside this Python, on Linux")
    cache = tmp_path / "cache"
    load_policy(load_config(None, TINY_RUN + [f"policy.cache_dir={cache}"]), progress=False)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(tmp_path / "home"), PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
    temp_dir = tempfile.mkdtemp(prefix="sp-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    log_path = str(tmp_path / "head.log")
    with open(log_path, "w") as log:
        proc, port = start_head(ray, env, temp_dir, log)
    try:
        wait_for_dashboard(proc, port, log_path)
        address = f"http://127.0.0.1:{port}"
        bare = subprocess.run([ray, "job", "list", "--address", address], env=env, capture_output=True, text=True,
                              timeout=120)
        assert bare.returncode != 0 and "Authentication required" in bare.stderr + bare.stdout  # auth is on
        out = tmp_path / "out"
        overrides = TINY_RUN + [f"policy.cache_dir={cache}", "rollout.num_workers=1", "rollout.num_gpus_per_worker=0",
                                "rollout.engine.device=cpu", "trainer.device=cpu", "trainer.steps=1", "rollout.n=2",
                                "output.plot=false", f"output.dir={out}"]
        job = subprocess.run(["examples/ray_job.sh", "examples/grpo_ray.yaml", *overrides], cwd=ROOT,
                             env=dict(env, RAY_ADDRESS=address, SPECTAIL_JOB_PIP="[]"), capture_output=True,
                             text=True, timeout=400)
        assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
        assert "succeeded" in job.stdout and "RolloutWorker" in job.stdout  # the rollout ran on a Ray actor
        (record,) = read_jsonl(out / "metrics.jsonl")
        assert record["step"] == 0 and record["num_samples"] == 16 and record["generated_tokens"] > 0
    finally:
        stop_head(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
