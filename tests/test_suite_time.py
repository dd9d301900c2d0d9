"""benchmarks/suite_time.py reads pytest's own output: the closing counts, the durations table, the failures."""

from helpers import load_benchmark

OUTPUT = """\
........F.
============================= slowest 3 durations ==============================
41.81s call     tests/test_dispatch.py::test_backend[capacity]
29.60s setup    tests/test_bundle.py::test_an_exported_bundle
0.02s teardown tests/test_ledger.py::test_head
=========================== short test summary info ============================
FAILED tests/test_evals.py::test_adapter - AssertionError: 1 != 2
1 failed, 957 passed, 40 deselected in 458.40s (0:07:38)
"""


def test_suite_time_reads_counts_durations_and_failures():
    suite_time = load_benchmark("suite_time")
    assert suite_time.parse_counts(OUTPUT) == {"failed": 1, "passed": 957, "deselected": 40}
    rows = suite_time.parse_durations(OUTPUT, slowest=2)
    assert rows == [{"seconds": 41.81, "phase": "call", "test": "tests/test_dispatch.py::test_backend[capacity]"},
                    {"seconds": 29.6, "phase": "setup", "test": "tests/test_bundle.py::test_an_exported_bundle"}]
    assert suite_time.parse_failures(OUTPUT) == ["FAILED tests/test_evals.py::test_adapter - AssertionError: 1 != 2"]
