"""tools/count_tests.py: skipped and disabled cases are reported (with their
reason) and never counted as passed; failures and crashes are counted."""
import os
import subprocess
import tempfile
import unittest

import testlib

COUNT = os.path.abspath("tools/count_tests.py")


def run(tree, *extra, flags=(), env=None):
    root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    for target, xml in tree.items():
        os.makedirs(os.path.join(root, target))
        with open(os.path.join(root, target, "test.xml"), "w") as f:
            f.write(xml)
    args = ["/usr/bin/python3", COUNT, root, "0", *flags]
    for e in extra:
        args += ["--extra", e]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)


GTEST = """<?xml version="1.0"?><testsuites><testsuite name="S" tests="3">
<testcase name="ok" status="run" result="completed" classname="S"/>
<testcase name="DISABLED_off" status="notrun" result="suppressed" classname="S"/>
<testcase name="skip" status="run" result="skipped" classname="S"><skipped message="needs a GPU"/></testcase>
</testsuite></testsuites>"""


class CountTests(unittest.TestCase):
    def test_skips_and_disabled_cases_are_not_passes(self):
        r = run({"t/a": GTEST}, "cuda build=skip")
        lines = r.stdout.strip().splitlines()
        self.assertEqual(lines[-1], "1 passed, 0 failed", r.stdout)
        self.assertEqual(lines[-2], "3 skipped", r.stdout)
        self.assertIn("needs a GPU", r.stdout)
        self.assertIn("DISABLED_off", r.stdout)
        self.assertEqual(r.returncode, 0)

    def test_only_skips_is_a_failure_to_run_anything(self):
        xml = GTEST.replace('<testcase name="ok" status="run" result="completed" classname="S"/>', "")
        r = run({"t/a": xml})
        self.assertTrue(r.stdout.strip().endswith("0 passed, 0 failed"), r.stdout)
        self.assertEqual(r.returncode, 1)

    def test_failures_and_unreadable_files_count(self):
        bad = GTEST.replace('<testcase name="ok" status="run" result="completed" classname="S"/>',
                            '<testcase name="ok" classname="S"><failure message="x"/></testcase>')
        r = run({"t/a": bad, "t/b": "<not xml"}, "cuda build=fail")
        self.assertTrue(r.stdout.strip().endswith("0 passed, 3 failed"), r.stdout)
        self.assertEqual(r.returncode, 1)

    def test_strict_skips_need_an_absent_prerequisite(self):
        # --strict-skips (CI): a skip must say "[needs: NAME]" and NAME must
        # be missing here. "CKPTD_SANITIZERS unset" is present unless the
        # variable is 0, so the environment decides it for this test.
        tagged = GTEST.replace('message="needs a GPU"',
                               'message="no sanitizers [needs: CKPTD_SANITIZERS unset]"')
        tagged = tagged.replace('<testcase name="DISABLED_off" status="notrun" result="suppressed" '
                                'classname="S"/>', "")
        env = {k: v for k, v in os.environ.items() if k != "CKPTD_SANITIZERS"}
        absent = dict(env, CKPTD_SANITIZERS="0")
        r = run({"t/a": tagged}, flags=["--strict-skips"], env=absent)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "1 passed, 0 failed", r.stdout)
        self.assertEqual(r.returncode, 0, r.stdout)
        r = run({"t/a": tagged}, flags=["--strict-skips"], env=env)
        self.assertIn("skipped although its prerequisite 'CKPTD_SANITIZERS unset' is present",
                      r.stdout)
        self.assertTrue(r.stdout.strip().endswith("1 passed, 1 failed"), r.stdout)
        self.assertEqual(r.returncode, 1)
        # Untagged skips, disabled cases and unknown prerequisites fail.
        r = run({"t/a": GTEST}, "cuda build [needs: warp drive]=skip", flags=["--strict-skips"],
                env=absent)
        self.assertIn("S.skip: a skip must name its prerequisite", r.stdout)
        self.assertIn("S.DISABLED_off: a skip must name its prerequisite", r.stdout)
        self.assertIn("unknown prerequisite 'warp drive'", r.stdout)
        self.assertTrue(r.stdout.strip().endswith("1 passed, 3 failed"), r.stdout)
        # Without --strict-skips the same tree only reports them.
        r = run({"t/a": GTEST}, "cuda build [needs: warp drive]=skip", env=absent)
        self.assertTrue(r.stdout.strip().endswith("1 passed, 0 failed"), r.stdout)

    def test_a_second_run_counts_with_its_label(self):
        # The sanitizer run (--also LABEL=TESTLOGS=RC): its cases add up, a
        # failure is named with the label, a non-zero exit with no failing
        # case is still a failure.
        other = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        os.makedirs(os.path.join(other, "t/a"))
        with open(os.path.join(other, "t/a/test.xml"), "w") as f:
            f.write(GTEST.replace('<testcase name="ok" status="run" result="completed" classname="S"/>',
                                  '<testcase name="ok" classname="S"><failure message="x"/></testcase>'))
        root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        os.makedirs(os.path.join(root, "t/a"))
        with open(os.path.join(root, "t/a/test.xml"), "w") as f:
            f.write(GTEST)
        r = subprocess.run(["/usr/bin/python3", COUNT, root, "0", "--also", f"asan={other}=1"],
                           capture_output=True, text=True, timeout=30)
        self.assertIn("FAILED asan: t/a: S.ok", r.stdout)
        self.assertIn("SKIPPED asan: t/a", r.stdout)
        self.assertTrue(r.stdout.strip().endswith("1 passed, 1 failed"), r.stdout)
        self.assertEqual(r.returncode, 1)
        empty = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        r = subprocess.run(["/usr/bin/python3", COUNT, root, "0", "--also", f"asan={empty}=3"],
                           capture_output=True, text=True, timeout=30)
        self.assertIn("FAILED asan: bazel test exited 3", r.stdout)
        self.assertEqual(r.returncode, 1)


if __name__ == "__main__":
    testlib.main("count_tests_test")
