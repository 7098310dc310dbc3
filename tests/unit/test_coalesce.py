from proto.messages import TokenLogprob, TopLogprob
from services.worker.coalesce import Coalescer


def test_first_token_flushes_at_once_then_coalesces() -> None:
    c = Coalescer(interval_s=0.02, max_tokens=4)
    c.add([1], "a", now=0.0)
    assert c.should_flush(0.0)
    assert c.take(0.0) == ([1], "a", None)
    c.add([2], "b", now=0.001)
    assert not c.should_flush(0.001)  # neither enough tokens nor enough time
    c.add([3, 4], "cd", now=0.002)
    assert not c.should_flush(0.002)
    c.add([5], "e", now=0.003)
    assert c.should_flush(0.003)  # 4 tokens pending
    assert c.take(0.003) == ([2, 3, 4, 5], "bcde", None)


def test_interval_flushes_a_slow_trickle() -> None:
    c = Coalescer(interval_s=0.02, max_tokens=100)
    c.add([1], "", now=0.0)
    c.take(0.0)
    c.add([2], "", now=0.01)
    assert not c.should_flush(0.019)
    assert c.should_flush(0.021)
    assert not Coalescer(0.02, 4).should_flush(5.0)  # nothing pending, nothing to send


def test_logprobs_travel_with_their_tokens() -> None:
    c = Coalescer(interval_s=0.02, max_tokens=4)
    lp = [TokenLogprob(1, "a", -0.5, [TopLogprob(1, "a", -0.5)]), TokenLogprob(2, "b", -1.0)]
    c.add([1], "a", 0.0, lp[:1])
    assert c.take(0.0) == ([1], "a", lp[:1])
    c.add([2], "b", 0.001, lp[1:])
    c.add([3], "c", 0.002, [TokenLogprob(3, "c", -0.1)])
    ids, text, logprobs = c.take(0.01)
    assert text == "bc"
    assert ids == [2, 3] and logprobs is not None and [x.token_id for x in logprobs] == ids
    assert c.take(0.02) == ([], "", [])  # asked for once: an empty run still says so
