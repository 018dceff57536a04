"""on_fresh_thread: runs a function on a new thread that has exited by the time it returns."""
import threading

import pytest

from nightjar.kernel.threads import on_fresh_thread


def test_runs_on_another_thread_that_has_exited_and_returns_its_result():
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x * 2

    assert on_fresh_thread(work, 21) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_the_exception_of_the_function_is_raised_on_the_caller():
    def boom():
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        on_fresh_thread(boom)
