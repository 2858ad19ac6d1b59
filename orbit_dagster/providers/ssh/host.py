"""The SSH provider's helper on the rented host: `python ssh_host.py COMMAND < request.json`.

Uploaded by the provider (stdlib only, Python >= 3.6, so any box with the agent's Python
runs it). Every remote decision that must be atomic lives here, next to the files it
guards: GPU slots are allocated under an flock on the host itself, so two control-plane
processes cannot hand out the same GPU; a launch is claimed with O_EXCL, so a retried or
re-attaching caller never starts a second workload. Requests come on stdin (never argv:
nothing a user wrote is parsed by a shell, and secrets never show in `ps`); the answer is
one JSON object on stdout. Exit 2 = error (JSON on stderr with errno), 3 = no free slots.

The wrapper (`run`) is the workload's parent: it gets secrets through a pipe, starts the
agent, and writes `wrapper_exit.json` when the agent ends, because `kill -0` reports a
finished (zombie) process alive for seconds on some hosts.
"""

import errno
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

NO_CAPACITY = 3


def _write_json(path, data, mode=0o644):
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path)


def _read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (IOError, OSError, ValueError):
        return None


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _part_digests(path, part_size):
    """The sha256 of each `part_size` part of a file (a version-2 manifest's `parts`)."""
    out = []
    with open(path, "rb") as fh:
        for part in iter(lambda: fh.read(part_size), b""):
            out.append(hashlib.sha256(part).hexdigest())
    return out


def pid_alive(pid, token):
    """Alive, not a zombie, and still our process (its argv names `token`: pids get reused)."""
    if not pid:
        return False
    try:
        with open("/proc/%d/stat" % pid) as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return token.encode() in fh.read()
    except (IOError, OSError, IndexError):
        if os.path.isdir("/proc/self"):
            return False
    try:  # no /proc: the best a POSIX host offers
        os.kill(pid, 0)
        return True
    except OSError as exc:
        return exc.errno == errno.EPERM


# ---- GPU slots and leases ---------------------------------------------------------
def _lease_path(req):
    return os.path.join(req["root"], req["instance_id"], "lease.json")


