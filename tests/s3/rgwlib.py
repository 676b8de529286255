"""A throwaway Ceph S3 gateway for the Python object-storage tests
(tests/s3/rgw.sh): started once per test process, its AWS_* variables put
into os.environ (daemons started afterwards inherit them), stopped at exit;
signed requests made with curl, to look at or change objects behind
ckptd's back; and the box a rank of an even split owns (split)."""
import atexit
import os
import subprocess

_HERE = os.path.dirname(os.path.abspath(__file__))
_STARTED = []
# The gateway itself (AWS_ENDPOINT_URL may be pointed elsewhere later, at a
# proxy in front of it).
ENDPOINT = None


def start():
    """Starts the gateway (once); returns the bucket name. A gateway that does
    not start raises (never a skip)."""
    if not _STARTED:
        d = subprocess.run(["mktemp", "-d", "/tmp/ckptd-rgw-XXXXXX"], check=True,
                           capture_output=True, text=True).stdout.strip()
        out = subprocess.run(["bash", os.path.join(_HERE, "rgw.sh"), "start", d],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"tests/s3/rgw.sh start failed: {out.stdout}{out.stderr}")
        for line in out.stdout.splitlines():
            if line.startswith("export ") and "=" in line:
                k, v = line[len("export "):].split("=", 1)
                os.environ[k] = v
        _STARTED.append(d)
        global ENDPOINT
        ENDPOINT = os.environ["AWS_ENDPOINT_URL"]
        atexit.register(lambda: subprocess.run(["bash", os.path.join(_HERE, "rgw.sh"), "stop", d]))
    return os.environ["CKPTD_TEST_S3_BUCKET"]


def request(method, key, *, body=None, extra=()):
    """A signed request for object `key` of the test bucket; (HTTP status, body bytes)."""
    url = f"{ENDPOINT}/{os.environ['CKPTD_TEST_S3_BUCKET']}/{key}"
    verb = ["-I"] if method == "HEAD" else ["-X", method]
    cmd = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", *verb,
           "--aws-sigv4", f"aws:amz:{os.environ['AWS_REGION']}:s3",
           "--user", f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}",
           "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", *extra, url]
    if body is not None:
        cmd[1:1] = ["--data-binary", "@-"]
    out = subprocess.run(cmd, input=body, capture_output=True, check=True).stdout
    data, _, code = out.rpartition(b"\n")
    return int(code), data


def split(shape, dim, parts, r):
    """(offset, shape) of rank r's part when `shape` is cut in `parts` along `dim`."""
    off, shp = [0] * len(shape), list(shape)
    shp[dim] = shape[dim] // parts
    off[dim] = r * shp[dim]
    return tuple(off), tuple(shp)
