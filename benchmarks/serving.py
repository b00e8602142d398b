"""Serving throughput and latency of HELM models next to their Euclidean twins under ``transformers serve``, in one run.

Pairs (``--pairs``): ``helm-d``: ``tiny-helm-d`` vs ``tiny-llama``; ``mice``: ``tiny-helm-mice`` vs
``tiny-deepseek-v3``. Each model is built from its preset (seed 0, random weights), saved with ``save_pretrained``
next to the tokenizer (``--tokenizer``, default the main job's ``data/default/tokenizer``) and served on the loopback
address by ``python -m helm.serve`` (the twins too, so both go through the same launcher; theirs are transformers'
own classes), ``--device cpu``, once without and once with ``--continuous-batching`` (``--modes``; a paged cache of
``--cb-num-blocks`` pages of ``--cb-block-size`` tokens, at most ``--cb-max-batch-tokens`` tokens a step).

For each number of concurrent clients (``--clients``, default 1, 4 and 16), ``--requests`` streamed greedy
``/v1/completions`` requests of ``--new-tokens`` tokens each (a different prompt of ``--prompt-tokens`` tokens each;
the saved generation config has no eos, so every request runs its full length) are sent by that many client threads;
measured: **requests per second** (requests / wall time from the first send to the last answer) and **time to first
token** (mean, from a request's send to its first chunk with text). The two servers of a pair run side by side and
the measurements alternate between them, so a change in machine load hits both; best of ``--repeats`` (highest
requests/s, lowest mean TTFT). A model whose requests fail (DeepSeek-V3 under continuous batching in transformers
5.24: its latent does not fit the paged cache) reads ``fails`` in its rows, the error printed under the table.

The server processes share the machine with this script's client threads; ``--threads`` sets each server's
``OMP_NUM_THREADS`` (default 1: with torch's default of one thread per core, two servers and the clients
oversubscribe a 2-core machine, and tiny-llama's parallel ops then took ten times as long). Ratios are HELM / twin:
above 1 for requests/s means HELM serves more, above 1 for TTFT means HELM answers later.

Usage: ``python benchmarks/serving.py [--pairs helm-d mice] [--modes plain cb] [--clients 1 4 16] [--requests 32]
[--new-tokens 16] [--prompt-tokens 32] [--repeats 2] [--threads 1] [--tokenizer PATH] [--cb-num-blocks 128]
[--cb-block-size 32] [--cb-max-batch-tokens 256] [--keep-logs DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import helm  # noqa: E402
from helm.data.paths import TOKENIZER_FILES, check_path  # noqa: E402

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServerProcess:
    """``python -m helm.serve MODEL ARGS --host HOST --port PORT`` in a child process that leads its own process
    group, its output (stdout and stderr) written to ``log``; ``port`` defaults to a free one.

    A context manager: on entry it returns once ``GET /health`` answers 200 (``RuntimeError`` with the log's tail
    when the process exits first or ``startup_timeout`` seconds pass); on exit, whatever happened, the whole group
    is stopped (SIGTERM, then SIGKILL after ``stop_timeout`` seconds), so no server outlives its user.
    """

    def __init__(self, model: str | os.PathLike, *args: str, host: str = "127.0.0.1", port: int | None = None,
                 log: str | os.PathLike, env: dict | None = None, startup_timeout: float = 120.0,
                 stop_timeout: float = 10.0):
        self.model, self.args, self.host = os.fspath(model), [str(a) for a in args], host
        self.port = free_port(host) if port is None else port
        self.log, self.env = Path(log), env
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:] if self.log.exists() else ""

    def launch(self) -> "ServerProcess":
        """Start the server's process without waiting for it (:meth:`wait_ready` waits)."""
        command = [sys.executable, "-m", "helm.serve", self.model, *self.args, "--host", self.host,
                   "--port", str(self.port)]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, start_new_session=True)
        return self

    def wait_ready(self) -> "ServerProcess":
        """Return once ``/health`` answers 200; ``RuntimeError`` with the log's tail when the process exits first or
        ``startup_timeout`` seconds (from now) pass, the server then stopped."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} before it answered; "
                                   f"{self.log}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer on {self.url}/health within {self.startup_timeout} s; "
                           f"{self.log}:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL if it is still there after ``stop_timeout``."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(self.stop_timeout)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "ServerProcess":
        try:
            return self.launch().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


PAIRS = {"helm-d": ("tiny-helm-d", "tiny-llama"), "mice": ("tiny-helm-mice", "tiny-deepseek-v3")}
WORDS = ("the a one two three four five six seven red blue green cat dog bird river stone tree house light runs sits "
         "sings flows over under near slowly quickly and then water ice rain spring summer king land people said "
         "lord came went").split()


def save_model(preset: str, tokenizer, folder: Path) -> Path:
    """``preset`` built with seed 0 at the tokenizer's vocabulary, saved with it into ``folder/preset``; its
    generation config has no eos, so a request always runs its full ``max_tokens``."""
    torch.manual_seed(0)
    config = helm.load_config(preset, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    path = folder / preset
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` different texts of ``length`` tokens each (seeded words, cut to length and decoded back)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(2 * length)), add_special_tokens=False)["input_ids"]
        texts.append(tokenizer.decode(ids[:length]))
    return texts


def streamed_request(server: ServerProcess, model: str, prompt: str, new_tokens: int) -> tuple[float, float]:
    """Send one streamed greedy completion; ``(seconds to the first chunk with text, seconds to the end)``. A failed
    request (an HTTP error, an error event, or fewer tokens than asked) raises ``RuntimeError`` with the server's
    message."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start, first, usage = time.perf_counter(), None, None
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            for line in answer:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise RuntimeError(str(event["error"]).splitlines()[0])
                if first is None and event["choices"] and event["choices"][0].get("text"):
                    first = time.perf_counter() - start
                usage = event.get("usage") or usage
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"HTTP {error.code}: {error.read().decode(errors='replace')[:200]}") from None
    if usage is None or usage["completion_tokens"] != new_tokens or first is None:
        raise RuntimeError(f"the stream ended after {usage and usage['completion_tokens']} of {new_tokens} tokens")
    return first, time.perf_counter() - start


