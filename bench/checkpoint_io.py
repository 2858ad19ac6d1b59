"""Checkpoint save and load against the raw I/O of the same bytes, side by side in one run.

    python bench/checkpoint_io.py [--sizes 100M,1G,4G] [--repeat 3] [--no-s3] [--s3-max 1G] [--no-sharded] [--dir DIR] [--record FILE]

For each state size (a model-shaped state: weights + two Adam moments, seeded), through the
production code (runtime.checkpointing.Checkpointer, runtime.sdk.RunContext, the stores):
- filesystem, save: our durable save (the training thread's copy, then torch.save streamed
  into the store's writer, which hashes and writes fixed-size parts on its threads, fsyncs,
  and writes the manifest last) and our emergency save (synchronous, full) against a raw
  write of the same bytes from memory to a new file in the same directory + fsync; also
  raw sha256 + write+fsync, the floor of the design before parts (hash everything, then
  write). The training thread's blocked seconds are reported per GB of state, beside a plain
  copy of the state into tensors the process already holds (the floor of any host copy; states
  up to 2 GB);
- filesystem, load: our resume path (the store's checkout: every part verified on several
  threads where the checkpoint lies, no copy; then torch.load with weights_only=True and
  mmap=True, runtime.encoding.read_state) against a raw read of the same number of bytes;
  also the load followed by the copy a resume makes next (every tensor into the training's
  own, as load_state_dict does), since a mapped load leaves that copy as the first touch of
  its bytes; and, side by side, the same verify followed by torch.load without the mapping
  (the path before it), and the same load with the verify reading one part per hashing
  thread at once instead of two (the path before `io_threads`); before each side, the file's
  pages are dropped from the page cache (posix_fadvise DONTNEED after fsync), so each reads
  from the disk;
- S3 (a moto server in its own process on 127.0.0.1): our durable save to the S3 store (parts
  uploaded concurrently with their checksums) against a raw sequential multipart put of the
  same bytes with the same part size, and boto3's managed (threaded) upload; our load
  (ranged GETs of the parts concurrently, each verified, then torch.load) against a GET and
  boto3's managed (threaded) download; states up to --s3-max only (moto keeps every object
  in its process's memory);
- sharded (bench/sharded_io.py): a 2-process dcp.save of the state sharded across the ranks
  (and dcp.async_save: seconds until it returns, and until it is done, with DCP's default
  stager and through the fsdpscript's KeptStager), the agent's
  registration of the directory into the store, and the reshard load 2 -> 1 (verify in the
  store, dcp.load into one process), against raw write+fsync and cold read of the same bytes.
Our saves run on one checkpointer with an optimiser-like in-place update of every tensor
between saves, after two warm-up saves: the steady state of a full fine-tune (no delta base
kept). Each repeat runs raw and ours back to back (alternating which goes first); the ratio is
raw seconds / our seconds (1.0 = as fast as raw; goal >= 0.8), median of the per-repeat
ratios with their min-max. Seconds are medians.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import io
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from recording import recorded_command, replace_section  # noqa: E402
from sharded_io import measure as measure_sharded  # noqa: E402

from orbit_dagster.runtime import delta as D  # noqa: E402
from orbit_dagster.runtime.checkpointing import STATE_FILE, Checkpointer  # noqa: E402
from orbit_dagster.runtime.encoding import read_state  # noqa: E402
from orbit_dagster.runtime.events import EventWriter  # noqa: E402
from orbit_dagster.runtime.notices import NoticeWatcher  # noqa: E402
from orbit_dagster.runtime.sdk import RunContext  # noqa: E402
from orbit_dagster.storage import open_store  # noqa: E402
from orbit_dagster.storage import parts as P  # noqa: E402

SECTION = "checkpoint-io"
# A size too large to measure beside the others (4 GB: the machine's memory) has a section of its own.
SECTIONS = {SECTION: ("<!-- checkpoint-io:begin -->", "<!-- checkpoint-io:end -->"),
            "checkpoint-io-large": ("<!-- checkpoint-io-large:begin -->", "<!-- checkpoint-io-large:end -->")}
PART = 16 << 20  # the S3 store's default part size
GOAL = 0.8
FLOOR_MAX = 2 << 30  # states up to this size also get the floor of the blocked time (copy_floor)
LOAD_AT_START = os.getloadavg()[0]  # other processes' load, recorded with the figures


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def model_state(nbytes: int, seed: int = 0) -> dict:
    """Weights, Adam's two moments and a step counter: ~nbytes in float32 tensors of <= 16 MB."""
    per = nbytes // 3 // 4  # floats per part (weights, exp_avg, exp_avg_sq)
    sizes = [min(per - i, 4 << 20) for i in range(0, per, 4 << 20)]
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    optim = {"state": {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(n, generator=g),
                           "exp_avg_sq": torch.rand(n, generator=g)} for i, n in enumerate(sizes)},
             "param_groups": [{"lr": 1e-4, "params": list(range(len(sizes)))}]}
    return {"model": model, "optim": optim, "step": 100}


