"""bench/scale.py at a size CI affords (issue 34): 4 real daemons on loopback
addresses, one job of 8 ranks, then the same job again, one daemon killed
during a third (in another run, the coordinator), all stopped at once. The
figures the harness prints must meet the issue's bounds: bytes between the daemons at most 1.1x the bytes the ranks
need, one Join per joining node and about one Locate per node, memory after the
job within 64 MiB of idle + cache, peer connections closed once idle, every
rank on a surviving node failed within 5 s naming the dead node, every daemon
gone within 5 s of SIGTERM. (The same harness at 8-128 daemons:
docs/multi-node.md.)"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import testlib

HERE = os.path.dirname(os.path.abspath(__file__))
SCALE = os.path.join(HERE, "..", "..", "bench", "scale.py")


def run_harness(test, nodes, per_node, *flags):
    """bench/scale.py at `nodes` daemons x `per_node` ranks: its one row."""
    with tempfile.TemporaryDirectory(prefix="ckptd-scale-") as work:
        out = os.path.join(work, "rows.json")
        p = subprocess.run(
            [sys.executable, SCALE, "--ckptd", testlib.CKPTD, "--ckptctl", testlib.CKPTCTL,
             "--nodes", str(nodes), "--ranks-per-node", str(per_node), *flags,
             "--workdir", os.path.join(work, "w"), "--json", out],
            capture_output=True, text=True, timeout=600)
        test.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(out) as f:
            (row,) = json.load(f)
    print(json.dumps(row))
    return row


class ScaleHarnessTest(unittest.TestCase):
    def test_four_daemons_meet_the_bounds(self):
        nodes, per_node = 4, 2
        row = run_harness(self, nodes, per_node, "--kill", "--again")
        self.assertEqual(row["nodes"], nodes)
        # Exactly what is needed: the dim-1 half of the tensors, 3/4 of it
        # from other nodes (whole reads: every node got all of that half).
        self.assertGreaterEqual(row["peer_bytes_over_needed"], 1.0, row)
        self.assertLessEqual(row["peer_bytes_over_needed"], 1.1, row)
        self.assertAlmostEqual(row["peer_bytes_over_checkpoint"], 0.5 * 3 / 4, delta=0.01, msg=row)
        calls = row["peer_calls_per_job"]
        self.assertEqual(calls["Join"], nodes - 1, row)
        self.assertLessEqual(calls["Locate"], 2 * nodes, row)
        self.assertEqual(calls["Complete"], nodes - 1, row)
        # Under ASan freed memory sits in its quarantine and the shadow grows:
        # RSS says nothing there, and stopping runs the leak check.
        sanitized = "ASAN_OPTIONS" in os.environ or "TSAN_OPTIONS" in os.environ
        if not sanitized:
            self.assertLessEqual(row["rss_over_idle_and_cache_mib_max"], 64, row)
        self.assertLessEqual(row["new_sockets_median_max"][1], 2 * (nodes - 1), row)
        self.assertEqual(row["new_sockets_after_idle_max"], 0, row)
        self.assertIn("again_wall_s", row)
        self.assertNotIn("kill_note", row)
        self.assertLess(row["kill_fail_s"], 5, row)
        self.assertEqual(row["kill_ranks_failed"], nodes * per_node, row)
        self.assertEqual(row["kill_ranks_naming_dead_node"], (nodes - 1) * per_node, row)
        self.assertLess(row["sigterm_all_exit_s"], 15 if sanitized else 5, row)

    def test_the_coordinators_death_fails_every_rank_at_once_naming_it(self):
        nodes, per_node = 4, 2
        row = run_harness(self, nodes, per_node, "--kill", "--kill-coordinator", "--idle-wait", "0")
        self.assertNotIn("kill_note", row)
        self.assertLess(row["kill_fail_s"], 5, row)
        self.assertEqual(row["kill_ranks_failed"], nodes * per_node, row)
        self.assertEqual(row["kill_ranks_naming_dead_node"], (nodes - 1) * per_node, row)


if __name__ == "__main__":
    unittest.main()
