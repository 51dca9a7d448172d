"""Load on `hcw serve` over loopback: aggregate decode tokens/s at 1, 4 and 8 concurrent streams
(the goal: >= 3x one stream's at 8), and time to first token (p50 / p99) at 8 streams with and
without a shared prefix; every request is counted, errors too.

The server runs as `hcw serve` does, in a process of its own; the clients are threads here, each
streaming its requests one after another through /v1/completions (token-id prompts, so lengths are
exact; greedy; `ignore_eos` so every answer is max_tokens long) on one keep-alive connection,
parsing every server-sent event's JSON. They use the standard library's http.client: they share
the machine's cores with the server, and httpx's streaming took ~10x its CPU per token, which the
server's streams then lost. The streams' rounds alternate their order, and each ratio is against
the one-stream run of the same round, on the same server.
With `--llama-server PATH` (a `llama-server` binary; by default the one on PATH) and `--llama-src`
(llama-cpp-python's unpacked sdist, for its GGUF converter), the same load also runs against
llama.cpp's server (`--parallel 8`, continuous batching, the same threads) on the Qwen3.5-style
model's own weights converted to an f32 GGUF: the one built-in model llama.cpp can load (hcw-tiny
is hcw's own hybrid architecture).

    python benchmarks/serve_load.py [--quick] [--no-write] [--models hcw-tiny,hcw-tiny-qwen3.5]
    python benchmarks/serve_load.py --llama-server /tmp/llbuild/bin/llama-server \
        --llama-src /tmp/llsd/llama_cpp_python-0.3.36
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402

STREAMS = (1, 4, 8)


def start(model: str, home: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    extra = ["--threads", str(threads)] if threads else []
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--model", model, "--port", "0",
                             "--max-batch", "8", *extra], cwd=ROOT, env={**os.environ, "HCW_HOME": home},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
    if not found:
        proc.kill()
        raise RuntimeError(f"hcw serve did not start: {line}{proc.stderr.read()}")
    return proc, found.group(1)


LLAMA_MODEL = "hcw-tiny-qwen3.5"  # the built-in model whose architecture llama.cpp has (Qwen3.5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_gguf(llama_src: Path, out: Path) -> Path:
    """The Qwen3.5-style built-in's own weights as an f32 GGUF (hcw serves it in fp32), by the
    converter in llama-cpp-python's sdist (benchmarks/vs_llamacpp.py), which detects the
    architecture from the config's `architectures`, which hcw's folder does not need."""
    from benchmarks.vs_llamacpp import convert
    from engine.model.loader import resolve_model

    src = out.parent / "hf"
    shutil.copytree(resolve_model(LLAMA_MODEL), src)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["Qwen3_5ForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    convert(src, llama_src, out, "f32")
    return out


def start_llama(binary: str, gguf: Path, threads: int, slots: int = 8, slot_ctx: int = 2048) -> tuple[subprocess.Popen, str]:
    """llama.cpp's server on `gguf`: `slots` parallel sequences of `slot_ctx` tokens each, continuous
    batching, `threads` threads; ready when /health answers 200."""
    port = free_port()
    # its log goes to a file: it writes a few lines per request, which would fill a pipe nobody reads
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
                             "--ctx-size", str(slots * slot_ctx), "--threads", str(threads), "--threads-batch", str(threads),
                             "--cont-batching", "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited ({proc.returncode}): {log.read()[-2000:]}")
        try:
            conn = connect(base)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not answer /health within 120 s")


def connect(base: str) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=600)


def one(conn: http.client.HTTPConnection, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, completion tokens) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read().decode()[:200]}")
    while line := r.readline():  # chunked transfer decoded by http.client
        line = line.rstrip(b"\r\n")
        if line == b"data: [DONE]":
            r.read()  # the response's end, so that the connection serves the next request
            break
        if not line.startswith(b"data: "):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if first is None and chunk.get("choices"):
            first = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if tokens != max_tokens:  # ignore_eos: every answer is max_tokens long, else it is not counted
        raise RuntimeError(f"{tokens} completion tokens, not {max_tokens}")
    return first or 0.0, tokens


def load(base: str, model: str, streams: int, prompts: list[list[int]], max_tokens: int,
         reconnect: bool = False) -> dict:
    """`streams` clients share the prompts out and run theirs one after another, on one keep-alive
    connection each (`reconnect`: a new connection per request, for a server that closes its end
    after a streamed response, as llama-server does)."""
    per = [prompts[i::streams] for i in range(streams)]
    ttfts: list[float] = []
    tokens, errors = [0], [0]
    lock = threading.Lock()

    def client(mine: list[list[int]]) -> None:
        conn = connect(base)
        try:
            for p in mine:
                try:
                    ttft, n = one(conn, model, p, max_tokens)
                except (RuntimeError, OSError, http.client.HTTPException):
                    with lock:
                        errors[0] += 1
                    conn.close()  # the next request on a fresh connection
                    conn = connect(base)
                    continue
                with lock:
                    ttfts.append(ttft)
                    tokens[0] += n
                if reconnect:
                    conn.close()  # http.client opens a new connection for the next request
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(m,)) for m in per]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {"tok_s": tokens[0] / wall, "tokens": tokens[0], "requests": len(prompts), "errors": errors[0],
            "ttft_p50": statistics.median(ttfts) if ttfts else 0.0,
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else 0.0}


def measure(model: str, rounds: int, requests: int, max_tokens: int, prefix: int, threads: int | None,
            llama: tuple[str, Path] | None = None) -> dict:
    """The load on `hcw serve --model model`, or with `llama` (binary, GGUF) on llama.cpp's server."""
    rng = random.Random(0)
    home = tempfile.mkdtemp(prefix="hcw-serve-load-")
    if llama is None:
        proc, base = start(model, home, threads)
    else:
        proc, base = start_llama(llama[0], llama[1], threads or max(1, (os.cpu_count() or 2) - 1))
    run = functools.partial(load, reconnect=llama is not None)
    try:
        # ids below 256 are in every built-in's vocabulary
        fresh = lambda n, k: [[rng.randrange(256) for _ in range(k)] for _ in range(n)]  # noqa: E731
        run(base, model, 2, fresh(2, 64), 8)  # first calls (allocations, native kernels) out of the way
        by_streams: dict[int, list[dict]] = {s: [] for s in STREAMS}
        for r in range(rounds):
            for s in STREAMS if r % 2 == 0 else reversed(STREAMS):
                by_streams[s].append(run(base, model, s, fresh(max(requests, s), 64), max_tokens))
        shared_head = fresh(1, prefix)[0]
        run(base, model, 1, [shared_head + [1]], 1)  # the shared prefix into the cache
        shared = run(base, model, 8, [shared_head + t for t in fresh(requests, 32)], 16)
        unshared = run(base, model, 8, fresh(requests, prefix + 32), 16)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(home, ignore_errors=True)
    one_stream = [x["tok_s"] for x in by_streams[1]]
    out = {"model": model, "server": "llama-server" if llama else "hcw serve", "streams": {}, "shared": shared,
           "unshared": unshared}
    for s in STREAMS:
        runs = by_streams[s]
        out["streams"][s] = {"tok_s": statistics.median(x["tok_s"] for x in runs),
                             "ratio": statistics.median(x["tok_s"] / b for x, b in zip(runs, one_stream)),
                             "errors": sum(x["errors"] for x in runs), "requests": sum(x["requests"] for x in runs)}
    return out


