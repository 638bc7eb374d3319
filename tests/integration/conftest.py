import pytest
from leftovers import kill_left_running


@pytest.fixture(autouse=True)
def no_launch_outlives_its_test():
    """A launcher a test left running is killed with its process group when the test ends."""
    yield
    kill_left_running()
