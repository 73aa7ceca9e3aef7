"""Load benchmark for `strata serve` (not a test): N concurrent streaming clients for a bounded time.

Usage: python ci/serve_load.py URL --clients N --seconds S --max-tokens T [--out FILE.md] [--command TEXT]
Each client loops: a streamed chat completion with a unique prompt prefix (so no prefix-cache reuse hides
work), timing the first content chunk (TTFT) and the gaps between chunks (inter-token latency). At the end it
checks that nothing was lost: every request sent ended with [DONE] and usage, or with an explicit error, and
the server's request counter agrees. RSS is read from /proc for the front and the worker.
"""

import argparse
import json
import os
import statistics
import threading
import time

import httpx


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def client(url, deadline, max_tokens, idx, out, lock):
    n = 0
    with httpx.Client(timeout=600) as http:
        while time.monotonic() < deadline:
            n += 1
            body = {
                "messages": [{"role": "user", "content": f"[{idx}-{n}] Tell me about the sea."}],
                "max_tokens": max_tokens,
                "temperature": 0.7,
                "seed": n,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rec = {"ok": False, "ttft": None, "gaps": [], "tokens": 0, "error": None}
            t0 = time.monotonic()
            last = None
            try:
                with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        rec["error"] = f"HTTP {r.status_code}"
                        r.read()
                    else:
                        done = False
                        for line in r.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line[6:]
                            if data == "[DONE]":
                                done = True
                                break
                            chunk = json.loads(data)
                            if "error" in chunk:
                                rec["error"] = chunk["error"]["message"]
                                break
                            if chunk.get("usage"):
                                rec["tokens"] = chunk["usage"]["completion_tokens"]
                            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                                now = time.monotonic()
                                if rec["ttft"] is None:
                                    rec["ttft"] = now - t0
                                else:
                                    rec["gaps"].append(now - last)
                                last = now
                        rec["ok"] = done and rec["error"] is None and rec["tokens"] > 0
                        if not rec["ok"] and rec["error"] is None:
                            rec["error"] = "stream ended without [DONE] and usage"
            except httpx.HTTPError as e:
                rec["error"] = f"{type(e).__name__}: {e}"
            with lock:
                out.append(rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    url = a.url.rstrip("/")
    health = httpx.get(url + "/health").json()
    # strata serve says its worker's pid; another server (llama-server, for a side-by-side run) does not.
    worker = health.get("worker_pid") or 0
    front = int(os.environ.get("STRATA_SERVE_PID", "0"))
    records, lock = [], threading.Lock()
    start = time.monotonic()
    deadline = start + a.seconds
    threads = [
        threading.Thread(target=client, args=(url, deadline, a.max_tokens, i, records, lock)) for i in range(a.clients)
    ]
    peak = {"front": 0.0, "worker": 0.0}
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if worker:
            peak["worker"] = max(peak["worker"], rss_mib(worker))
        if front:
            peak["front"] = max(peak["front"], rss_mib(front))
        time.sleep(0.5)
    wall = time.monotonic() - start
    ok = [r for r in records if r["ok"]]
    errors = [r for r in records if not r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None]
    gaps = [g * 1e3 for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    metrics = httpx.get(url + "/metrics").text if worker else ""
    served = sum(
        float(l.rsplit(" ", 1)[1])
        for l in metrics.splitlines()
        if l.startswith('strata_requests_total{endpoint="/v1/chat/completions"')
    ) if worker else len(records)
    lost = len(records) - len(ok) - len(errors)
    rows = [
        ("clients", f"{a.clients}"),
        ("duration (s)", f"{wall:.1f} (clients stop starting requests after {a.seconds:.0f})"),
        ("max_tokens per request", f"{a.max_tokens}"),
        ("requests completed / errors", f"{len(ok)} / {len(errors)}"),
        ("requests/s", f"{len(ok) / wall:.2f}"),
        ("generated tokens/s (all clients)", f"{tokens / wall:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{pct(ttft, 50):.0f} / {pct(ttft, 99):.0f}"),
        ("inter-token p50 / p99 (ms)", f"{pct(gaps, 50):.1f} / {pct(gaps, 99):.1f}"),
        ("mean inter-token (ms)", f"{statistics.mean(gaps):.1f}" if gaps else "n/a"),
        ("peak RSS front / worker (MiB)", f"{peak['front']:.0f} / {peak['worker']:.0f}"),
        ("lost (sent, neither answered nor failed)", f"{lost}"),
        ("server-counted chat requests", f"{served:.0f} (client sent {len(records)})"),
    ]
    table = "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    print(table)
    if errors:
        print("errors:", sorted({str(r["error"]) for r in errors}))
    if a.out:
        with open(a.out, "w") as f:
            f.write("# strata serve load benchmark\n\n")
            f.write(f"Command: `{a.command}`\n\n")
            f.write(
                "Each client streams chat completions back to back (unique prompt prefix, temperature 0.7); TTFT is "
                "the time to the first content chunk, inter-token the gap between content chunks, both measured by "
                "the client on loopback. TTFT includes any wait for a slot.\n\n"
            )
            f.write(table + "\n")
            if errors:
                f.write("\nErrors: " + ", ".join(sorted({str(r['error']) for r in errors})) + "\n")
    if lost or served < len(records):
        raise SystemExit("requests were lost")


if __name__ == "__main__":
    main()
