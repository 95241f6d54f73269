"""Offline jobs (issue 21): the job runner that carries Batch API jobs through the gateway."""
