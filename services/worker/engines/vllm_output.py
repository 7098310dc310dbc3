"""One request's vLLM outputs as the worker's ``EngineOutput``s: new tokens and text, sample
and prompt logprobs, finish and stop reasons, cached tokens and phase times. Pure: fed
vLLM's ``RequestOutput`` objects (read by attribute, so tests need no vLLM) with the time
each arrived; ``VllmEngine.generate`` drives it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proto.messages import Timings, TokenLogprob

from .base import EngineOutput, EngineRequest, FinishReason
from .vllm_args import prompt_logprobs, sample_logprobs, scheduled_epoch

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "error": "error",
                                    "repetition": "stop"}


class OutputConverter:
    def __init__(self, req: EngineRequest, prompt_ids: list[int], decode: Callable[[int], str]) -> None:
        self.req = req
        self.prompt_ids = prompt_ids
        self.decode = decode
        self.output_ids: list[int] = []
        # vLLM sends the prompt's logprobs once, when prefill ends: they ride on the next output.
        self._pending_prompt: list[TokenLogprob | None] | None = None
        self._prompt_seen = 0
        self.cached = 0
        self.scheduled = 0.0
        self.first_token = 0.0
        self.engine_done = False  # vLLM finished the request itself

    def convert(self, out: Any, now: float, aborted: bool) -> tuple[int, EngineOutput | None]:
        """The new tokens of one vLLM output and what to yield for it: None when it carries
        no token, text or finish. ``aborted``: asked to stop before vLLM knew the request."""
        req = self.req
        completion = out.outputs[0] if out.outputs else None
        new_ids = list(completion.token_ids) if completion is not None else []
        if out.num_cached_tokens is not None:
            self.cached = int(out.num_cached_tokens)
        if new_ids and not self.first_token:
            self.first_token = now
            self.scheduled = scheduled_epoch(out, req.arrival_time, now)
        self.output_ids += new_ids
        if out.prompt_logprobs:
            seen = self._prompt_seen
            part = prompt_logprobs(self.prompt_ids[seen:seen + len(out.prompt_logprobs)], out.prompt_logprobs,
                                   req.sampling.prompt_logprobs or 0, self.decode)
            self._prompt_seen += len(part)
            self._pending_prompt = (self._pending_prompt or []) + part
        top = req.sampling.logprobs
        logprobs = (sample_logprobs(new_ids, completion.logprobs or [], top, self.decode)
                    if top is not None and completion is not None and new_ids else None)
        finish: FinishReason | None = None
        if out.finished:
            self.engine_done = True
            reason = str(completion.finish_reason) if completion is not None else "abort"
            finish = _FINISH.get(reason, "stop")
        elif aborted:
            finish = "abort"
        text = completion.text if completion is not None else ""
        if finish is None and not new_ids and not text:
            return 0, None
        stop_reason = getattr(completion, "stop_reason", None) if finish == "stop" else None
        output = EngineOutput(
            request_id=req.request_id, new_token_ids=new_ids, text=text, finish_reason=finish,
            stop_reason=stop_reason if isinstance(stop_reason, (int, str)) else None,
            logprobs=logprobs, prompt_logprobs=self._pending_prompt,
            prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached, completion_tokens=len(self.output_ids),
            timings=Timings(arrival=req.arrival_time, scheduled=self.scheduled, first_token=self.first_token,
                            finished=now if finish else 0.0),
            error="vLLM ended the request with an error" if finish == "error" else None,
        )
        self._pending_prompt = None
        if finish is not None and req.hold_kv:
            params = getattr(out, "kv_transfer_params", None)
            # A connector that names nothing (one that finds the KV by the prompt, as vLLM's
            # example connector does) still hands over: the decode side finds it the same way.
            output.kv_transfer = dict(params) if isinstance(params, dict) else {}
        return len(new_ids), output

    def failed(self, error: str, rejected: bool, now: float) -> EngineOutput:
        """The final output of a request vLLM gave no finish for (it raised, or stopped)."""
        return EngineOutput(
            request_id=self.req.request_id, finish_reason="error", error=error, rejected=rejected,
            prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached, completion_tokens=len(self.output_ids),
            timings=Timings(arrival=self.req.arrival_time, scheduled=self.scheduled, first_token=self.first_token,
                            finished=now),
        )
