"""Docs that cannot drift (issue 38): the documentation is checked against the
binaries it describes, so a wrong doc fails CI.

- The README's 5-minute tour runs as written (its code blocks in order, with
  /tmp/tour moved to a scratch directory and the built binaries on PATH), and
  prints what its text says (18 tensors, version 1).
- Every code block of a docs page marked `<!-- runnable -->` runs.
- The keys of docs/configuration.md's table are exactly the top-level keys of
  `ckptd --print-config`; the `limits` keys of docs/security.md are exactly
  its `limits` keys.
- The flags docs/configuration.md names are exactly ckptd's own (`ckptd
  --help`); every flag docs/ckptctl.md names is one of ckptctl's, and every
  one of ckptctl's is named there.
- The metrics docs/operations.md lists are exactly the families a live
  /metrics serves (a daemon with a peer, after a load and a failed one).

Runs under Bazel (tests/ops/BUILD).
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest
import urllib.request

import testlib

CKPTD = os.path.abspath(testlib.CKPTD)
CKPTCTL = os.path.abspath(testlib.CKPTCTL)


def repo_root():
    """The runfiles root: README.md, docs/, examples/, client/python are there."""
    here = os.getcwd()
    assert os.path.isfile(os.path.join(here, "README.md")), here
    return here


ROOT = repo_root()


def read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def section(text, heading):
    """The lines of the markdown section under `heading` (to the next heading of
    the same or a higher level)."""
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    start = lines.index(heading) + 1
    out = []
    for line in lines[start:]:
        m = re.match(r"^(#{1,6})\s", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return out


def code_blocks(lines):
    """The indented (4 spaces) code blocks of markdown lines, in order, each as
    its text (indent removed); a block may hold blank lines."""
    blocks, cur = [], []
    for line in lines:
        if line.startswith("    "):
            cur.append(line[4:])
        elif not line.strip() and cur:
            cur.append("")
        else:
            if cur:
                blocks.append("\n".join(cur).rstrip() + "\n")
            cur = []
    if cur:
        blocks.append("\n".join(cur).rstrip() + "\n")
    return blocks


def bin_dir():
    """A directory holding ckptd and ckptctl, for PATH (the docs call them by name)."""
    d = tempfile.mkdtemp(prefix="docs-bin-", dir=os.environ.get("TEST_TMPDIR"))
    os.symlink(CKPTD, os.path.join(d, "ckptd"))
    os.symlink(CKPTCTL, os.path.join(d, "ckptctl"))
    return d


def run_script(script, env, timeout=180):
    """bash -euo pipefail on `script` in the repository root; background jobs
    it started are stopped (SIGTERM) and must exit 0."""
    full = ("set -euo pipefail\n" + script +
            "\nfor j in $(jobs -p); do kill -TERM \"$j\"; wait \"$j\"; done\n")
    return subprocess.run(["bash", "-c", full], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def scratch():
    """A scratch directory under /tmp (socket paths must stay under 108 bytes)."""
    d = tempfile.mkdtemp(prefix="docs-", dir="/tmp")
    testlib._CLEANUP.append(d)
    return d


def help_flags(binary, full=False):
    r = subprocess.run([binary, "--helpfull" if full else "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(?m)^  --([a-z0-9_]+)=", r.stdout))


def doc_flags(text):
    """--flag names in `text`, dashes as underscores (ckptd and ckptctl accept both)."""
    return {f.replace("-", "_") for f in re.findall(r"(?<![\w-])--([a-z][a-z0-9_-]*)", text)}


class DocsAgainstBinariesTest(unittest.TestCase):
    maxDiff = None

    def env(self):
        env = dict(os.environ)
        env["PATH"] = bin_dir() + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        env["CKPTD_RETRY_TIMEOUT"] = "30"  # as a user's shell has it (the default is 60)
        return env

    # --- commands ------------------------------------------------------------------

    def test_the_readme_tour_runs_as_written(self):
        lines = section(read("README.md"), "## A 5-minute tour")
        blocks = code_blocks(lines)
        self.assertGreaterEqual(len(blocks), 5, blocks)
        # Block 1 builds and puts bazel-bin on PATH: the test has the binaries.
        self.assertIn("bazel build //server:ckptd //client:ckptctl", blocks[0])
        tour = scratch()
        script = "\n".join(blocks[1:]).replace("/tmp/tour", tour)
        # Step 5 is prose ("kill %1"): run_script stops the background daemon.
        self.assertIn("`kill %1`", "\n".join(lines))
        r = run_script(script, self.env())
        log = open(os.path.join(tour, "ckptd.log")).read() if os.path.exists(
            os.path.join(tour, "ckptd.log")) else ""
        self.assertEqual(r.returncode, 0, f"the tour failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
                                          f"\nckptd.log:\n{log[-2000:]}")
        # What the text around the blocks says.
        self.assertIn("(18\ntensors)", "\n".join(lines))
        self.assertRegex(r.stdout, r"(?m)^ckptd 1 18 tensors$")
        self.assertRegex(r.stdout, r"(?m)^(cache_view|process_memory|shm) \d+ \[\]$")
        self.assertTrue(os.path.exists(os.path.join(tour, "tp4", "rank0.safetensors")))
        self.assertIn("load job=", log)  # "its log: one line per job"

    def test_blocks_marked_runnable_run(self):
        marked = 0
        for page in sorted(os.listdir(os.path.join(ROOT, "docs"))):
            if not page.endswith(".md"):
                continue
            lines = read(os.path.join("docs", page)).splitlines()
            for i, line in enumerate(lines):
                if line.strip() != "<!-- runnable -->":
                    continue
                marked += 1
                block = code_blocks(lines[i + 1:])[0]
                out = scratch()
                env = self.env()
                env["OUT"] = out
                r = run_script(block, env)
                self.assertEqual(r.returncode, 0,
                                 f"docs/{page} line {i + 1}: the block failed:\n{block}\n"
                                 f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        self.assertGreater(marked, 0, "no docs block is marked <!-- runnable -->")

    # --- configuration keys ------------------------------------------------------------

    def print_config(self):
        r = subprocess.run([CKPTD, "--root", "/tmp", "--print-config"], capture_output=True,
                           text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        top = re.findall(r"(?m)^([a-z_0-9]+):", r.stdout)
        # The indented lines right after "limits:", up to the next top-level key.
        block = re.split(r"(?m)^\S", r.stdout.split("\nlimits:\n", 1)[1], maxsplit=1)[0]
        limits = re.findall(r"(?m)^  ([a-z_]+):", block)
        return set(top), set(limits)

    def test_config_keys_match_print_config(self):
        top, limits = self.print_config()
        table = [l for l in read("docs/configuration.md").splitlines() if l.startswith("| `")]
        documented = set()
        for row in table:
            first = row.split("|")[1]
            documented |= set(re.findall(r"`([a-z_0-9]+)`", first))
        self.assertEqual(documented - top, set(), "docs/configuration.md lists keys ckptd lacks")
        self.assertEqual(top - documented, set(), "keys ckptd has that docs/configuration.md "
                                                  "does not list")
        sec = "\n".join(section(read("docs/security.md"), "## Limits"))
        doc_limits = set(re.findall(r"(?m)^\| `([a-z_]+)`", sec))
        self.assertEqual(doc_limits ^ limits, set(),
                         "docs/security.md's Limits table and --print-config's limits differ")

    # --- flags -------------------------------------------------------------------------------

    def test_ckptd_flags_match_the_docs(self):
        own = help_flags(CKPTD)
        documented = doc_flags("\n".join(section(read("docs/configuration.md"), "## Flags")))
        self.assertEqual(documented - own, set(), "docs/configuration.md names flags ckptd lacks")
        self.assertEqual(own - documented, set(), "ckptd flags docs/configuration.md does not name")

    def test_ckptctl_flags_match_the_docs(self):
        own = help_flags(CKPTCTL)
        every = help_flags(CKPTCTL, full=True) | {"help", "helpfull", "version"}
        # (Not the daemon's command line in the examples, nor the `--name=value` of
        # the syntax note.)
        text = "\n".join(l for l in read("docs/ckptctl.md").splitlines()
                         if not l.lstrip().startswith("ckptd "))
        documented = doc_flags(text) - {"name"}
        self.assertEqual(documented - every, set(), "docs/ckptctl.md names flags ckptctl lacks")
        self.assertEqual(own - documented, set(), "ckptctl flags docs/ckptctl.md does not name")

    # --- metrics -------------------------------------------------------------------------------

    def documented_metrics(self):
        sec = section(read("docs/operations.md"), "## Metrics")
        names = set()
        for row in sec:
            if not row.startswith("| `"):
                continue
            first = row.split("|")[1] if "\\|" not in row else row.replace("\\|", "/").split("|")[1]
            spans = re.findall(r"`([a-z_][a-z0-9_]*)(?:\{[^`]*\})?`", first)
            base = None
            for s in spans:
                if s.startswith("_"):
                    names.add(base + s)
                else:
                    names.add(s)
                    base = s.rsplit("_", 2)[0]
        return names

    def served_metrics(self):
        root = scratch()
        ckpt = os.path.join(root, "tp2")
        subprocess.run([CKPTCTL, "shard", "examples/tiny-model", "--layout",
                        "examples/layout-tp2.json", "--out", ckpt, "--unique-id", "1"],
                       cwd=ROOT, check=True, capture_output=True)
        with open(os.path.join(ROOT, "examples", "layout-tp4-dim0.json")) as f:
            layout = json.load(f)
        layout["ranks"][0]["tensors"].append(dict(layout["ranks"][0]["tensors"][0],
                                                  name="no.such.tensor"))
        missing = os.path.join(root, "missing.json")
        with open(missing, "w") as f:
            json.dump(layout, f)
        # A peer (another daemon, on a Unix peer socket): the peer families appear.
        b_addr = "unix:" + os.path.join(scratch(), "b.peer")
        with testlib.Daemon(root, "--metrics-address", "127.0.0.1:0", "--peer-listen",
                            "127.0.0.1:0", "--peers", b_addr) as d, \
                testlib.Daemon(root, "--peer-listen", b_addr, "--peers", b_addr):
            port = d.ports()["metrics"]
            for lay in ("examples/layout-tp4-dim0.json", missing):
                subprocess.run([CKPTCTL, "load", ckpt, "--layout", lay, "--out",
                                os.path.join(root, "out"), "--daemon", d.socket],
                               cwd=ROOT, capture_output=True, timeout=60)

            def scrape():
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=10).read().decode()
            body = testlib.wait_for("the peer answering pings",
                                    lambda: (lambda b: b if "ckptd_peer_rtt_seconds" in b else None)(
                                        scrape()), 20, 0.2)
        return set(re.findall(r"(?m)^# TYPE (\S+) ", body))

    def test_metrics_match_a_live_scrape(self):
        documented = self.documented_metrics()
        served = self.served_metrics()
        self.assertIn("ckptd_load_job_errors_total", served)  # the failed load ran
        self.assertEqual(documented - served, set(), "docs/operations.md lists metrics ckptd "
                                                     "does not serve")
        self.assertEqual(served - documented, set(), "metrics ckptd serves that "
                                                     "docs/operations.md does not list")


if __name__ == "__main__":
    testlib.main("docs_commands_test")
