#!/usr/bin/python3
"""Writes the seed corpora of the fuzz targets from real fixtures.

    tests/fuzz/make_corpus.py [--ckptctl PATH]

Run from the repository root after `bazel build //client:ckptctl` (PATH
defaults to bazel-bin/client/ckptctl). Writes tests/fuzz/corpus/<target>/
and tests/fuzz/pickle_data_files.inc; seeds of the same name are replaced,
other files in the corpus directories are left alone.

Sources:
  - examples/tiny-model (a HuggingFace safetensors file), sharded into native
    checkpoints by ckptctl (examples/layout-tp2.json, layout-tp4-dim0.json):
    safetensors headers, native metadata JSON, layouts;
  - tests/foreign/paddle_gen.py (Paddle flex_checkpoint files as Paddle
    pickles them) and tests/foreign/dcp_gen.py (real PyTorch DCP checkpoints
    saved by Debian's torch 1.13): metadata pickles, numpy data pickles,
    torch.save zip items and their data.pkl;
  - config/ckptd.yaml, tests/cli/aoa_cli_test.sh's AOA config, forms from docs/;
  - plan parts and joins encoded with protoc's Python code for proto/peer.proto.
Every seed is small (the largest few KiB). DCP values are random, so a rerun
changes those bytes; the structure stays.
"""
import argparse
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def read(path):
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------
# safetensors_header: 8 bytes LE file size, then the header JSON.

def st_seed(file_bytes):
    """(file size, header JSON) of a safetensors file, the header's padding
    dropped (the size shrinks with it, so the seed stays a valid file)."""
    n = struct.unpack("<Q", file_bytes[:8])[0]
    header = file_bytes[8:8 + n]
    data_len = len(file_bytes) - 8 - n
    header = header.rstrip(b" ")
    return struct.pack("<Q", 8 + len(header) + data_len) + header


