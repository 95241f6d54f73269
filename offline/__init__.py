"""Offline jobs: the job runner that carries Batch API jobs through the gateway."""