def drop_cache(path: Path) -> None:
    """Evict one file's pages from the page cache (clean pages only: fsync first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, data: bytes, *, hash_first: bool = False) -> float:
    t0 = time.perf_counter()
    if hash_first:
        hashlib.sha256(data).hexdigest()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def raw_read(path: Path, *, hash_after: bool = False) -> float:
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        data = fh.read()
    if hash_after:
        hashlib.sha256(data).hexdigest()
    return time.perf_counter() - t0


def checkpoint_events(path: Path) -> list[dict]:
    import json

    return [e for e in map(json.loads, path.read_text().splitlines()) if e["type"] == "checkpoint"]


def train_step(state: dict) -> None:
    """What an optimiser step does to the state between two saves: every tensor written in place."""
    for group in (state["model"], *state["optim"]["state"].values()):
        for t in group.values():
            t.add_(1e-3)


class Ours:
    """Our save and load paths on one store root, each measured from the caller's side.

    One checkpointer for all saves, as in a training run: after two saves of a state that
    changes in between (a full fine-tune), the host buffers are reused and no delta base is
    kept; the figures are that steady state.
    """

    def __init__(self, root_uri: str, work: Path):
        # The environment as it is now: each state size starts a moto server of its own, and an
        # S3 store opened without a snapshot shares the process's first client (the first endpoint).
        self.store, self.work = open_store(root_uri, env=dict(os.environ)), work
        self.events_path = work / "events.jsonl"
        self.ck = Checkpointer(self.store, EventWriter(self.events_path), job_id="bench", attempt=1, parent_uri=None)
        self.n = 0

    def warm_up(self, state: dict) -> None:
        for _ in range(2):
            _, ev = self.durable(state)
            self.delete(ev["uri"])

    def durable(self, state: dict) -> tuple[float, dict]:
        train_step(state)
        self.n += 1
        t0 = time.perf_counter()
        self.ck.save_durable_async(self.n, state, {})
        self.ck.flush()
        seconds = time.perf_counter() - t0
        return seconds, checkpoint_events(self.events_path)[-1]

    def emergency(self, state: dict) -> tuple[float, dict]:
        train_step(state)
        self.n += 1
        t0 = time.perf_counter()
        self.ck.save_emergency(self.n, state, {}, source="bench")
        seconds = time.perf_counter() - t0
        return seconds, checkpoint_events(self.events_path)[-1]

    def load(self, uri: str, into: dict | None = None) -> tuple[float, float]:
        """Seconds until the resume path returns the state, and until it is also copied into the
        training's own tensors `into` (as load_state_dict does; the bench's state, whose shapes
        it has): a local checkpoint is mapped, not read, by the load, so the second figure is
        where its bytes are first touched."""
        if uri.startswith("file://"):
            drop_cache(Path(uri[len("file://"):]) / "state.pt")
        ctx = RunContext(job={"job_id": "bench", "template_snapshot": {}}, bundle_dir=self.work, workdir=self.work,
                         attempt=1, events=EventWriter(self.work / "load-events.jsonl"), store=self.store,
                         watcher=NoticeWatcher(None), checkpoint_every=1, memory_every=1)
        t0 = time.perf_counter()
        state = ctx._load(uri, "resume")
        seconds = time.perf_counter() - t0
        held = D.flatten(into) if into is not None else {}
        for path, t in D.flatten(state).items():  # what a resume does next: load_state_dict's copy
            if isinstance(t, torch.Tensor) and path in held:
                held[path].copy_(t)
        used = time.perf_counter() - t0
        del state
        ctx.close()
        return seconds, used

    def load_unmapped(self, uri: str) -> float:
        """The same verify, then the file read into memory (runtime.encoding.read_state with
        in_place=False: what a fetched copy gets, and what every load did before the mapping)."""
        drop_cache(Path(uri[len("file://"):]) / STATE_FILE)
        t0 = time.perf_counter()
        _, directory = self.store.checkout(uri, self.work / "unmapped")
        state = read_state(directory / STATE_FILE, in_place=False)
        seconds = time.perf_counter() - t0
        del state
        return seconds

    def load_one_task_per_core(self, uri: str) -> float:
        """The same load with the verify reading one part per hashing thread at once (what it did
        before `io_threads`): while every task hashed, the disk sat idle."""
        wide = P.io_threads
        P.io_threads = P.threads
        try:
            return self.load(uri)[0]
        finally:
            P.io_threads = wide

    def delete(self, uri: str) -> None:
        self.store.delete(uri)

    def close(self) -> None:
        self.ck.close()


def copy_floor(state: dict, held: dict) -> float:
    """Seconds of a plain copy of every tensor of `state` into `held` (tensors of the same
    shapes the process already holds), after the same in-place update a save follows: the
    least any host copy of the state can block the training thread."""
    train_step(state)
    t0 = time.perf_counter()
    for path, t in D.flatten(state).items():
        if isinstance(t, torch.Tensor):
            held[path].copy_(t)
    return time.perf_counter() - t0


def measure_fs(state: dict, blob: bytes, root: Path, repeat: int) -> dict[str, list]:
    ours = Ours((root / "store").as_uri(), root / "work")
    ours.warm_up(state)
    # A held copy for the floor of the blocked time, up to FLOOR_MAX: beyond it the process
    # would hold a fourth copy of a state (the 4 GB rows held ~13 GB of 23 without it).
    held = ({p: t.clone() for p, t in D.flatten(state).items() if isinstance(t, torch.Tensor)}
            if len(blob) <= FLOOR_MAX else None)
    raw_path = root / "raw.bin"
    out: dict[str, list] = {k: [] for k in ("durable", "emergency", "load", "load_used", "load_unmapped", "load_narrow",
                                            "raw_durable", "raw_emergency",
                                            "raw_write_sha", "raw_read", "raw_read_sha", "sha", "blocked", "write", "copy_floor")}
    read_path = root / "read.bin"
    for r in range(repeat):
        first_raw = r % 2 == 0
        # The raw read's file is written before our checkpoint, so it is no younger than the
        # one our load reads: on the machine of docs/benchmarks.md the first cold read of a
        # file written moments before took up to 5x as long as later ones.
        with open(read_path, "wb") as fh:
            fh.write(blob)
            os.fsync(fh.fileno())
        for kind in ("durable", "emergency"):
            if first_raw:
                raw = raw_write(raw_path, blob)
            seconds, ev = getattr(ours, kind)(state)
            if not first_raw:
                raw = raw_write(raw_path, blob)
            out[kind].append(seconds)
            out[f"raw_{kind}"].append(raw)
            if kind == "durable":
                out["blocked"].append(ev.get("blocked_seconds"))
                if held is not None:
                    out["copy_floor"].append(copy_floor(state, held))
                out["write"].append(ev.get("write_seconds"))
                out["raw_write_sha"].append(raw_write(raw_path, blob, hash_first=True))
                uri = ev["uri"]
            else:
                ours.delete(ev["uri"])
        if first_raw:
            out["raw_read"].append(raw_read(read_path))
            out["load_narrow"].append(ours.load_one_task_per_core(uri))
        load, load_used = ours.load(uri, into=state)
        if not first_raw:
            out["load_narrow"].append(ours.load_one_task_per_core(uri))
        out["load_unmapped"].append(ours.load_unmapped(uri))
        out["load"].append(load)
        out["load_used"].append(load_used)
        if not first_raw:
            out["raw_read"].append(raw_read(read_path))
        out["raw_read_sha"].append(raw_read(read_path, hash_after=True))
        t0 = time.perf_counter()
        hashlib.sha256(blob).hexdigest()
        out["sha"].append(time.perf_counter() - t0)
        read_path.unlink()
        ours.delete(uri)
        gc.collect()
    ours.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    log = open(root / "moto.log", "wb")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"moto_server did not start; see {root / 'moto.log'}")


def measure_s3(state: dict, blob: bytes, root: Path, repeat: int) -> dict[str, list]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    proc, url = start_moto(root)
    try:
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": url,
                           "AWS_EC2_METADATA_DISABLED": "true"})
        s3 = boto3.session.Session().client("s3")
        s3.create_bucket(Bucket="bench")
        ours = Ours("s3://bench/ours", root / "work-s3")
        ours.warm_up(state)
        managed = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART)
        out: dict[str, list] = {k: [] for k in ("durable", "load", "raw_put", "raw_put_managed", "raw_get",
                                                "raw_get_managed", "blocked", "write")}

        def raw_put() -> float:
            t0 = time.perf_counter()
            up = s3.create_multipart_upload(Bucket="bench", Key="raw")["UploadId"]
            parts = []
            for n, start in enumerate(range(0, len(blob), PART), 1):
                etag = s3.upload_part(Bucket="bench", Key="raw", UploadId=up, PartNumber=n,
                                      Body=blob[start:start + PART])["ETag"]
                parts.append({"PartNumber": n, "ETag": etag})
            s3.complete_multipart_upload(Bucket="bench", Key="raw", UploadId=up, MultipartUpload={"Parts": parts})
            return time.perf_counter() - t0

        def raw_put_managed() -> float:
            t0 = time.perf_counter()
            s3.upload_fileobj(io.BytesIO(blob), "bench", "raw-managed", Config=managed)
            return time.perf_counter() - t0

        for r in range(repeat):
            if r % 2 == 0:
                out["raw_put"].append(raw_put())
            seconds, ev = ours.durable(state)
            if r % 2 == 1:
                out["raw_put"].append(raw_put())
            out["durable"].append(seconds)
            out["blocked"].append(ev.get("blocked_seconds"))
            out["write"].append(ev.get("write_seconds"))
            out["raw_put_managed"].append(raw_put_managed())
            t0 = time.perf_counter()
            s3.get_object(Bucket="bench", Key="raw")["Body"].read()
            out["raw_get"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s3.download_fileobj("bench", "raw", io.BytesIO(), Config=managed)
            out["raw_get_managed"].append(time.perf_counter() - t0)
            out["load"].append(ours.load(ev["uri"])[0])
            ours.delete(ev["uri"])
            s3.delete_objects(Bucket="bench", Delete={"Objects": [{"Key": "raw"}, {"Key": "raw-managed"}]})
            gc.collect()
        ours.close()
        return out
    except Exception:
        print(f"moto_server exit code {proc.poll()}; the end of its log:\n"
              + (root / "moto.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(10)


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio_cell(raw: list[float], ours: list[float]) -> tuple[str, bool]:
    ratios = [r / o for r, o in zip(raw, ours)]
    med = statistics.median(ratios)
    met = med >= GOAL and min(ratios) >= GOAL
    return f"{med:.2f} ({min(ratios):.2f}-{max(ratios):.2f})", met


def rows_for(label: str, nbytes: int, fs: dict, s3: dict | None, sharded: dict | None) -> list[str]:
    gb = nbytes / 1e9

    def line(op: str, ours: list, raw_name: str, raw: list, extra: str = "", goal: bool = True) -> str:
        cell, met = ratio_cell(raw, ours)
        o, r = _med(ours), _med(raw)
        verdict = ("yes" if met else "**NO**") if goal else "-"
        return (f"| {label} | {op} | {o:.3f} ({gb / o:.2f} GB/s) | {raw_name} | {r:.3f} ({gb / r:.2f} GB/s) | "
                f"{cell} | {verdict} | {extra} |")

    def split(d: dict) -> str:
        b, w, f = _med(d["blocked"]), _med(d["write"]), _med(d.get("copy_floor") or [])
        floor = "" if f is None else f" (a plain copy of the state into held tensors: {f:.3f} s, {f / gb:.3f} s per GB)"
        return "-" if b is None else (f"training thread blocked {b:.3f} s ({b / gb:.3f} s per GB){floor}, "
                                      f"serialise+hash+write {w:.3f} s")

    rows = [
        line("fs save, durable", fs["durable"], "write+fsync", fs["raw_durable"], split(fs)),
        line("fs save, emergency (full)", fs["emergency"], "write+fsync", fs["raw_emergency"]),
        line("fs save, durable", fs["durable"], "sha256 + write+fsync", fs["raw_write_sha"],
             "vs the floor of the design before parts: hash everything, then write", goal=False),
        line("fs load (verify parts in place + torch.load, mapped)", fs["load"], "cold read", fs["raw_read"]),
        line("fs load (verify parts in place + torch.load, mapped)", fs["load"], "the same, read into memory",
             fs["load_unmapped"], "the mapping's own gain, side by side: the same verify, then torch.load "
             "without mmap (a fetched copy's path; every load's before the mapping)", goal=False),
        line("fs load (verify parts in place + torch.load, mapped)", fs["load"], "the same, one part read per core",
             fs["load_narrow"], "the verify's own gain from reading two parts per hashing thread at once "
             "(storage/parts.py `io_threads`), side by side; every load's before it", goal=False),
        line("fs load, then copied into the training's tensors", fs["load_used"], "cold read", fs["raw_read"],
             "the copy a resume makes next (load_state_dict); the load maps the file, so this is where its "
             "pages are first touched", goal=False),
        line("fs load (verify parts in place + torch.load, mapped)", fs["load"], "cold read + sha256", fs["raw_read_sha"],
             "vs the floor of one sequential sha256 of what is read", goal=False),
        line("sha256 of the bytes, in memory (no I/O)", fs["sha"], "write+fsync", fs["raw_durable"],
             "one sequential hash against the raw write: what parts on several threads get under", goal=False),
    ]
    if s3:
        rows += [
            line("S3 save, durable", s3["durable"], "multipart put, sequential", s3["raw_put"], split(s3)),
            line("S3 save, durable", s3["durable"], "boto3 managed upload (threads)", s3["raw_put_managed"]),
            line("S3 load (ranged GETs verified + torch.load)", s3["load"], "GET", s3["raw_get"], goal=False),
            line("S3 load (ranged GETs verified + torch.load)", s3["load"], "boto3 managed download (threads)",
                 s3["raw_get_managed"]),
        ]
    if sharded:
        ab, a = _med(sharded["async_blocked"]), _med(sharded["async_save"])
        rb, r = _med(sharded["kept_blocked"]), _med(sharded["kept_save"])
        rows += [
            line("sharded save, 2 processes (dcp.save)", sharded["save"], "write+fsync", sharded["raw_write"],
                 f"dcp.async_save: blocked {ab:.3f} s ({ab / gb:.3f} s per GB), done in {a:.3f} s; through the "
                 f"fsdpscript's KeptStager: blocked {rb:.3f} s ({rb / gb:.3f} s per GB), done in {r:.3f} s", goal=False),
            line("sharded: register into the store (hash parts + write)", sharded["register"], "write+fsync",
                 sharded["raw_write"], "the agent's copy of the ranks' files into the store", goal=False),
            line("sharded load 2 -> 1 (verify in place + dcp.load)", sharded["load"], "cold read",
                 sharded["raw_read"], goal=False),
        ]
    return rows


HEADER = ("| state | operation | ours s (throughput) | raw | raw s (throughput) | raw/ours median (min-max) | "
          ">= 0.8 | notes |\n|---|---|---|---|---|---|---|---|")


def record(path: Path, rows: list[str], command: str, seconds: float, name: str = SECTION) -> None:
    title = "bench/checkpoint_io.py" + ("" if name == SECTION else f", section {name}")
    section = (f"\n## Checkpoint I/O ({title})\n\nMeasured {date.today().isoformat()} on "
               f"{platform.machine()} ({os.cpu_count()} cores, shared with other work: load average "
               f"{LOAD_AT_START:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, "
               f"in {seconds:.0f} s. Command: `{command}`.\n\n{HEADER}\n" + "\n".join(rows) + "\n")
    replace_section(path, *SECTIONS[name], section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100M,1G", help="state sizes, e.g. 100M,1G,4G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) rows")
    ap.add_argument("--s3-max", default="1G",
                    help="largest state measured on S3 (moto holds every object and part in memory: a 1 GB "
                         "state peaked at 4.9 GB in moto's process here; larger states are measured on fs only)")
    ap.add_argument("--no-sharded", action="store_true", help="skip the 2-process sharded (DCP) rows")
    ap.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir under bench/)")
    ap.add_argument("--record", type=Path, default=None, help="markdown file whose checkpoint-io section is rewritten")
    ap.add_argument("--section", default=SECTION, choices=sorted(SECTIONS), help="the section of --record to write")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    base = args.dir or REPO / "bench"
    t_start = time.time()
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".ckpt-io-", dir=base) as tmp:
        root = Path(tmp)
        (root / "warm").mkdir()
        measure_fs(model_state(8 << 20), b"x" * (8 << 20), root / "warm", 1)  # first-call costs out of the figures
        for size in args.sizes.split(","):
            nbytes = parse_size(size)
            state = model_state(nbytes)
            buf = io.BytesIO()
            torch.save(state, buf)
            blob = buf.getvalue()  # raw I/O moves as many bytes as the checkpoint file holds
            del buf
            fs = measure_fs(state, blob, root, args.repeat)
            s3 = None if args.no_s3 or nbytes > parse_size(args.s3_max) else measure_s3(state, blob, root, args.repeat)
            sharded = None if args.no_sharded else measure_sharded(len(blob), root, args.repeat)
            new = rows_for(size, len(blob), fs, s3, sharded)
            print("\n".join(new), flush=True)
            rows += new
            del state, blob
            gc.collect()
    seconds = time.time() - t_start
    print(f"{HEADER}\n" + "\n".join(rows))
    if args.record:
        record(args.record, rows, recorded_command("checkpoint_io", sys.argv[1:] if argv is None else argv),
               seconds, args.section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
