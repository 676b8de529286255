#!/usr/bin/python3
"""Counts passed/failed test cases in Bazel's JUnit XML files.

Prints one line per failing case and per skipped case (with its reason),
then "N skipped" when anything was skipped, and last "N passed, N failed".
Skipped and disabled cases are never counted as passed. A test target whose
XML has no test cases (a shell test) counts as one case. Exits 1 when
anything failed or nothing passed.

  count_tests.py [TESTLOGS [BAZEL_RC]] [--also LABEL=TESTLOGS=BAZEL_RC ...]
                 [--extra NAME=pass|fail|skip ...] [--strict-skips]

--strict-skips (CI): a skip counts as a failure unless its reason names a
prerequisite as "[needs: NAME]" (see PREREQUISITES) that this machine lacks.

--also adds the cases of another `bazel test` run (tests/run.sh: the
--config=asan run), each named with LABEL. --extra adds a case checked
outside `bazel test` (the --config=cuda build, the fuzzing pass); a skipped
one counts as skipped.
"""
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET


# Prerequisites a skip may name as "[needs: NAME]" in its reason, and how to
# tell whether this machine has them. With --strict-skips (tests/run.sh in
# CI) a skip is a failure when it names no prerequisite, an unknown one, or
# one that is present: a test must not skip where it can run.
def _python_has(module):
    try:
        return subprocess.run(["/usr/bin/python3", "-c", f"import {module}"],
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _gpu_listed():
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        return r.returncode == 0 and "GPU " in r.stdout
    except (OSError, subprocess.SubprocessError):
        return False


PREREQUISITES = {
    "torch": lambda: _python_has("torch"),
    # A venv with pip, setuptools and wheel (tests/python/install_test.py):
    # Debian's python3-venv, python3-pip, python3-setuptools, python3-wheel.
    "python3-venv": lambda: all(_python_has(m) for m in ("ensurepip", "pip", "setuptools",
                                                         "wheel")),
    "gpu": _gpu_listed,
    "nvcc": lambda: os.path.exists("/usr/local/cuda/bin/nvcc") or shutil.which("nvcc") is not None,
    "root": lambda: os.geteuid() == 0,
    "clang-14": lambda: shutil.which("clang-14") is not None,
    # Skipped only by a --config=cuda build of the client; a build has it or not.
    "client built without CUDA": lambda: False,
    "CKPTD_SANITIZERS unset": lambda: os.environ.get("CKPTD_SANITIZERS", "1") != "0",
}
NEEDS = re.compile(r"\[needs: ([^\]]+)\]")
_probed = {}


def skip_violation(reason):
    """None when a skip with `reason` is allowed here, else why it is not."""
    m = NEEDS.search(reason or "")
    if m is None:
        return "a skip must name its prerequisite as [needs: ...]"
    name = m.group(1).strip()
    if name not in PREREQUISITES:
        return f"unknown prerequisite '{name}' (known: {', '.join(PREREQUISITES)})"
    if name not in _probed:
        _probed[name] = PREREQUISITES[name]()
    if _probed[name]:
        return f"skipped although its prerequisite '{name}' is present"
    return None


def count_root(root, label="", strict=False):
    """(passed, failed, skipped) of the test.xml files under `root`."""
    passed = failed = skipped = 0
    for dirpath, _, files in os.walk(root, followlinks=True):
        if "test.xml" not in files:
            continue
        path = os.path.join(dirpath, "test.xml")
        try:
            tree = ET.parse(path)
        except ET.ParseError as e:
            print(f"unreadable {path}: {e}")
            failed += 1
            continue
        cases = list(tree.iter("testcase"))
        target = label + os.path.relpath(dirpath, root)
        if not cases:
            suites = list(tree.iter("testsuite"))
            bad = any(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
            if bad:
                failed += 1
                print(f"FAILED {target}")
            else:
                passed += 1
            continue
        # gtest writes cases; a crash leaves a generated XML with an error.
        for c in cases:
            if c.find("failure") is not None or c.find("error") is not None:
                failed += 1
                print(f"FAILED {target}: {c.get('classname', '')}.{c.get('name', '')}")
            elif (c.find("skipped") is not None or c.get("result") in ("skipped", "suppressed")
                  or c.get("status") == "notrun"):
                # A skip (with its reason) or a disabled gtest: not a pass.
                el = c.find("skipped")
                reason = (el.get("message") or el.text or "").strip() if el is not None else "disabled"
                name = f"{target}: {c.get('classname', '')}.{c.get('name', '')}"
                why_not = skip_violation(reason) if strict else None
                if why_not:
                    failed += 1
                    print(f"FAILED {name}: {why_not} ({reason or 'no reason given'})")
                    continue
                skipped += 1
                print(f"SKIPPED {name} ({reason.splitlines()[-1] if reason else 'no reason given'})")
            else:
                passed += 1
    return passed, failed, skipped


def main(root, bazel_rc=0, extra=(), also=(), strict=False):
    passed = failed = skipped = 0
    for item in extra:
        name, _, result = item.rpartition("=")
        if result == "fail":
            failed += 1
            print(f"FAILED {name}")
        elif result == "skip":
            why_not = skip_violation(name) if strict else None
            if why_not:
                failed += 1
                print(f"FAILED {name}: {why_not}")
            else:
                skipped += 1
                print(f"SKIPPED {name}")
        else:
            passed += 1
    runs = [("", root, bazel_rc)]
    for item in also:
        label, logs, rc = item.split("=", 2)
        runs.append((label + ": ", logs, int(rc)))
    for label, logs, rc in runs:
        p, f, s = count_root(logs, label, strict)
        if rc != 0 and f == 0:
            print(f"FAILED {label}bazel test exited {rc} (build error or timeout)")
            f = 1
        passed, failed, skipped = passed + p, failed + f, skipped + s
    if skipped:
        print(f"{skipped} skipped")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    args, extra, also = [], [], []
    strict = False
    argv = sys.argv[1:]
    while argv:
        a = argv.pop(0)
        if a == "--strict-skips":
            strict = True
        elif a == "--extra" and argv:
            extra.append(argv.pop(0))
        elif a == "--also" and argv:
            also.append(argv.pop(0))
        else:
            args.append(a)
    sys.exit(main(args[0] if args else "bazel-testlogs",
                  int(args[1]) if len(args) > 1 else 0, extra, also, strict))
