"""The sentence encoder's dtype and threads (the bundled MiniLM, no download).

Why these checks: bfloat16 is chosen automatically on AMX CPUs, so its vectors must stay close to
float32 (cosine ≥ 0.999: the RF sees 20 grouped sums of them); a model must be served in the dtype
its forest learned from, and the embedding cache must never hand one dtype's vectors out for the
other's. The encoder's wider thread count must not leak into the rest of the predictor thread.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import predictor.encoder as enc
from cohort.settings import Settings
from predictor.embcache import EmbeddingCache
from predictor.magnus import MagnusPredictor

TEXTS = ["", "Translate the following sentence into Chinese.", "hi",
         "public static int add(int a, int b) { return a + b; }\n" * 8,
         "The quick brown fox jumps over the lazy dog, again and again, until it is tired."]


def _use(monkeypatch, **fields) -> None:
    s = Settings(_env_file=None, **fields)
    monkeypatch.setattr(enc, "get_settings", lambda: s)


@pytest.mark.slow  # MiniLM in bfloat16, emulated on CPUs without AMX: seconds
def test_bf16_vectors_stay_close_to_float32():
    ref = enc.load_encoder(None, dtype="float32").encode(TEXTS, batch_size=4, convert_to_numpy=True)
    got = np.asarray(enc.load_encoder(None, dtype="bfloat16").encode(TEXTS, batch_size=16, convert_to_numpy=True),
                     dtype=np.float32)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-2)


@pytest.mark.slow  # MiniLM in bfloat16, emulated on CPUs without AMX: seconds
def test_bf16_vectors_barely_depend_on_their_batch():
    """bf16 arithmetic rounds differently with the padded shape: not bit-identical across batchings
    as float32 is, but far below what moves a prediction on average (docs/notes/predictors.md)."""
    model = enc.load_encoder(None, dtype="bfloat16")
    alone = np.stack([np.asarray(model.encode([t], convert_to_numpy=True), np.float32)[0] for t in TEXTS])
    batched = np.asarray(model.encode(TEXTS, batch_size=16, convert_to_numpy=True), np.float32)
    na, nb = np.linalg.norm(alone, axis=1), np.linalg.norm(batched, axis=1)
    assert ((alone * batched).sum(1) / (na * nb)).min() >= 0.9995
    # the bf16 normalisation leaves a vector's length off 1 by up to ~0.3 % (CPUs without AMX
    # round differently from those with it), alike whatever the batch
    assert np.abs(na / nb - 1.0).max() <= 0.01


@pytest.mark.parametrize(("choice", "amx", "backend", "want"), [
    ("auto", True, "torch", "bfloat16"), ("auto", False, "torch", "float32"), ("auto", True, "onnx", "float32"),
    ("float32", True, "torch", "float32"), ("bfloat16", False, "torch", "bfloat16"),
])
def test_configured_dtype(monkeypatch, choice, amx, backend, want):
    _use(monkeypatch, encoder_dtype=choice)
    monkeypatch.setattr(enc, "cpu_has_amx", lambda: amx)
    assert enc.configured_dtype(backend) == want


def test_bf16_with_the_onnx_backend_is_refused(monkeypatch):
    _use(monkeypatch, encoder_dtype="bfloat16")
    with pytest.raises(ValueError, match="ONNX"):
        enc.configured_dtype("onnx")
    with pytest.raises(ValueError):
        enc.load_encoder(None, backend="onnx", dtype="bfloat16")


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_model_is_served_in_the_dtype_it_was_trained_with(tmp_path, monkeypatch):
    _use(monkeypatch, encoder_dtype="float32")  # what this process would pick for a new model
    MagnusPredictor(encoder_dtype="bfloat16", n_estimators=2).save(tmp_path / "bf16")
    assert MagnusPredictor.load(tmp_path / "bf16").encoder_dtype == "bfloat16"
    old = tmp_path / "old"  # saved before the field existed: its forest learned float32 vectors
    MagnusPredictor(n_estimators=2).save(old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["encoder_dtype"]
    (old / "meta.json").write_text(json.dumps(meta))
    _use(monkeypatch, encoder_dtype="bfloat16")
    assert MagnusPredictor.load(old).encoder_dtype == "float32"


def test_the_embedding_cache_keeps_dtypes_apart(tmp_path, monkeypatch):
    _use(monkeypatch, encoder_dtype="auto")
    monkeypatch.setattr(enc, "cpu_has_amx", lambda: True)  # where bf16 is served as bf16
    fp32, bf16 = EmbeddingCache(tmp_path, None, "float32"), EmbeddingCache(tmp_path, None, "bfloat16")
    assert fp32.dir != bf16.dir and bf16.dir.name.endswith("-bfloat16")
    assert not fp32.dir.name.endswith("float32")  # caches written before dtypes existed stay valid


def test_encoder_threads_widen_only_the_forward(monkeypatch):
    import torch
    from threadpoolctl import threadpool_limits

    _use(monkeypatch, encoder_threads=2, encoder_dtype="float32")
    seen: list[int] = []

    class Recorder:
        def encode(self, texts, **_):
            seen.append(torch.get_num_threads())
            return np.zeros((len(texts), 384), np.float32)

    monkeypatch.setattr(enc, "load_encoder", lambda *a, **k: Recorder())

    def on_predictor_thread() -> tuple[int, int]:
        threadpool_limits(limits=1, user_api="openmp")  # as PredictorService's thread starts
        torch.set_num_threads(1)
        enc.encode(["a", "b"], backend="torch")
        return torch.get_num_threads(), seen[-1]

    after, during = ThreadPoolExecutor(1).submit(on_predictor_thread).result()
    assert (during, after) == (2, 1)


def test_a_bf16_model_on_a_cpu_without_amx_is_encoded_in_float32(monkeypatch):
    """bf16 is emulated without AMX (4-8x slower, measured): under auto a bf16-trained model's
    texts are encoded in float32 there, and the embedding cache files them as float32."""
    seen: list[str] = []

    class Recorder:
        def encode(self, texts, **_):
            return np.zeros((len(texts), 384), np.float32)

    def fake_load(path=None, device="cpu", backend="torch", cache_root=None, dtype="float32"):
        seen.append(dtype)
        return Recorder()

    monkeypatch.setattr(enc, "load_encoder", fake_load)
    monkeypatch.setattr(enc, "cpu_has_amx", lambda: False)
    _use(monkeypatch, encoder_dtype="auto")
    enc.encode(["a"], dtype="bfloat16", backend="torch")
    assert enc.encoding_dtype("torch", "bfloat16") == "float32"
    _use(monkeypatch, encoder_dtype="bfloat16")  # asked for explicitly: kept
    enc.encode(["a"], dtype="bfloat16", backend="torch")
    assert seen == ["float32", "bfloat16"]
    monkeypatch.setattr(enc, "cpu_has_amx", lambda: True)
    _use(monkeypatch, encoder_dtype="auto")
    assert enc.encoding_dtype("torch", "bfloat16") == "bfloat16"
    assert enc.encoding_dtype("onnx", "bfloat16") == "float32"