def st_json(tensors, metadata=None):
    h = {}
    if metadata is not None:
        h["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, size in tensors:
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    j = json.dumps(h, separators=(",", ":")).encode()
    return struct.pack("<Q", 8 + len(j) + off) + j


def safetensors_seeds(native, pd):
    put("safetensors_header", "tiny-model", st_seed(read(os.path.join(ROOT, "examples/tiny-model/model.safetensors"))))
    put("safetensors_header", "native-tp2-rank0", st_seed(read(os.path.join(native, "tp2/0_1.safetensors"))))
    put("safetensors_header", "native-tp4-rank3", st_seed(read(os.path.join(native, "tp4/3_2.safetensors"))))
    put("safetensors_header", "paddle-safetensors", st_seed(read(os.path.join(pd, "pdst/0_3.distcp"))))
    put("safetensors_header", "empty", struct.pack("<Q", 10) + b"{}")
    put("safetensors_header", "scalar-empty-metadata",
        st_json([("s", "I64", [], 8), ("e", "F32", [0, 3], 0), ("b", "BOOL", [3], 3),
                 ("h", "F16", [2, 1], 4), ("bf", "BF16", [1], 2), ("f8", "F8_E4M3", [2], 2)],
                {"format": "pt", "ckptd.unique_id": "7"}))


# ---------------------------------------------------------------------------
# metadata_json: native {uid}.metadata files.

# The metadata example of docs/file-format.md (once in the README).
README_EXAMPLE = {
    "format": "ckptd.checkpoint", "version": 1, "unique_id": 1, "checksum_block": 67108864,
    "tensors": {"w": {"dtype": "F32", "global_shape": [4, 8], "shards": [
        {"file": "0_1.safetensors", "offset": [0, 0], "shape": [2, 8],
         "data_offset": 4096, "nbytes": 64, "xxh3": ["c31259dc230cae89"]},
        {"file": "1_1.safetensors", "offset": [2, 0], "shape": [2, 8], "flat_range": [0, 10],
         "data_offset": 4096, "nbytes": 40, "xxh3": ["e2985debf0086eac"]},
        {"file": "2_1.safetensors", "offset": [2, 0], "shape": [2, 8], "flat_range": [10, 16],
         "data_offset": 4096, "nbytes": 24, "xxh3": ["6b9336ff88c4c0a2"]}]}},
    "flat_mapping": {"model.a.0": ["model", "a.0"]},
}

REPLICAS = {
    "format": "ckptd.checkpoint", "version": 1, "unique_id": 3, "checksum_block": 16,
    "tensors": {
        "b": {"dtype": "BF16", "global_shape": [8], "shards": [
            {"file": "0_3.safetensors", "offset": [0], "shape": [8], "dtype": "U16",
             "data_offset": 4096, "nbytes": 16, "xxh3": ["1"]},
            {"file": "1_3.safetensors", "offset": [0], "shape": [8], "replica_id": 1,
             "data_offset": 4096, "nbytes": 16}]},
        "s": {"dtype": "I64", "global_shape": [], "shards": [
            {"file": "0_3.safetensors", "offset": [], "shape": [], "data_offset": 4112, "nbytes": 8}]},
        "z": {"dtype": "F32", "global_shape": [0, 4], "shards": [
            {"file": "0_3.safetensors", "offset": [0, 0], "shape": [0, 4], "data_offset": 4120, "nbytes": 0}]},
    },
}


def metadata_seeds(native):
    for sub, uid in (("tp2", 1), ("tp4", 2)):
        m = json.loads(read(os.path.join(native, sub, "%d.metadata" % uid)))
        put("metadata_json", "native-%s" % sub, json.dumps(m, separators=(",", ":"), sort_keys=True))
    put("metadata_json", "readme-example", json.dumps(README_EXAMPLE, indent=1))
    put("metadata_json", "replicas-scalar-empty", json.dumps(REPLICAS, separators=(",", ":")))


# ---------------------------------------------------------------------------
# pickle and distcp_zip: Paddle and DCP files.

def pickle_seeds(pd, dcp):
    for name, rel in (("paddle-metadata-p4", "pd4/1.metadata"),
                      ("paddle-metadata-old", "pdold/0.metadata"),
                      ("paddle-metadata-p2", "pd2/0.metadata"),
                      ("paddle-data-p4", "pd4/0_1.distcp"),
                      ("paddle-data-p5", "pd5/0_3.distcp"),
                      ("paddle-data-old", "pdold/0_0.distcp"),
                      ("paddle-data-old-split", "pdold/1_0.distcp"),
                      ("paddle-data-p2", "pd2/0_0.distcp"),
                      ("paddle-data-safetensors", "pdst/0_3.distcp")):
        put("pickle", name, read(os.path.join(pd, rel)))
    for name, rel in (("dcp-metadata", "ckpt/.metadata"),
                      ("dcp-metadata-file-per-rank", "ckpt1/.metadata"),
                      ("dcp-metadata-view", "view/.metadata"),
                      ("dcp-metadata-strided", "strided/.metadata")):
        put("pickle", name, read(os.path.join(dcp, rel)))
    for name, rel in (("torch-data-pkl", "ckpt/__0_0.distcp"),
                      ("torch-data-pkl-bytes-item", "ckpt/__0_6.distcp"),
                      ("torch-data-pkl-strided", "strided/__0_0.distcp")):
        with zipfile.ZipFile(os.path.join(dcp, rel)) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
            put("pickle", name, z.read(pkl))


def zip64(item):
    """The same torch.save archive with a zip64 central directory: every
    size and offset field 0xFFFFFFFF with the values in a zip64 extra field,
    a zip64 end record and locator, and an end record of 0xFFFF entries."""
    eocd = item.rindex(b"PK\x05\x06")
    entries, cd_size, cd_off = struct.unpack("<HII", item[eocd + 10:eocd + 20])
    cd = item[cd_off:cd_off + cd_size]
    out_cd = b""
    p = 0
    for _ in range(entries):
        h = cd[p:p + 46]
        comp, size = struct.unpack("<II", h[20:28])
        nlen, xlen, clen = struct.unpack("<HHH", h[28:34])
        local = struct.unpack("<I", h[42:46])[0]
        name = cd[p + 46:p + 46 + nlen]
        extra = struct.pack("<HHQQQ", 1, 24, size, comp, local)
        nh = (h[:20] + struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF) + struct.pack("<HHH", nlen, len(extra), 0)
              + h[34:42] + struct.pack("<I", 0xFFFFFFFF))
        out_cd += nh + name + extra
        p += 46 + nlen + xlen + clen
    body = item[:cd_off]
    z64_off = len(body) + len(out_cd)
    rec = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries, len(out_cd), len(body))
    loc = struct.pack("<IIQI", 0x07064B50, 0, z64_off, 1)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return body + out_cd + rec + loc + end