def _with_slots(root, fn):
    state_dir = os.path.join(root, ".orbit")
    if not os.path.isdir(state_dir):
        os.makedirs(state_dir)
    with open(os.path.join(state_dir, "slots.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        path = os.path.join(state_dir, "slots.json")
        slots = _read_json(path) or {}
        # A slot whose lease has stopped is free (a crash between the two writes of close).
        for k, owner in list(slots.items()):
            lease = _read_json(os.path.join(root, owner, "lease.json"))
            if lease is None or lease.get("stopped_at") is not None:
                del slots[k]
        out = fn(slots)
        _write_json(path, slots)
        return out


def lease_open(req):
    lease_file = _lease_path(req)
    existing = _read_json(lease_file)
    if existing is not None:
        return existing  # idempotent: a retried provision gets the same lease
    need, total = int(req["need"]), int(req["total"])

    def allocate(slots):
        free = [i for i in range(total) if str(i) not in slots]
        if len(free) < need:
            return None, len(free)
        mine = free[:need]
        for i in mine:
            slots[str(i)] = req["instance_id"]
        if not os.path.isdir(os.path.dirname(lease_file)):
            os.makedirs(os.path.dirname(lease_file))
        lease = {"instance_id": req["instance_id"], "slots": mine, "total": total, "started_at": time.time(),
                 "stopped_at": None, "reason": None, "tags": req.get("tags", {}),
                 "usd_per_hour": req.get("usd_per_hour")}
        _write_json(lease_file, lease)
        return lease, len(free)

    lease, free = _with_slots(req["root"], allocate)
    if lease is None:
        json.dump({"free": free, "total": total, "need": need}, sys.stderr)
        sys.exit(NO_CAPACITY)
    return lease


def lease_read(req):
    lease = _read_json(_lease_path(req))
    if lease is None:
        raise IOError(errno.ENOENT, "no lease %s under %s" % (req["instance_id"], req["root"]))
    return lease


def _run_pids(run_dir):
    """Live (wrapper, agent) pids of the run, None for a dead one."""
    out = []
    for name in ("wrapper.pid", "agent.pid"):
        pid = (_read_json(os.path.join(run_dir, name)) or {}).get("pid")
        out.append(pid if pid_alive(pid, run_dir) else None)
    return out


HOST_TAG = "ORBIT_HOST_TAG"  # core/process_tree.py's name: this helper runs alone (python -S), it imports nothing


def _kill_tagged(run_dir):
    """SIGKILL every process whose environment holds ORBIT_HOST_TAG=run_dir: what the agent
    started and what left the wrapper's group (torchrun starts each rank in its own session)."""
    entry = ("%s=%s" % (HOST_TAG, run_dir)).encode()
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(os.path.join("/proc", name, "environ"), "rb") as fh:
                if entry in fh.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except (IOError, OSError):
            continue


def _signal_run(run_dir, sig):
    wrapper, agent = _run_pids(run_dir)
    if wrapper is None and agent is None:
        return False
    wpid = (_read_json(os.path.join(run_dir, "wrapper.pid")) or {}).get("pid")
    for fn, pid in ((os.killpg, wpid), (os.kill, agent)):  # the wrapper leads the group
        try:
            if pid:
                fn(pid, sig)
        except OSError:
            pass
    return True


def lease_close(req):
    lease = lease_read(req)
    run_dir = os.path.join(req["root"], req["instance_id"], "run")
    if _signal_run(run_dir, signal.SIGTERM):  # the agent takes an emergency checkpoint
        deadline = time.time() + float(req.get("grace_s", 10))
        while any(_run_pids(run_dir)) and time.time() < deadline:
            time.sleep(0.05)
        _signal_run(run_dir, signal.SIGKILL)
    _kill_tagged(run_dir)  # nothing of the run outlives its lease
    if lease.get("stopped_at") is None:
        lease.update(stopped_at=time.time(), reason=req.get("reason") or "terminated")
        _write_json(_lease_path(req), lease)

    def free(slots):
        for k, owner in list(slots.items()):
            if owner == req["instance_id"]:
                del slots[k]

    _with_slots(req["root"], free)
    return lease


# ---- files --------------------------------------------------------------------------
def _free_bytes(path):
    while not os.path.isdir(path):
        path = os.path.dirname(path) or "/"
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def hash_files(req):
    base, out = req["base"], {}
    for rel in req["files"]:
        path = os.path.join(base, rel)
        if os.path.isfile(path):
            out[rel] = [os.path.getsize(path), _sha256(path)]
    return {"files": out, "free_bytes": _free_bytes(base)}


def verify_checkpoint(req):
    """`{"ok": true}` when manifest.json exists and every file matches it (its whole-file sha256
    in a version-1 manifest, the sha256 of each part in a version-2 one: storage/base.py)."""
    manifest = _read_json(os.path.join(req["dir"], "manifest.json"))
    if manifest is None:
        return {"ok": False, "problem": "no manifest.json (incomplete checkpoint)",
                "free_bytes": _free_bytes(req["dir"])}
    for rel, info in sorted(manifest["files"].items()):
        path = os.path.join(req["dir"], rel)
        if not os.path.isfile(path):
            return {"ok": False, "problem": "file %s is missing" % rel}
        if manifest.get("version", 1) == 1:
            same = os.path.getsize(path) == int(info["bytes"]) and _sha256(path) == info["sha256"]
        else:
            same = (os.path.getsize(path) == int(info["bytes"])
                    and _part_digests(path, int(manifest["part_size"])) == info["parts"])
        if not same:
            return {"ok": False, "problem": "file %s does not match its manifest sha256" % rel}
    return {"ok": True, "files": len(manifest["files"])}


# ---- the workload -----------------------------------------------------------------
def launch(req):
    """Claim the run dir (O_EXCL) and start the wrapper in a session of its own."""
    run_dir = req["run_dir"]
    if not os.path.isdir(run_dir):
        os.makedirs(run_dir)
    claim = os.path.join(run_dir, "launch.json")
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
        time.sleep(0.2)  # a concurrent claimer may still be writing it
        pid = (_read_json(os.path.join(run_dir, "wrapper.pid")) or {}).get("pid")
        return {"new": False, "launch": _read_json(claim), "pid": pid}
    with os.fdopen(fd, "w") as fh:
        json.dump(req["launch"], fh, sort_keys=True)  # no secrets: those go through the pipe
    log = open(os.path.join(run_dir, "agent.log"), "ab")
    # setsid + nohup, from Python: own session (no SIGHUP when the SSH channel closes), no
    # inherited channel fds (the exec channel closes as soon as this helper exits).
    proc = subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), "run", run_dir], stdin=subprocess.PIPE,
                            stdout=log, stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
    proc.stdin.write(json.dumps(req.get("secrets") or {}).encode())
    proc.stdin.close()
    _write_json(os.path.join(run_dir, "wrapper.pid"), {"pid": proc.pid, "at": time.time()})
    return {"new": True, "pid": proc.pid, "launch": req["launch"]}


