"""The sim engine ends a request as vLLM does: EOS and stop token ids are checked before
the length cap (vLLM's ``check_stop``), so an EOS or stop token that is the last allowed
token ends it ``stop`` without its text; and each finish carries vLLM's ``stop_reason``
(the stop token id or stop string; None for EOS and for ``length``)."""

from __future__ import annotations

from services.worker.engines.sim_sequence import EOS
from tests.unit.test_sim_core import TOK, prompt, req, solo


def test_eos_as_the_last_allowed_token_ends_stop_not_length() -> None:
    free = solo({}, req("e", prompt(8), max_tokens=900, seed=5))
    toks = free.tokens("e")
    assert toks[-1] == EOS and free.final("e").finish_reason == "stop"
    capped = solo({}, req("e", prompt(8), max_tokens=len(toks), seed=5))
    final = capped.final("e")
    assert final.finish_reason == "stop"  # "length" before: the cap was checked first
    assert final.stop_reason is None  # EOS has no stop_reason (vLLM's)
    assert capped.tokens("e") == toks and final.completion_tokens == len(toks)
    assert capped.text("e") == TOK.decode(toks[:-1])


def test_a_stop_token_as_the_last_allowed_token_ends_stop_without_its_text() -> None:
    plain = solo({}, req("s", prompt(8), max_tokens=100, ignore_eos=True, seed=9))
    toks = plain.tokens("s")
    stop_tok = toks[10]
    first = toks.index(stop_tok)
    run = solo({}, req("s", prompt(8), max_tokens=first + 1, ignore_eos=True, seed=9, stop_token_ids=[stop_tok]))
    final = run.final("s")
    assert (final.finish_reason, final.stop_reason) == ("stop", stop_tok)
    assert run.tokens("s") == toks[: first + 1]
    assert run.text("s") == TOK.decode(toks[:first])  # the stop token's text is not output
    # One token more allowed: the same end, the same reason.
    roomy = solo({}, req("s", prompt(8), max_tokens=100, ignore_eos=True, seed=9, stop_token_ids=[stop_tok]))
    assert (roomy.final("s").finish_reason, roomy.final("s").stop_reason) == ("stop", stop_tok)


def test_stop_reason_names_the_stop_string_and_is_none_at_the_length_cap() -> None:
    plain = solo({}, req("t", prompt(8), max_tokens=300, ignore_eos=True, seed=2))
    words = plain.text("t").split()
    assert plain.final("t").finish_reason == "length" and plain.final("t").stop_reason is None
    stops = ["never-there", " " + words[5] + " "]
    run = solo({}, req("t", prompt(8), max_tokens=300, ignore_eos=True, seed=2, stop=stops))
    final = run.final("t")
    assert (final.finish_reason, final.stop_reason) == ("stop", stops[1])
    assert not run.text("t").endswith(stops[1])
