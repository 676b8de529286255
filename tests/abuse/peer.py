"""A hostile client run as another uid (abuse_test.py starts it under
`setpriv --reuid 65534 --regid 65534 --clear-groups`).

It only needs the gRPC stubs (ckpt_pb2, ckpt_pb2_grpc: copied next to this
file into a directory that uid can read) and Debian's grpc/protobuf; it does
not import the ckptd package.

    peer.py calls  SPEC.json   -> prints one JSON line: a result per call
    peer.py flood  SPEC.json   -> prints "READY {json}" once the flood is in,
                                  waits for a line on stdin, cancels, prints
                                  "DONE {json}"

SPEC (calls): {"socket": S, "calls": [CALL, ...]} where CALL is
  {"memfd": NAME, "size": N, "fill": HEX}    a sealed memfd of N bytes sent on
                                             the fd socket ("fill": its first bytes,
                                             optional); "${NAME}" in later
                                             requests is its token
  {"alloc": NAME, "size": N}                 "ALLOC N" on the fd socket: the lease is
                                             kept open to the end; the result adds
                                             "bytes" (the arena's size) and "nonzero"
                                             (its bytes that are not 0 as received)
  {"rpc": "Load"|"Save"|"Status"|"Inspect"|"AwaitSave"|"ReadCheckpointFile", "request": {...},
   "timeout": s}
and each result is {"code": "OK"|CODE, "details": str, ...} (Status adds
"job_ids" and "save_ids", Load adds "events").

SPEC (flood): {"socket": S, "count": N, "channels": C, "limit": L,
  "jobs": J, "world_size": W, "request": {...}}: N waiting Loads spread over J
  job ids (ranks 0.. of world W) on C channels, never more than 256 of them
  unanswered beyond the L expected to wait.
"""
import fcntl
import json
import mmap
import os
import socket
import sys
import threading
import time

import grpc
from google.protobuf import json_format

import ckpt_pb2
import ckpt_pb2_grpc