def distcp_seeds(dcp):
    for name, rel in (("dcp-item-f32", "ckpt/__0_0.distcp"),
                      ("dcp-item-other", "ckpt/__0_3.distcp"),
                      ("dcp-item-bytes", "ckpt/__0_6.distcp")):
        put("distcp_zip", name, read(os.path.join(dcp, rel)))
    # The view and strided checkpoints' items sit at an offset of their
    # files: cut them out.
    for name, rel in (("dcp-item-view", "view/__0_0.distcp"),
                      ("dcp-item-strided", "strided/__0_0.distcp")):
        raw = read(os.path.join(dcp, rel))
        put("distcp_zip", name, raw[raw.index(b"PK\x03\x04"):])
    put("distcp_zip", "dcp-item-zip64", zip64(read(os.path.join(dcp, "ckpt/__0_0.distcp"))))


def embed(pd, dcp):
    """pickle_data_files.inc: the data files the pickle target's checkpoint
    directory holds (what dcp-metadata-file-per-rank and the Paddle metadata
    seeds name)."""
    files = [("__0_0.distcp", os.path.join(dcp, "ckpt1/__0_0.distcp")),
             ("__1_0.distcp", os.path.join(dcp, "ckpt1/__1_0.distcp")),
             ("0_0.distcp", os.path.join(pd, "pdold/0_0.distcp")),
             ("1_0.distcp", os.path.join(pd, "pdold/1_0.distcp")),
             ("0_1.distcp", os.path.join(pd, "pd4/0_1.distcp")),
             ("0_3.distcp", os.path.join(pd, "pd5/0_3.distcp"))]
    lines = ["// Generated by tests/fuzz/make_corpus.py; do not edit.",
             "// Data files of the pickle target's checkpoint directory: a PyTorch DCP",
             "// checkpoint saved with single_file_per_rank (tests/foreign/dcp_gen.py) and",
             "// Paddle data files (tests/foreign/paddle_gen.py).",
             "static const EmbeddedFile kEmbeddedFiles[] = {"]
    for name, path in files:
        data = read(path)
        lines.append('    {"%s",' % name)
        for i in range(0, len(data), 24):
            lines.append('     "' + "".join("\\%03o" % b for b in data[i:i + 24]) + '"')
        lines.append("     , %d}," % len(data))
    lines.append("};")
    with open(os.path.join(HERE, "pickle_data_files.inc"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------
# aoa, layout_json, config_yaml, fd_socket.

CLI_AOA = read(os.path.join(ROOT, "tests/cli/aoa_cli_test.sh")).decode()
CLI_AOA = CLI_AOA[CLI_AOA.index("<<'AOA'\n") + 8:CLI_AOA.index("\nAOA\n") + 1]

AOA_FORMS = """\
# every form of the language on the tiny model's names
model.layers.0.self_attn.q_proj.weight -> q0
model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight -> kv, axis=1
kv -> k1, v1, axis=1
model.layers.1.self_attn.o_proj.weight -> o1t, permute='[1,0]'
model.layers.1.mlp.down_proj.weight^T -> down1
model.norm.weight -> norm, dtype='bfloat16'
step -> _
_ -> extra
model.layers.0.mlp.gate_proj.weight^T, model.layers.0.mlp.up_proj.weight^T -> layers.0.gate_up, fused_ffn
layers.0.gate_up -> g0, u0, fused_ffn
model.layers.$LAYER_ID.input_layernorm.weight -> ln.$LAYER_ID
*.o_proj.weight -> o.*
model.layers.1.self_attn.q_proj.weight -> s[0:2], axis=0
s[0:2] -> joined, axis=0
"""

AOA_QKV_SPLIT = """\
model.layers.0.self_attn.q_proj.weight^T, model.layers.0.self_attn.k_proj.weight^T, model.layers.0.self_attn.v_proj.weight^T -> qkv, fused_qkv, num_heads=8, num_key_value_groups=8
qkv -> Q, K, V, fused_qkv, num_heads=4, num_key_value_groups=4, dtype='float32'
Q -> Q, axis=-1
"""

AOA_JSON = json.dumps({"aoa_statements": [
    "model.embed_tokens.weight -> embed, dtype='float32'",
    "lm_head.weight^T -> head",
    "model.layers.$LAYER_ID.mlp.up_proj.weight -> up.$LAYER_ID"]})


def aoa_seeds():
    put("aoa", "cli", CLI_AOA)
    put("aoa", "forms", AOA_FORMS)
    put("aoa", "qkv-split", AOA_QKV_SPLIT)
    put("aoa", "json", AOA_JSON)
    put("aoa", "json-list", json.dumps(["model.norm.weight -> n", "n -> _"]))


def compact(path):
    return json.dumps(json.loads(read(path)), separators=(",", ":"))


FLAT_LAYOUT = {"world_size": 3, "ranks": [
    {"rank": 0, "tensors": [
        {"name": "lm_head.weight", "dtype": "bfloat16", "global_shape": [256, 64],
         "offset": [0, 0], "shape": [256, 64], "flat_range": [0, 5000]},
        {"name": "step", "dtype": "I64", "global_shape": []}]},
    {"rank": 1, "tensors": [
        {"name": "lm_head.weight", "dtype": "BF16", "global_shape": [256, 64],
         "flat_range": [5000, 16384]},
        {"name": "model.norm.weight", "dtype": "F16", "global_shape": [64], "offset": [32], "shape": [32]}]},
    {"rank": 2}]}


def layout_seeds(pd, dcp):
    put("layout_json", "tp2", compact(os.path.join(ROOT, "examples/layout-tp2.json")))
    put("layout_json", "tp4-dim0", compact(os.path.join(ROOT, "examples/layout-tp4-dim0.json")))
    put("layout_json", "paddle", compact(os.path.join(pd, "pd4/layout.json")))
    put("layout_json", "dcp", compact(os.path.join(dcp, "layout.json")))
    put("layout_json", "flat-scalar", json.dumps(FLAT_LAYOUT))


CONFIG_MULTINODE = """\
socket: /run/ckptd/ckptd.sock
roots: [/data/ckpt, /scratch]
peer_listen: 10.0.0.1:7071
peers: ["10.0.0.1:7071", "10.0.0.2:7071"]
peer_tls_cert: /etc/ckptd/node.pem
peer_tls_key: /etc/ckptd/node.key
peer_tls_ca: /etc/ckptd/ca.pem
peer_timeout: 90s
nccl_connect_timeout: 500ms
cache_budget: 1.5GiB
io_threads: 4
direct_io: always
io_request_size: 16MiB
"""

CONFIG_TCP_ACCESS = """\
socket: ""
tcp_address: "[::1]:7070"
insecure_tcp: true
tcp_uid: 1000
socket_mode: "0600"
admin_uids: [0, 1000]
roots:
  - /data
access:
  - root: /data
    read_uids: [1001, 1002]
    read_gids: [2000]
    save_uids: [1000]
    save_gids: []
limits:
  max_targets_per_request: 1000
  max_request_bytes: 1TiB
  max_barrier_timeout: 2h
  max_message_bytes: 64MiB
  metadata_cache_entries: 8
metrics_address: 127.0.0.1:9464
log_level: debug
log_format: json
barrier_timeout: 5m
load_timeout: 1h
drain_timeout: 10s
peer_dns: ckptd.default.svc:7071
peer_listen: localhost:7071
"""


def config_seeds():
    put("config_yaml", "ckptd", read(os.path.join(ROOT, "config/ckptd.yaml")))
    put("config_yaml", "minimal", "roots: [/data]\n")
    put("config_yaml", "multinode-tls", CONFIG_MULTINODE)
    put("config_yaml", "tcp-access-limits", CONFIG_TCP_ACCESS)
    put("config_yaml", "anchors-flow",
        "%YAML 1.2\n---\nroots: &r [/a, \"/b\"]\narena_pool: 512MiB\narena_limit: 1GiB\n"
        "limits: {max_jobs_per_uid: 3, max_message_bytes: 8MiB, max_barrier_timeout: 90m}\n"
        "access: [{root: /a, read_uids: &u [1, 2], save_uids: *u}]\n"
        "log_level: !!str warn\n...\n")


def fd_socket_seeds():
    token = "0123456789abcdef0123456789abcdef"
    put("fd_socket", "ok", "OK")
    put("fd_socket", "ok-grant", "OK %s 1048576" % token)
    put("fd_socket", "err", "ERR INVALID_ARGUMENT: expected a 32-character lowercase hex token "
        "and one fd, or ALLOC <bytes>")
    put("fd_socket", "err-exhausted", "ERR RESOURCE_EXHAUSTED: too many arena requests at once (64); retry")
    put("fd_socket", "err-legacy", "ERR too many pending fds")
    put("fd_socket", "token", token)
    put("fd_socket", "alloc", "ALLOC 4096")
    # The size limits (kMaxArenaBytes is accepted, one more is not) and a
    # sign the old strtoull/sscanf parsers let through.
    put("fd_socket", "alloc-max", "ALLOC 70368744177664")
    put("fd_socket", "alloc-negative", "ALLOC -5")
    put("fd_socket", "ok-grant-over-max", "OK %s 70368744177665" % token)
    # Cache views: a request and the replies at and past the fd limit.
    put("fd_socket", "views", "VIEWS %s" % token)
    put("fd_socket", "ok-views", "OK VIEWS 3")
    put("fd_socket", "ok-views-max", "OK VIEWS 200")
    put("fd_socket", "ok-views-over-max", "OK VIEWS 201")


# ---------------------------------------------------------------------------
# plan_codec: serialized ckptd.peer.v1.PlanPart.

def plan_seeds(tmp):
    os.makedirs(tmp, exist_ok=True)
    subprocess.check_call(["protoc", "--proto_path=" + os.path.join(ROOT, "proto"),
                           "--python_out=" + tmp, os.path.join(ROOT, "proto/peer.proto")])
    sys.path.insert(0, tmp)
    import peer_pb2 as pb  # noqa: E402

    def box(m, off, shape):
        m.offset.extend(off)
        m.shape.extend(shape)

    def target(t, name, dtype, gshape, off, shape, flat=None):
        t.name = name
        t.dtype = dtype
        t.global_shape.extend(gshape)
        box(t.box, off, shape)
        if flat:
            t.flat_range.begin, t.flat_range.end = flat

    # The tiny model's TP2 checkpoint loaded as 4 ranks split on dim 0: this
    # node holds ranks 2 and 3 of a two-node job.
    p = pb.PlanPart(job_id="job-7", format="native", unique_id=1, plan_s=0.0021,
                    job_bytes_to_read=98304)
    p.files.extend(["0_1.safetensors", "1_1.safetensors"])
    p.nodes.extend(["10.0.0.1:7071", "10.0.0.2:7071"])
    for i, (f, off, length, node) in enumerate(((0, 4096, 16384, "10.0.0.1:7071"),
                                                 (0, 20480, 16384, "10.0.0.1:7071"),
                                                 (1, 4096, 16384, "10.0.0.2:7071"),
                                                 (1, 20480, 49152, "10.0.0.2:7071"))):
        r = p.reads.add(file=f, offset=off, length=length, reader=node)
        r.needed_by.extend(["10.0.0.2:7071"] if i < 2 else ["10.0.0.1:7071", "10.0.0.2:7071"])
        r.checks.add(tensor="model.layers.0.self_attn.q_proj.weight", offset=off, nbytes=length,
                     xxh3=0x9E3779B97F4A7C15 ^ i)
    for rank in (2, 3):
        rp = p.ranks.add(rank=rank, local_fast_path=False)
        target(rp.targets.add(), "model.layers.0.self_attn.q_proj.weight", "F32", [64, 64],
               [16 * rank, 0], [16, 64])
        target(rp.targets.add(), "model.embed_tokens.weight", "BF16", [256, 64], [64 * rank, 0], [64, 64])
        target(rp.targets.add(), "lm_head.weight", "BF16", [256, 64], [0, 0], [256, 64],
               flat=(4096 * rank, 4096 * (rank + 1)))
        c = rp.copies.add(target=0, read=2, src_offset=4096 + 4096 * (rank - 2), elements=1024)
        box(c.src.box, [32, 0], [32, 64])
        c.src.flat_begin, c.src.flat_end, c.src.dtype = 0, 2048, "F32"
        box(c.region, [16 * rank, 0], [16, 64])
        c = rp.copies.add(target=1, read=3, src_offset=20480, elements=4096)
        box(c.src.box, [128, 0], [128, 64])
        c.src.flat_begin, c.src.flat_end, c.src.dtype = 0, 8192, "BF16"
        box(c.region, [64 * rank, 0], [64, 64])
        c = rp.copies.add(target=0, read=1, src_offset=20480, elements=64)
        box(c.src.box, [0, 0], [64, 64])
        c.src.flat_begin, c.src.flat_end, c.src.dtype = 0, 4096, "F32"
        c.src.perm.extend([1, 0])
        box(c.region, [16 * rank, 0], [16, 4])
        rp.missing_keys.append("model.layers.9.mlp.gate_proj.weight")
    p.unexpected_keys.append("step")
    p.renamed_keys["model.layers.0.self_attn.q_proj.weight.master_weights"] = \
        "model.layers.0.self_attn.q_proj.weight_fp32_master_0"
    p.nccl_id = bytes(range(128))
    put("plan_codec", "tp2-to-tp4-node1", p.SerializeToString())

    q = pb.PlanPart(job_id="j", format="paddle")
    q.files.append("0_0.distcp")
    q.nodes.append("localhost:7071")
    q.reads.add(file=0, offset=0, length=8, reader="localhost:7071")
    rp = q.ranks.add(rank=0)
    target(rp.targets.add(), "step", "int64", [], [], [])
    c = rp.copies.add(target=0, read=0, src_offset=0, elements=1)
    c.src.flat_end, c.src.dtype = 1, "I64"
    put("plan_codec", "scalar", q.SerializeToString())
    put("plan_codec", "empty", b"")

    # One node: a flattened BF16 target filled from F32 (a cast) through two
    # checksum blocks: ValidatePlanPart passes, the executor runs it.
    c2 = pb.PlanPart(job_id="cast", format="native")
    c2.files.append("0_1.safetensors")
    c2.nodes.append("127.0.0.1:7071")
    r = c2.reads.add(file=0, offset=64, length=128, reader="127.0.0.1:7071")
    r.needed_by.append("127.0.0.1:7071")
    for k in range(2):
        r.checks.add(tensor="w", offset=64 + 64 * k, nbytes=64, xxh3=k)
    rp = c2.ranks.add(rank=0)
    target(rp.targets.add(), "w", "BF16", [8, 4], [0, 0], [8, 4], flat=(4, 28))
    c = rp.copies.add(target=0, read=0, src_offset=64, elements=24)
    box(c.src.box, [0, 0], [8, 4])
    c.src.flat_begin, c.src.flat_end, c.src.dtype = 0, 32, "F32"
    box(c.region, [0, 0], [8, 4])
    put("plan_codec", "cast-flat-one-node", c2.SerializeToString())

    # The first seed with a copy whose source bytes leave its read (refused:
    # ranks[1].copies[0].src_offset).
    p.ranks[1].copies[0].read = 3
    put("plan_codec", "refused-copy-outside-read", p.SerializeToString())


# job_mac: serialized ckptd.peer.v1.JoinRequest carrying a job_mac.

def job_mac_seeds(tmp):
    sys.path.insert(0, tmp)  # peer_pb2, made by plan_seeds
    import hashlib  # noqa: E402
    import hmac  # noqa: E402
    import peer_pb2 as pb  # noqa: E402
    key = b"fuzz-job-key-0123456789abcdef"  # job_mac_fuzz.cc kKey

    def mac(*fields):
        return hmac.new(key, b"".join(f.encode() + b"\0" for f in fields), hashlib.sha256).digest()

    j = pb.JoinRequest(job_id="torchelastic-run/load/0", node="10.0.0.2:7071", path="ckpt",
                       world_size=16, coordinator_rank=0)
    j.ranks.add(rank=8)
    j.job_mac = mac("ckptd/1 join", j.job_id, j.node)
    put("job_mac", "valid-join", j.SerializeToString())
    j.job_mac = mac("ckptd/1 plan", j.job_id, j.path, j.node)
    put("job_mac", "plan-proof", j.SerializeToString())
    j.job_mac = b"\x00" * 32
    put("job_mac", "wrong-proof", j.SerializeToString())
    j.ClearField("job_mac")
    put("job_mac", "no-proof", j.SerializeToString())
    j.job_mac = b"a-client-job-key-of-24b"
    put("job_mac", "key-sized", j.SerializeToString())
    put("job_mac", "empty", b"")


# fetch_spans: 8 bytes of read length (little-endian), then a serialized
# ckptd.peer.v1.FetchReadRequest.

def fetch_spans_seeds(tmp):
    sys.path.insert(0, tmp)  # peer_pb2, made by plan_seeds
    import struct  # noqa: E402
    import peer_pb2 as pb  # noqa: E402

    def put_req(name, length, spans=(), runs=()):
        r = pb.FetchReadRequest(job_id="j", read=3, node="10.0.0.2:7071")
        for b, e in spans:
            r.spans.add(begin=b, end=e)
        r.span_runs.extend(runs)
        put("fetch_spans", name, struct.pack("<Q", length) + r.SerializeToString())

    put_req("whole", 1 << 21)
    put_req("column-slice-runs", 1 << 21, runs=(256, 64, 4096, 512))
    put_req("two-runs-touching", 4096, runs=(0, 8, 8, 4, 32, 1, 0, 1))
    put_req("old-spans", 4096, spans=((0, 8), (16, 40), (4092, 4096)))
    put_req("overlapping-runs", 4096, runs=(0, 8, 4, 2))
    put_req("past-the-read", 100, runs=(0, 4, 8, 14))
    put_req("both-forms", 100, spans=((0, 1),), runs=(4, 1, 0, 1))
    put_req("wrapping-stride", 100, runs=(0, 1, 1 << 62, 5))


# ---------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckptctl", default=os.path.join(ROOT, "bazel-bin/client/ckptctl"))
    args = ap.parse_args()
    if not os.access(args.ckptctl, os.X_OK):
        sys.exit("make_corpus: %s not found: run `bazel build //client:ckptctl` first" % args.ckptctl)
    tmp = tempfile.mkdtemp(prefix="ckptd-corpus-")
    try:
        native = os.path.join(tmp, "native")
        ex = os.path.join(ROOT, "examples")
        for sub, layout, uid in (("tp2", "layout-tp2.json", 1), ("tp4", "layout-tp4-dim0.json", 2)):
            subprocess.check_call([args.ckptctl, "shard", os.path.join(ex, "tiny-model"), "--layout",
                                   os.path.join(ex, layout), "--out", os.path.join(native, sub),
                                   "--unique-id", str(uid)], stdout=subprocess.DEVNULL)
        pd = os.path.join(tmp, "paddle")
        dcp = os.path.join(tmp, "dcp")
        os.makedirs(pd)
        os.makedirs(dcp)
        gen = os.path.join(ROOT, "tests/foreign")
        subprocess.check_call(["/usr/bin/python3", os.path.join(gen, "paddle_gen.py"), pd],
                              stdout=subprocess.DEVNULL)
        subprocess.check_call(["/usr/bin/python3", os.path.join(gen, "dcp_gen.py"), dcp],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        safetensors_seeds(native, pd)
        metadata_seeds(native)
        pickle_seeds(pd, dcp)
        distcp_seeds(dcp)
        embed(pd, dcp)
        aoa_seeds()
        layout_seeds(pd, dcp)
        config_seeds()
        fd_socket_seeds()
        plan_seeds(os.path.join(tmp, "py"))
        job_mac_seeds(os.path.join(tmp, "py"))
        fetch_spans_seeds(os.path.join(tmp, "py"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = 0
    for d, _, files in os.walk(CORPUS):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    print("make_corpus: corpora in %s: %d bytes" % (CORPUS, total))


if __name__ == "__main__":
    main()
