"""UELLM length predictor: a pretrained model + LoRA adapter (peft) fine-tuned as a bucket classifier.

The paper fine-tunes ChatGLM3-6B; here the base is any HF path that
``AutoModelForSequenceClassification`` can load (BERT-style encoders, Llama/Qwen causal LMs get a
``score`` head). The default is the bundled all-MiniLM-L6-v2 (a 6-layer BERT), small enough to
fine-tune on a 2-core CPU in minutes. Only the adapter and the classification head are trained
and saved (peft ``save_pretrained``: safetensors, never pickle); the base is loaded from its path.

Input text = optional length hint + instruction + user input. The hint ("input tokens: N") is
on by default: the classifier truncates long inputs (``max_length``), and without it a long code
file and a short one look alike after truncation, yet input length is the strongest signal for
output length on most applications (Magnus, table I).

Predicted length = the bucket's representative (upper edge by default, see ``buckets``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from predictor.base import META_FILE, PredictItem
from predictor.buckets import DEFAULT_EDGES, bucket_index, bucket_values, n_buckets
from predictor.encoder import default_encoder_path

ADAPTER_DIR = "adapter"


def _default_base() -> str:
    return default_encoder_path()


class LoraBucketPredictor:
    """Bucket classifier with a LoRA adapter. ``fit`` trains, ``predict`` returns representatives."""

    kind = "lora"

    def __init__(self, base_model: str | None = None, edges: Sequence[int] = DEFAULT_EDGES,
                 representative: str = "upper", max_length: int = 128, lora_r: int = 8,
                 lora_alpha: int = 16, lora_dropout: float = 0.1,
                 target_modules: Sequence[str] | None = None, length_hint: bool = True,
                 threads: int | None = None) -> None:
        self.base_model = base_model  # None = the bundled MiniLM (kept None in meta: portable)
        self.edges = tuple(int(e) for e in edges)
        self.representative = representative
        self.max_length = int(max_length)
        self.lora_r, self.lora_alpha, self.lora_dropout = int(lora_r), int(lora_alpha), float(lora_dropout)
        self.target_modules = list(target_modules) if target_modules else None
        self.length_hint = bool(length_hint)
        self.threads = threads
        self.values = bucket_values(self.edges, representative)
        self.bucket_means: list[float] | None = None  # mean training length per bucket
        self.model = None
        self.tokenizer = None
        self.train_info: dict = {}

    # --- model plumbing ---------------------------------------------------------------------
    @property
    def base_path(self) -> str:
        return self.base_model or _default_base()

    def _torch(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch  # the LoRA classifier is the only predictor that runs torch itself: loaded on use

        if self.threads:
            torch.set_num_threads(int(self.threads))
        return torch

    def _load_base(self):
        # transformers / peft (seconds to import): only when the UELLM classifier is used
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self._torch()
        tok = AutoTokenizer.from_pretrained(self.base_path)
        if tok.pad_token is None:  # causal LMs: pad with EOS, the head reads the last real token
            tok.pad_token = tok.eos_token
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "newly initialized classifier" is expected here
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                self.base_path, num_labels=n_buckets(self.edges))
        finally:
            hf_logging.set_verbosity(verbosity)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tok.pad_token_id
        return tok, model

    def _texts(self, items: Sequence[PredictItem]) -> list[str]:
        out = []
        for it in items:
            head = f"input tokens: {it.input_tokens}. " if self.length_hint else ""
            out.append(f"{head}{it.instruction}\n{it.user_input}".strip())
        return out

    def _batches(self, texts: list[str], batch_size: int):
        """Tokenized batches in length order (little padding); yields (indices, encoding)."""
        enc_all = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        order = np.argsort([len(e) for e in enc_all], kind="stable")
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            feats = [{"input_ids": enc_all[j]} for j in idx]
            yield idx, self.tokenizer.pad(feats, return_tensors="pt")

    # --- training -------------------------------------------------------------------------------
    def fit(self, items: Sequence[PredictItem], targets: Sequence[float], epochs: float = 1.0,
            batch_size: int = 16, lr: float = 1e-3, max_examples: int | None = None,
            max_steps: int | None = None, seed: int = 0, show_progress: bool = True
            ) -> LoraBucketPredictor:
        """Fine-tune adapter + head with cross-entropy on bucket labels.

        ``max_examples`` subsamples (seeded) and ``max_steps`` caps optimizer steps, so the
        training time on a CPU is bounded whatever the data size.
        """
        from peft import LoraConfig, TaskType, get_peft_model  # see _load_base

        torch = self._torch()
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        items = list(items)
        lengths = np.asarray(targets, dtype=float)
        y = bucket_index(lengths, self.edges)
        self.bucket_means = bucket_values(self.edges, "mean", lengths).tolist()
        if self.representative == "mean":
            self.values = np.asarray(self.bucket_means)
        if max_examples is not None and len(items) > max_examples:
            pick = rng.choice(len(items), max_examples, replace=False)
            items, y = [items[i] for i in pick], y[pick]
        self.tokenizer, base = self._load_base()
        cfg = LoraConfig(task_type=TaskType.SEQ_CLS, r=self.lora_r, lora_alpha=self.lora_alpha,
                         lora_dropout=self.lora_dropout, target_modules=self.target_modules)
        model = get_peft_model(base, cfg)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                weight_decay=0.01)
        texts = self._texts(items)
        enc_all = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        steps_per_epoch = max(1, int(np.ceil(len(texts) / batch_size)))
        total = int(np.ceil(steps_per_epoch * epochs))
        if max_steps is not None:
            total = min(total, int(max_steps))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / max(1, total // 10)) * max(0.0, 1 - s / max(1, total)))
        labels = torch.tensor(y, dtype=torch.long)
        t0 = time.perf_counter()
        step, losses = 0, []
        bar = tqdm(total=total, desc="lora fine-tune", disable=not show_progress)
        while step < total:
            perm = rng.permutation(len(texts))
            # group similar lengths into a batch (less padding), then shuffle the batch order
            chunks = [perm[i:i + batch_size * 32] for i in range(0, len(perm), batch_size * 32)]
            batches = []
            for ch in chunks:
                ch = sorted(ch, key=lambda j: len(enc_all[j]))
                batches += [ch[i:i + batch_size] for i in range(0, len(ch), batch_size)]
            rng.shuffle(batches)
            for idx in batches:
                if step >= total:
                    break
                enc = self.tokenizer.pad([{"input_ids": enc_all[j]} for j in idx], return_tensors="pt")
                out = model(**enc, labels=labels[list(idx)])
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(float(out.loss.detach()))
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        bar.close()
        model.eval()
        self.model = model
        self.train_info = {"examples": len(texts), "steps": step, "batch_size": batch_size, "lr": lr,
                           "train_seconds": round(time.perf_counter() - t0, 1),
                           "final_loss": float(np.mean(losses[-20:])) if losses else None}
        return self

    # --- inference ------------------------------------------------------------------------------
    def predict_proba(self, items: Sequence[PredictItem], batch_size: int = 64) -> np.ndarray:
        """Bucket probabilities, one row per item."""
        torch = self._torch()
        if self.model is None:
            raise RuntimeError("model is not trained or loaded")
        out = np.zeros((len(items), n_buckets(self.edges)), dtype=np.float32)
        if not items:
            return out
        with torch.inference_mode():
            for idx, enc in self._batches(self._texts(items), batch_size):
                logits = self.model(**enc).logits
                out[idx] = torch.softmax(logits.float(), dim=-1).numpy()
        return out

    def set_representative(self, representative: str) -> None:
        """Report another bucket representative (e.g. to compare upper edge vs bucket mean)."""
        if representative == "mean" and self.bucket_means:
            self.values = np.asarray(self.bucket_means, dtype=float)
        else:
            self.values = bucket_values(self.edges, representative)
        self.representative = representative

    def predict_buckets(self, items: Sequence[PredictItem]) -> np.ndarray:
        return self.predict_proba(items).argmax(axis=1)

    def predict(self, items: Sequence[PredictItem]) -> np.ndarray:
        if not items:
            return np.zeros(0)
        return self.values[self.predict_buckets(items)].astype(float)

    # --- persistence ----------------------------------------------------------------------------
    def _meta(self) -> dict:
        return {"kind": self.kind, "base_model": self.base_model, "edges": list(self.edges),
                "representative": self.representative, "bucket_values": self.values.tolist(),
                "bucket_means": self.bucket_means,
                "max_length": self.max_length, "lora_r": self.lora_r, "lora_alpha": self.lora_alpha,
                "lora_dropout": self.lora_dropout, "target_modules": self.target_modules,
                "length_hint": self.length_hint, "train": self.train_info}

    def save(self, directory: Path, meta: dict | None = None) -> None:
        """Adapter + head via peft ``save_pretrained`` (safetensors) and meta.json."""
        if self.model is None:
            raise RuntimeError("nothing to save: model is not trained")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(directory / ADAPTER_DIR), safe_serialization=True)
        (directory / META_FILE).write_text(json.dumps({**self._meta(), **(meta or {})}, indent=2,
                                                      default=str))

    @classmethod
    def load(cls, directory: Path, merge: bool = True, threads: int | None = None) -> LoraBucketPredictor:
        """Base from its path + the saved adapter; merged into the base for faster inference."""
        from peft import PeftModel  # see _load_base

        directory = Path(directory)
        meta = json.loads((directory / META_FILE).read_text())
        self = cls(base_model=meta.get("base_model"), edges=meta["edges"],
                   representative=meta.get("representative", "upper"),
                   max_length=meta.get("max_length", 128), lora_r=meta.get("lora_r", 8),
                   lora_alpha=meta.get("lora_alpha", 16), lora_dropout=meta.get("lora_dropout", 0.1),
                   target_modules=meta.get("target_modules"), length_hint=meta.get("length_hint", True),
                   threads=threads)
        if meta.get("bucket_values"):
            self.values = np.asarray(meta["bucket_values"], dtype=float)
        self.bucket_means = meta.get("bucket_means")
        self.train_info = meta.get("train", {})
        self.tokenizer, base = self._load_base()
        model = PeftModel.from_pretrained(base, str(directory / ADAPTER_DIR), is_trainable=False)
        if merge:
            model = model.merge_and_unload()
        model.eval()
        self.model = model
        return self