def sealed_memfd(size, fill=b""):
    fd = os.memfd_create("abuse-peer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if fill:
        os.pwrite(fd, fill[:size], 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def send_fd(fd_socket, fd):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(fd_socket)
    token = os.urandom(16).hex()
    socket.send_fds(s, [token.encode()], [fd])
    reply = s.recv(512)
    s.close()
    if not reply.startswith(b"OK"):
        raise RuntimeError(f"fd socket refused the memfd: {reply!r}")
    return token


def alloc(fd_socket, size):
    """(connection (the lease), the arena's size, its bytes that are not 0)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(fd_socket)
    s.send(f"ALLOC {int(size)}".encode())
    msg, fds, _, _ = socket.recv_fds(s, 512, 1)
    parts = msg.decode("ascii", "replace").split()
    if len(parts) != 3 or parts[0] != "OK" or len(fds) != 1:
        for f in fds:
            os.close(f)
        s.close()
        raise RuntimeError(f"ALLOC refused: {msg!r}")
    n = int(parts[2])
    with mmap.mmap(fds[0], n, prot=mmap.PROT_READ) as mm:
        nonzero = n - mm[:].count(0)
    os.close(fds[0])
    return s, n, nonzero


def substitute(obj, env):
    text = json.dumps(obj)
    for k, v in env.items():
        text = text.replace("${" + k + "}", v)
    return json.loads(text)


def rpc_result(fn):
    try:
        out = fn()
        return {"code": "OK", "details": "", **(out or {})}
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details() or ""}


def do_calls(spec):
    sock = spec["socket"]
    channel = grpc.insecure_channel("unix:" + sock)
    stub = ckpt_pb2_grpc.CkptdStub(channel)
    env, results, keep, keep_socks = {}, [], [], []
    for call in spec["calls"]:
        if "memfd" in call:
            try:
                fd = sealed_memfd(int(call["size"]), bytes.fromhex(call.get("fill", "")))
                keep.append(fd)
                env[call["memfd"]] = send_fd(sock + ".fd", fd)
                results.append({"code": "OK", "details": ""})
            except (OSError, RuntimeError) as e:
                results.append({"code": "CLIENT_ERROR", "details": str(e)})
            continue
        if "alloc" in call:
            try:
                lease, n, nonzero = alloc(sock + ".fd", int(call["size"]))
                keep_socks.append(lease)
                results.append({"code": "OK", "details": "", "bytes": n, "nonzero": nonzero})
            except (OSError, RuntimeError) as e:
                results.append({"code": "CLIENT_ERROR", "details": str(e)})
            continue
        rpc, timeout = call["rpc"], float(call.get("timeout", 20))
        req_type = {"Load": ckpt_pb2.LoadRequest, "Save": ckpt_pb2.SaveRequest,
                    "Status": ckpt_pb2.StatusRequest, "Inspect": ckpt_pb2.InspectRequest,
                    "AwaitSave": ckpt_pb2.AwaitSaveRequest,
                    "ReadCheckpointFile": ckpt_pb2.ReadCheckpointFileRequest}[rpc]
        req = json_format.ParseDict(substitute(call.get("request", {}), env), req_type())
        if rpc == "Load":
            def run():
                events = 0
                for _ in stub.Load(req, timeout=timeout):
                    events += 1
                return {"events": events}
        elif rpc == "Status":
            def run():
                r = stub.Status(req, timeout=timeout)
                return {"job_ids": [j.job_id for j in r.jobs],
                        "save_ids": [s.job_id for s in r.saves]}
        else:
            def run(m=getattr(stub, rpc)):
                m(req, timeout=timeout)
        results.append(rpc_result(run))
    channel.close()
    for fd in keep:
        os.close(fd)
    for s in keep_socks:
        s.close()
    print(json.dumps(results), flush=True)


def do_flood(spec):
    sock, n, limit = spec["socket"], int(spec["count"]), int(spec["limit"])
    jobs, world = int(spec["jobs"]), int(spec["world_size"])
    channels = [grpc.insecure_channel("unix:" + sock, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(int(spec["channels"]))]
    stubs = [ckpt_pb2_grpc.CkptdStub(c) for c in channels]
    base = json_format.ParseDict(spec["request"], ckpt_pb2.LoadRequest())
    lock = threading.Condition()
    state = {"finished": 0, "codes": {}, "samples": {}}
    calls = []

    def done(call):
        code = call.code()
        name = code.name if code is not None else "NONE"
        with lock:
            state["finished"] += 1
            state["codes"][name] = state["codes"].get(name, 0) + 1
            state["samples"].setdefault(name, call.details() or "")
            lock.notify_all()

    t0 = time.monotonic()
    stopped_early = ""
    for i in range(n):
        req = ckpt_pb2.LoadRequest()
        req.CopyFrom(base)
        req.job_id = f"{base.job_id}-{i % jobs}"
        req.rank = (i // jobs) % world
        call = stubs[i % len(stubs)].Load(req, timeout=float(spec.get("timeout", 120)))
        call.add_done_callback(done)
        calls.append(call)
        with lock:
            # Never more than 256 unanswered calls beyond the ones that wait.
            while len(calls) - state["finished"] > limit + 256:
                if not lock.wait(10):
                    stopped_early = (f"no answer to {len(calls) - state['finished']} calls "
                                     f"for 10 s after {len(calls)} sent")
                    break
            if stopped_early:
                break
            if len(calls) - state["finished"] > 2 * limit + 256 and i > 4 * limit + 512:
                stopped_early = (f"{len(calls) - state['finished']} calls still waiting after "
                                 f"{len(calls)} sent: no limit enforced")
                break
    # Let the last answers in: wait until the number still waiting is stable.
    deadline = time.monotonic() + 20
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        with lock:
            waiting = len(calls) - state["finished"]
        if waiting != last:
            last, since = waiting, time.monotonic()
        elif time.monotonic() - since > 1.0:
            break
        time.sleep(0.05)
    with lock:
        report = {"sent": len(calls), "waiting": len(calls) - state["finished"],
                  "codes": dict(state["codes"]), "samples": dict(state["samples"]),
                  "seconds": round(time.monotonic() - t0, 2), "stopped_early": stopped_early}
    print("READY " + json.dumps(report), flush=True)
    sys.stdin.readline()
    for c in calls:
        c.cancel()
    for c in channels:
        c.close()
    print("DONE {}", flush=True)


def main():
    cmd, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    if cmd == "calls":
        do_calls(spec)
    elif cmd == "flood":
        do_flood(spec)
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
