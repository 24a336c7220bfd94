"""docs/how_it_works.md's table of how much of each script is the lesson is what benchmarks/lesson_share.py prints
today (a script that grows, or a function moved, changes it), and every script meets the aim of at least 60%."""
import os
import subprocess
import sys

from conftest import REPO


def test_the_lesson_table_is_what_the_count_prints():
    printed = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "lesson_share.py")],
                             capture_output=True, text=True, check=True).stdout
    table = printed.split("\n\n")[0].strip()
    assert table in open(os.path.join(REPO, "docs", "how_it_works.md")).read()
    shares = [int(line.rsplit("|", 2)[1].strip(" %")) for line in table.splitlines()[2:]]
    assert len(shares) == 7 and min(shares) >= 60, table
