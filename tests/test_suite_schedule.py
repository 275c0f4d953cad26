"""The suite's own xdist scheduler (tests/conftest.py): groups stay whole and the slowest units go first."""

from collections import OrderedDict

from tests.conftest import GroupScheduling


class _Node:
    shutting_down = False

    def __init__(self):
        self.sent = []

    def send_runtest_some(self, indexes):
        self.sent.append(indexes)


def test_groups_stay_whole_and_the_shipped_default_is_handed_out_first():
    collection = ["tests/test_a.py::test_1", "tests/test_a.py::test_2", "tests/test_sharding_loop.py::test_p",
                  "tests/test_as_shipped.py::test_s1", "tests/test_sharding_loop.py::test_l",
                  "tests/test_as_shipped.py::test_s2"]
    scheduler = GroupScheduling.__new__(GroupScheduling)  # no xdist session: only the queue logic runs
    scheduler.workqueue = OrderedDict()
    for nodeid in collection:  # as LoadScopeScheduling.schedule builds it (collection order, no reorder)
        scheduler.workqueue.setdefault(scheduler._split_scope(nodeid), {})[nodeid] = False
    assert list(scheduler.workqueue) == ["tests/test_a.py", "warm_start", "shipped_default"]
    first, second = _Node(), _Node()
    scheduler.assigned_work, scheduler.registered_collections = {}, {first: collection, second: collection}
    scheduler._assign_work_unit(first)
    scheduler._assign_work_unit(second)
    assert first.sent == [[3, 5]]  # both shipped-default tests, to one worker, before anything else
    assert second.sent == [[2, 4]]  # the warm-start group next, whole
    assert list(scheduler.workqueue) == ["tests/test_a.py"]
