"""A simulated engine that speaks vLLM's OpenAI API: benchmark and test equipment, never on the
product path.

cohort sits in front of vLLM/SGLang upstreams; measuring cohort's own overhead, its scheduling
gains and its fault handling against a real engine needs a GPU and minutes per run. This package
answers the same HTTP API from a CPU: either a vLLM-v1-shaped step loop (waiting and running
queues, a token budget per step, chunked prefill, paged KV with prefix caching, preemption by
recompute) whose steps last what a roofline or a fitted model says, or a zero-compute
fixed-delay engine for measuring a front's own cost. ``cohort engine-sim serve`` runs it;
docs/engine_sim.md is the user's page.

One job per module: ``request`` (one request's tokens and its block hashes), ``kv_blocks`` (the
block pool and prefix cache), ``scheduler`` (the step's choice), ``step_time`` (how long a step
takes), ``engine`` (the clocked step loop), ``fixed`` (the fixed-delay engine), ``tokens``
(tokenizer and output tokens), ``wire`` (vLLM's response bodies), ``metrics`` (``/metrics``),
``server`` (the aiohttp app), ``config`` (options and derived sizes), ``cli`` (the command).
"""
