"""``meshserve sim-server``: the sim engine behind vLLM's HTTP surface, as one process.

A drop-in stand-in for a vLLM server (as llm-d-inference-sim is), but with the mesh's own
scheduler model (batching, chunked prefill, paged KV, prefix cache, preemption: the same
``SimEngine`` and profiles the mesh's sim workers run). It speaks vLLM's OpenAI endpoints,
``/tokenize``, ``/metrics`` under vLLM's names, ``/get_load`` for vllm-router or
sglang-router, and vLLM's KV events over ZMQ, so peers' routers can be driven by it.

It lives in ``ops/`` because it composes two services' parts (the gateway's request
parsing and response rendering, the worker's engine and metrics), which only ``ops`` may
import together; no NATS is involved.
"""