def run_level(server: ServerProcess, model: str, texts: list[str], clients: int,
              new_tokens: int) -> tuple[float, float]:
    """``(requests per second, mean seconds to the first token)`` of ``texts`` sent by ``clients`` threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda text: streamed_request(server, model, text, new_tokens), texts))
    wall = time.perf_counter() - start
    return len(texts) / wall, sum(first for first, _ in results) / len(results)


def measure_pair(pair: str, mode: str, folders: dict, args, logs: Path, env: dict) -> dict:
    """``{(preset, clients): (requests/s, TTFT s) or an error message}`` for the two models of ``pair``."""
    options = ["--device", "cpu"]
    if mode == "cb":
        options += ["--continuous-batching", "--cb-num-blocks", str(args.cb_num_blocks), "--cb-block-size",
                    str(args.cb_block_size), "--cb-max-batch-tokens", str(args.cb_max_batch_tokens)]
    servers = {preset: ServerProcess(folders[preset], *options, log=logs / f"{preset}-{mode}.log", env=env,
                                     startup_timeout=300) for preset in PAIRS[pair]}
    results: dict = {}
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_ready()
        tokenizer = AutoTokenizer.from_pretrained(folders[PAIRS[pair][0]])
        warm = prompts(tokenizer, 4, args.prompt_tokens, seed=1)
        for preset, server in servers.items():  # continuous batching builds its cache on the first request
            try:
                run_level(server, str(folders[preset]), warm, 4, 2)
            except RuntimeError as error:
                results.update({(preset, c): str(error) for c in args.clients})
        for clients in args.clients:
            texts = prompts(tokenizer, args.requests, args.prompt_tokens, seed=clients)
            for _ in range(args.repeats):
                for preset, server in servers.items():
                    if isinstance(results.get((preset, clients)), str):
                        continue
                    try:
                        rate, ttft = run_level(server, str(folders[preset]), texts, clients, args.new_tokens)
                    except RuntimeError as error:
                        results[preset, clients] = str(error)
                        continue
                    best = results.get((preset, clients), (0.0, float("inf")))
                    results[preset, clients] = (max(best[0], rate), min(best[1], ttft))
    finally:
        for server in servers.values():
            server.stop()
    return results


def cell(value, index: int, scale: float, digits: int) -> str:
    """Figure ``index`` of a measurement (scaled), or ``fails`` where it records a failure."""
    return "fails" if isinstance(value, str) else f"{value[index] * scale:.{digits}f}"


def report(results: dict, args) -> None:
    """One markdown table: per pair, mode and number of clients, both models' figures and HELM / twin; then each
    failure's message, once per model and mode."""
    print("\n| models | mode | clients | HELM req/s | twin req/s | req/s HELM / twin | HELM TTFT ms | twin TTFT ms "
          "| TTFT HELM / twin |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failures = {}
    for (pair, mode), figures in results.items():
        helm_preset, twin = PAIRS[pair]
        mode_name = "continuous batching" if mode == "cb" else "plain"
        for clients in args.clients:
            a, b = figures[helm_preset, clients], figures[twin, clients]
            failures.update({(preset, mode_name): value for preset, value in ((helm_preset, a), (twin, b))
                             if isinstance(value, str)})
            failed = isinstance(a, str) or isinstance(b, str)
            rate = "-" if failed else f"{a[0] / b[0]:.2f}"
            ttft = "-" if failed else f"{a[1] / b[1]:.2f}"
            row = [cell(a, 0, 1, 2), cell(b, 0, 1, 2), rate, cell(a, 1, 1e3, 0), cell(b, 1, 1e3, 0), ttft]
            print(f"| {helm_preset} vs {twin} | {mode_name} | {clients} | " + " | ".join(row) + " |")
    for (preset, mode_name), message in failures.items():
        print(f"\n{preset}, {mode_name}: fails: {message}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="serving.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=list(PAIRS))
    parser.add_argument("--modes", nargs="+", choices=["plain", "cb"], default=["plain", "cb"])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per measurement")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="each server's OMP_NUM_THREADS (default 1: two servers and the clients share the cores; "
                             "more threads than free cores stall torch's parallel ops)")
    parser.add_argument("--tokenizer", default="data/default/tokenizer",
                        help="a tokenizer folder (default: the main job's; python scripts/build_data.py builds it)")
    parser.add_argument("--cb-num-blocks", type=int, default=128)
    parser.add_argument("--cb-block-size", type=int, default=32)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=256)
    parser.add_argument("--keep-logs", default=None, help="a folder for the servers' logs (default: a temporary one)")
    args = parser.parse_args(argv)
    try:
        tokenizer_path = check_path(args.tokenizer, "--tokenizer", needs=TOKENIZER_FILES)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if min(args.clients) < 1 or args.requests < max(args.clients):
        parser.exit(2, f"{parser.prog}: error: --requests {args.requests} must be at least the largest --clients\n")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    env["OMP_NUM_THREADS"] = str(args.threads)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{args.threads} thread(s) per server; streamed greedy "
          f"completions of {args.new_tokens} tokens after {args.prompt_tokens}-token prompts, {args.requests} requests "
          f"per measurement, best of {args.repeats}; continuous batching: {args.cb_num_blocks} pages of "
          f"{args.cb_block_size} tokens, at most {args.cb_max_batch_tokens} tokens a step")
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(args.keep_logs or scratch)
        logs.mkdir(parents=True, exist_ok=True)
        folders = {preset: save_model(preset, tokenizer, Path(scratch)) for pair in args.pairs
                   for preset in PAIRS[pair]}
        results = {}
        for mode in args.modes:
            for pair in args.pairs:
                started = time.perf_counter()
                results[pair, mode] = measure_pair(pair, mode, folders, args, logs, env)
                print(f"  {pair}, {mode}: {time.perf_counter() - started:.0f} s", flush=True)
    report(results, args)


if __name__ == "__main__":
    main()
