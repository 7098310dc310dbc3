from services.worker.coalesce import Coalescer


def test_first_token_flushes_at_once_then_coalesces() -> None:
    c = Coalescer(interval_s=0.02, max_tokens=4)
    c.add([1], "a", now=0.0)
    assert c.should_flush(0.0)
    assert c.take(0.0) == ([1], "a")
    c.add([2], "b", now=0.001)
    assert not c.should_flush(0.001)  # neither enough tokens nor enough time
    c.add([3, 4], "cd", now=0.002)
    assert not c.should_flush(0.002)
    c.add([5], "e", now=0.003)
    assert c.should_flush(0.003)  # 4 tokens pending
    assert c.take(0.003) == ([2, 3, 4, 5], "bcde")


def test_interval_flushes_a_slow_trickle() -> None:
    c = Coalescer(interval_s=0.02, max_tokens=100)
    c.add([1], "", now=0.0)
    c.take(0.0)
    c.add([2], "", now=0.01)
    assert not c.should_flush(0.019)
    assert c.should_flush(0.021)
    assert not Coalescer(0.02, 4).should_flush(5.0)  # nothing pending, nothing to send
