"""The Celery app every process that sends or runs a task shares: task names, queues, the
broker configuration (JSON only, late acks, prefetch 1, visibility timeout). Below both kinds of
worker — the LLM instance (``workers``) and the learner (``learning``) — and the senders (the
batcher's entry point, the gateway's admin routes)."""
