#!/usr/bin/python3
"""Counts passed/failed test cases in Bazel's JUnit XML files.

Prints one line per failing case and per skipped case (with its reason),
then "N skipped" when anything was skipped, and last "N passed, N failed".
Skipped and disabled cases are never counted as passed. A test target whose
XML has no test cases (a shell test) counts as one case. Exits 1 when
anything failed or nothing passed.

  count_tests.py [TESTLOGS [BAZEL_RC]] [--also LABEL=TESTLOGS=BAZEL_RC ...]
                 [--extra NAME=pass|fail|skip ...]

--also adds the cases of another `bazel test` run (tests/run.sh: the
--config=asan run), each named with LABEL. --extra adds a case checked
outside `bazel test` (the --config=cuda build, the fuzzing pass); a skipped
one counts as skipped.
"""
import os
import sys
import xml.etree.ElementTree as ET


def count_root(root, label=""):
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
                skipped += 1
                el = c.find("skipped")
                reason = (el.get("message") or el.text or "").strip() if el is not None else "disabled"
                print(f"SKIPPED {target}: {c.get('classname', '')}.{c.get('name', '')}"
                      f" ({reason.splitlines()[-1] if reason else 'no reason given'})")
            else:
                passed += 1
    return passed, failed, skipped


def main(root, bazel_rc=0, extra=(), also=()):
    passed = failed = skipped = 0
    for item in extra:
        name, _, result = item.rpartition("=")
        if result == "fail":
            failed += 1
            print(f"FAILED {name}")
        elif result == "skip":
            skipped += 1
            print(f"SKIPPED {name}")
        else:
            passed += 1
    runs = [("", root, bazel_rc)]
    for item in also:
        label, logs, rc = item.split("=", 2)
        runs.append((label + ": ", logs, int(rc)))
    for label, logs, rc in runs:
        p, f, s = count_root(logs, label)
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
    argv = sys.argv[1:]
    while argv:
        a = argv.pop(0)
        if a == "--extra" and argv:
            extra.append(argv.pop(0))
        elif a == "--also" and argv:
            also.append(argv.pop(0))
        else:
            args.append(a)
    sys.exit(main(args[0] if args else "bazel-testlogs",
                  int(args[1]) if len(args) > 1 else 0, extra, also))
