"""ONNX encoder backends against the torch reference (the bundled MiniLM, no download).

Why these tolerances: the fp32 export is the same network, so it must agree to float rounding
(the RF sees only 20 grouped sums of the vector, so 1e-4 is far below any split it learned).
"""

from __future__ import annotations

import numpy as np
import pytest

from predictor.encoder import BACKENDS, encode, load_encoder

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (the ONNX backends are optional)")

TEXTS = [
    "",
    "Translate the following sentence into Chinese.",
    "public static int add(int a, int b) { return a + b; }\n" * 40,  # longer than 256 tokens: truncated
    "hi",
    "The quick brown fox jumps over the lazy dog, again and again, until it is tired.",
]


@pytest.fixture(scope="module")
def onnx_root(onnx_cache_root) -> str:
    """The export cached between runs, keyed by the versions it depends on (tests/conftest.py):
    a cold cache exports here, a warm one checks the same file again."""
    return onnx_cache_root


def _vectors(backend: str, root: str, batch_size: int) -> np.ndarray:
    model = load_encoder(None, backend=backend, cache_root=None if backend == "torch" else root)
    return np.asarray(model.encode(TEXTS, batch_size=batch_size, convert_to_numpy=True), dtype=np.float32)


@pytest.mark.slow  # the real MiniLM through torch and onnxruntime (an export on a cold cache): seconds
def test_onnx_matches_torch(onnx_root):
    ref = _vectors("torch", onnx_root, 64)
    got = _vectors("onnx", onnx_root, 2)  # other batching: padding must not change a vector
    assert got.shape == ref.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow  # the real MiniLM through torch and onnxruntime: seconds
def test_encode_follows_the_configured_backend(monkeypatch, onnx_root):
    import predictor.encoder as enc

    monkeypatch.setattr(enc, "configured_backend", lambda: "onnx")
    monkeypatch.setattr(enc, "_onnx_cache_root", lambda: onnx_root)
    got = encode(TEXTS[:2])
    assert isinstance(load_encoder(None, backend="onnx"), enc.OnnxSentenceEncoder)
    np.testing.assert_allclose(got, _vectors("torch", onnx_root, 64)[:2], atol=1e-4)


def test_unknown_backend_is_refused():
    assert BACKENDS == ("torch", "onnx")
    with pytest.raises(ValueError):
        load_encoder(None, backend="onnx-int8")  # measured and dropped (quality), see docs
