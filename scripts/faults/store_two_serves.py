"""Two `dsv41 serve` processes on one SSD store folder (issue 42, item 2), on the small test model.

1. Sharing: a prompt served by A is then sent to B, and another served by B is sent to A: each
   must resume from the other's blocks (its usage's `ssd_store_tokens` > 0).
2. kill -9, ROUNDS rounds: a fresh B is started on the store and given new prompts; it is killed
   with SIGKILL (even rounds: the moment one of its temporary block files exists, i.e. mid-write;
   odd rounds: a random moment after its first answer), while A keeps answering new prompts and
   prompts B wrote before (so A writes and reads B's entries all along).
3. Checks: every request to A answered (200), A's log without a traceback; a new engine opening
   the store (as the next serve would) finds no corrupt, truncated or foreign entry, every entry
   of the model reads back whole (payload digest), no temporary file is left after its scan; the
   folder around the store is unchanged (names, sizes and mtimes).

Prints one line per round and the counts as JSON at the end.

usage: python scripts/faults/store_two_serves.py [ROUNDS] [WORKDIR]
  (DSV41_FAULT_CHECKPOINT: the checkpoint; default shared/conformance/shared-small/checkpoint)
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
WORK = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="two-serves-"))
CHECKPOINT = Path(
    os.environ.get(
        "DSV41_FAULT_CHECKPOINT",
        Path(__file__).resolve().parents[3] / "shared/conformance/shared-small/checkpoint",
    )
)
PAGE = 8
PARENT = WORK / "parent"  # the store's parent folder: nothing in it may change
STORE = PARENT / "store"
LOGS = WORK / "logs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsv41.compiler.tools.cli",
            "serve",
            "--backend",
            "torch",
            "--checkpoint",
            str(CHECKPOINT),
            "--page-tokens",
            str(PAGE),
            "--store",
            str(STORE),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--speculative",
            "off",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(LOGS / f"{name}.log", "w"),
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve {name} exited with {proc.returncode}; see {LOGS}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"serve {name} did not come up")


def complete(port: int, prompt: str, timeout: float = 300.0) -> dict:
    body = json.dumps(
        {"model": "checkpoint", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ssd_tokens(answer: dict) -> int:
    return answer["usage"]["dsv41_prompt_cache"]["ssd_store_tokens"]


def prompt(tag: str) -> str:
    words = " ".join(f"w{(hash(tag) + i) % 97}" for i in range(12))
    return f"{tag}: the shared system prompt of the team, {words}."


def blocks() -> int:
    return len(list(STORE.glob("*/*.blk")))


def settle(before: int, timeout: float = 30.0) -> None:
    """Wait until the store holds more blocks than `before` and stops growing for 0.5 s (a turn
    end's blocks are written by a background thread)."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = blocks()
        if n != last:
            last, since = n, time.monotonic()
        elif n > before and time.monotonic() - since > 0.5:
            return
        time.sleep(0.05)
    raise RuntimeError("the store did not receive the turn's blocks")


def listing(folder: Path, skip: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if Path(dirpath) / d != skip]
        for name in [*dirs, *files]:
            st = os.lstat(Path(dirpath) / name)
            out[str((Path(dirpath) / name).relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def main() -> None:
    PARENT.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(exist_ok=True)
    (PARENT / "notes.txt").write_text("a user's file beside the store")
    (PARENT / "other").mkdir(exist_ok=True)
    (PARENT / "other" / "data.bin").write_bytes(os.urandom(256))
    if not (PARENT / "link").is_symlink():
        os.symlink(PARENT / "notes.txt", PARENT / "link")
    a, port_a = start("A")
    before = listing(PARENT, STORE)
    counts = {
        "rounds": 0,
        "killed_mid_write": 0,
        "b_answers": 0,
        "a_answers": 0,
        "a_failures": 0,
        "a_ssd_hits_of_b_prefixes": 0,
    }

    # 1. each serves the other's prefixes
    b, port_b = start("B0")
    n = blocks()
    complete(port_a, prompt("from-a"))
    settle(n)
    b_hit = ssd_tokens(complete(port_b, prompt("from-a")))
    n = blocks()
    complete(port_b, prompt("from-b"))
    settle(n)
    a_hit = ssd_tokens(complete(port_a, prompt("from-b")))
    assert b_hit > 0 and a_hit > 0, (b_hit, a_hit)
    counts["b_served_a_prefix_tokens"], counts["a_served_b_prefix_tokens"] = b_hit, a_hit
    print(
        f"sharing: B resumed A's prompt from {b_hit} SSD tokens, A resumed B's from {a_hit}",
        flush=True,
    )
    b.send_signal(signal.SIGTERM)
    b.wait(60)

    # 2. kill -9 of B while A writes
    stop_a = threading.Event()
    b_prompts: list[str] = []

    def a_traffic() -> None:
        i = 0
        while not stop_a.is_set():
            tags = [f"a-{i}"] + ([random.choice(b_prompts)] if b_prompts else [])
            for tag in tags:
                try:
                    ans = complete(port_a, prompt(tag))
                    counts["a_answers"] += 1
                    if tag.startswith("b-") and ssd_tokens(ans) > 0:
                        counts["a_ssd_hits_of_b_prefixes"] += 1
                except (urllib.error.URLError, OSError) as e:
                    counts["a_failures"] += 1
                    print("A failed:", e, flush=True)
            i += 1

    random.seed(0)
    writer = threading.Thread(target=a_traffic, daemon=True)
    writer.start()
    for r in range(ROUNDS):
        b, port_b = start(f"B{r + 1}")
        answered = threading.Event()

        def b_traffic(port=port_b, r=r, answered=answered) -> None:
            j = 0
            while True:
                tag = f"b-{r}-{j}"
                try:
                    complete(port, prompt(tag), timeout=60)
                except (urllib.error.URLError, OSError):
                    return  # killed
                counts["b_answers"] += 1
                b_prompts.append(tag)
                answered.set()
                j += 1

        threading.Thread(target=b_traffic, daemon=True).start()
        answered.wait(300)
        deadline = time.monotonic() + (30.0 if r % 2 == 0 else random.uniform(0.0, 2.0))
        while time.monotonic() < deadline:
            if r % 2 == 0 and list(STORE.glob(f"*/.*.{b.pid}.*.tmp")):
                break
            time.sleep(0.0005)
        b.send_signal(signal.SIGKILL)
        b.wait()
        tmps = list(STORE.glob(f"*/.*.{b.pid}.*.tmp"))
        counts["killed_mid_write"] += bool(tmps)
        counts["rounds"] += 1
        print(
            f"round {r}: B killed with {len(tmps)} temporary file(s) of its own; A answered "
            f"{counts['a_answers']} so far, {counts['a_failures']} failures; store "
            f"{blocks()} blocks",
            flush=True,
        )
    stop_a.set()
    writer.join(300)

    # 3. the store as the next serve would open it, while A still runs
    from dsv41.graph.checkpoint import weights_fingerprint
    from dsv41.graph.model import Model
    from dsv41.runtime.engine import Engine

    e = Engine.from_model(
        Model.from_checkpoint(CHECKPOINT),
        weights_hash=weights_fingerprint(CHECKPOINT),
        page_tokens=PAGE,
        store_dir=STORE,
    )
    st = e.store.stats()
    ours = [p.stem for p in STORE.glob("*/*.blk") if e.store.contains(p.stem)]
    whole = sum(e.store.get(k) is not None for k in ours)
    e.close()
    a.send_signal(signal.SIGTERM)
    a.wait(120)
    log_a = (LOGS / "A.log").read_text()
    counts.update(
        {
            "store_entries": st.entries,
            "entries_read_whole": whole,
            "corrupt": st.corrupt,
            "truncated": st.truncated,
            "foreign": st.foreign,
            "read_errors": st.read_errors,
            "temp_files_after_scan": len(list(STORE.glob("*/.*.tmp"))),
            "outside_store_unchanged": listing(PARENT, STORE) == before,
            "a_traceback": "Traceback" in log_a,
        }
    )
    print(json.dumps(counts), flush=True)
    ok = (
        counts["a_failures"] == 0
        and whole == len(ours) == st.entries
        and (st.corrupt, st.truncated, st.foreign, st.read_errors) == (0, 0, 0, 0)
        and counts["temp_files_after_scan"] == 0
        and counts["outside_store_unchanged"]
        and not counts["a_traceback"]
    )
    print("OK" if ok else "FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
