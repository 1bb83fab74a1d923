"""A bound on what a test leaves resident in its pytest process (a plugin, registered by conftest).

`make test` runs two pytest-xdist workers on a 24 GiB machine, and each starts vLLM engines, DeepSpeed
ranks and `gndpo` processes of its own beside what it holds. A test that leaves its worker holding
gigabytes (an engine, a model, a DeepSpeed engine that a command did not release) makes every later
test in that worker pay for it, and two such workers are an out-of-memory kill. So after each test's
teardown the worker's resident set is read: above :data:`RESIDENT_BOUND_GIB` the test fails, named, and
the run's summary shows the largest resident set any test left and which test left it.
"""

from __future__ import annotations

import pytest

from tests.memory import rss

# Two workers at the bound hold 12 GiB of the machine's 24, which leaves room for the engines, ranks
# and servers they start and the page cache of the models they read. The in-process real-model
# rounds (SmolLM2 and Gemma 3 270M, engines and DeepSpeed kept) peak near 5 GiB while they run; a
# test must leave less than that behind.
RESIDENT_BOUND_GIB = 6.0
PROPERTY = "resident_gib_after"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "teardown":
        return
    resident = rss() / 2**30
    report.user_properties.append((PROPERTY, round(resident, 3)))
    if resident > RESIDENT_BOUND_GIB and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} left its process at {resident:.2f} GiB resident, above the bound of "
                           f"{RESIDENT_BOUND_GIB:g} GiB (tests/process_memory.py): release what it loaded where the command ends")


_largest: list = [0.0, None]  # GiB, test id: in the controller under xdist, gathered from the reports


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == PROPERTY and value > _largest[0]:
            _largest[:] = [value, report.nodeid]


def pytest_terminal_summary(terminalreporter):
    if _largest[1] is not None:
        terminalreporter.write_line(f"largest resident set after a test: {_largest[0]:.2f} GiB ({_largest[1]}); "
                                    f"bound {RESIDENT_BOUND_GIB:g} GiB")