def run(run_dir):
    """The wrapper: the agent's parent, so that its exit code is always recorded."""
    secrets = json.loads(sys.stdin.read() or "{}")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    # Terminate signals the whole group; the agent handles SIGTERM, the wrapper waits it out.
    # A handler (not SIG_IGN) so the agent does not inherit an ignored signal across exec.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    spec = _read_json(os.path.join(run_dir, "launch.json"))
    keep = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "LD_LIBRARY_PATH")  # as sim: no more
    env = dict((k, v) for k, v in os.environ.items() if k in keep)
    env.update(spec["env"])
    env.update(secrets)
    env[HOST_TAG] = run_dir  # inherited by everything the agent starts
    try:
        child = subprocess.Popen(spec["argv"], cwd=spec["cwd"], env=env, close_fds=True)
    except OSError as exc:
        _write_json(os.path.join(run_dir, "wrapper_exit.json"),
                    {"returncode": 127, "error": str(exc), "at": time.time()})
        return 127
    _write_json(os.path.join(run_dir, "agent.pid"), {"pid": child.pid, "at": time.time()})
    while True:
        try:
            rc = child.wait()
            break
        except OSError as exc:  # EINTR on old Pythons
            if exc.errno != errno.EINTR:
                raise
    _kill_tagged(run_dir)  # the agent is gone: so is everything it started, in whatever session
    _write_json(os.path.join(run_dir, "wrapper_exit.json"), {"returncode": rc, "at": time.time()})
    return 0


def status(req):
    run_dir = req["run_dir"]
    if not os.path.isfile(os.path.join(run_dir, "launch.json")):
        return {"launched": False}
    wrapper = (_read_json(os.path.join(run_dir, "wrapper.pid")) or {}).get("pid")
    agent = (_read_json(os.path.join(run_dir, "agent.pid")) or {}).get("pid")
    # Liveness first, files second: a process writes its exit file before it dies, so
    # "dead and no file" read in this order cannot be a race.
    out = {"launched": True, "wrapper_pid": wrapper, "agent_pid": agent,
           "wrapper_alive": pid_alive(wrapper, run_dir), "agent_alive": pid_alive(agent, run_dir)}
    out["exit"] = _read_json(os.path.join(run_dir, "artifacts", "exit.json"))
    out["wrapper_exit"] = _read_json(os.path.join(run_dir, "wrapper_exit.json"))
    out["launch"] = _read_json(os.path.join(run_dir, "launch.json"))
    out["launch_age_s"] = time.time() - os.path.getmtime(os.path.join(run_dir, "launch.json"))
    lease = _read_json(os.path.join(os.path.dirname(run_dir), "lease.json")) or {}
    out["lease_stopped"] = lease.get("stopped_at") is not None
    return out


def imds_notice(req):
    """The spot interruption notice the instance's metadata service serves now ({} when none).

    For an EC2 host: what the agent polls, read by the control plane too (IMDSv2 token
    first; an endpoint that serves only v1 answers the plain GET).
    """
    import urllib.request  # lazy: 0.1 s (http, ssl), and this helper runs once per remote call; only this one reads a URL

    base, headers = req["url"].rstrip("/"), {}
    try:
        put = urllib.request.Request(base + "/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        headers["X-aws-ec2-metadata-token"] = urllib.request.urlopen(put, timeout=2).read().decode().strip()
    except (IOError, OSError):  # urllib's errors are OSErrors
        pass
    try:
        get = urllib.request.Request(base + "/latest/meta-data/spot/instance-action", headers=headers)
        notice = json.loads(urllib.request.urlopen(get, timeout=2).read().decode() or "{}")
    except (IOError, OSError, ValueError):  # 404: no notice scheduled
        return {}
    return notice if isinstance(notice, dict) and notice.get("action") in ("terminate", "stop", "hibernate") else {}


COMMANDS = {"lease-open": lease_open, "lease-read": lease_read, "lease-close": lease_close, "hash": hash_files,
            "verify-checkpoint": verify_checkpoint, "launch": launch, "status": status, "imds-notice": imds_notice}


def main(argv):
    if len(argv) == 3 and argv[1] == "run":
        return run(argv[2])
    if len(argv) != 2 or argv[1] not in COMMANDS:
        sys.stderr.write("usage: ssh_host.py {%s} < request.json\n" % ",".join(sorted(COMMANDS)))
        return 2
    try:
        out = COMMANDS[argv[1]](json.loads(sys.stdin.read()))
    except (IOError, OSError) as exc:
        json.dump({"errno": exc.errno, "error": "%s: %s" % (type(exc).__name__, exc)}, sys.stderr)
        return 2
    json.dump(out, sys.stdout, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