def table(results: list[dict], max_tokens: int, prefix: int) -> str:
    lines = ["| server | model | streams | aggregate tok/s | vs one stream | requests | errors |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for s, x in r["streams"].items():
            lines.append(f"| {r['server']} | {r['model']} | {s} | {x['tok_s']:.1f} | {x['ratio']:.2f}x | "
                         f"{x['requests']} | {x['errors']} |")
    lines += ["", f"Time to first token at 8 streams, prompts of {prefix} + 32 tokens, 16 tokens each:", "",
              "| server | model | prefix | TTFT p50 ms | TTFT p99 ms | requests | errors |", "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        for name in ("shared", "unshared"):
            x = r[name]
            lines.append(f"| {r['server']} | {r['model']} | {name} | {1000 * x['ttft_p50']:.1f} | "
                         f"{1000 * x['ttft_p99']:.1f} | {x['requests']} | {x['errors']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="hcw-tiny,hcw-tiny-qwen3.5")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads (default: its own)")
    parser.add_argument("--llama-server", default=shutil.which("llama-server"),
                        help="llama.cpp's server binary (default: llama-server on PATH)")
    parser.add_argument("--llama-src", type=Path, default=None,
                        help="llama-cpp-python's unpacked sdist (its GGUF converter); with --llama-server")
    args = parse_args(parser)
    rounds, requests, max_tokens, prefix = (1, 8, 32, 256) if args.quick else (3, 16, 128, 512)
    results = [measure(m, rounds, requests, max_tokens, prefix, args.threads) for m in args.models.split(",")]
    if args.llama_server and args.llama_src:
        with tempfile.TemporaryDirectory(prefix="hcw-serve-load-gguf-") as tmp:
            gguf = llama_gguf(args.llama_src, Path(tmp) / "model-f32.gguf")
            results.append(measure(LLAMA_MODEL, rounds, requests, max_tokens, prefix, args.threads,
                                   (args.llama_server, gguf)))
        note = (f"llama.cpp's server ({_llama_version(args.llama_server)}) ran `--parallel 8 --cont-batching` on "
                f"{LLAMA_MODEL}'s weights as an f32 GGUF (its converter), on one thread fewer than the cores (hcw "
                f"serve's default) unless --threads, driven by the same clients.")
    else:
        note = ("llama.cpp's `llama-server --parallel 8` on the same weights: not run: "
                + ("no --llama-src for the GGUF converter." if args.llama_server else
                   "no `llama-server` on PATH on this machine (the bench-llamacpp extra builds the Python binding, "
                   "not the server; pass --llama-server)."))
    body = table(results, max_tokens, prefix)
    threads = f"--threads {args.threads}" if args.threads else "its default threads"
    body = (f"`hcw serve` ({threads}) in its own process, loopback clients streaming /v1/completions: {max_tokens}-token greedy "
            f"answers (ignore_eos) to 64-token prompts, {rounds} round(s) alternating the order of the stream "
            f"counts; a ratio is the median over rounds of aggregate tokens/s (prefill included) over the same "
            f"round's one stream.\n\n{body}\n\n{note}")
    if args.json:
        print(json.dumps(results))
    else:
        print(body)
    if not args.no_write:
        write_section("serve", "Serving load (`benchmarks/serve_load.py`)", body)


def _llama_version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"version: (.+)", done.stdout + done.stderr)
    return f"llama-server {found.group(1).strip()}" if found else "llama-server"


if __name__ == "__main__":
    main()
