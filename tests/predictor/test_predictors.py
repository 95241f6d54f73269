"""Train, save, load and predict every predictor kind on small real data (../shared/data)."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from predictor.loading import load_predictor
from predictor.metrics import all_metrics
from predictor.training import fit_predictor, predict_items


@pytest.mark.data
@pytest.mark.parametrize("kind", ["mean", "linear",
                                  pytest.param("magnus", marks=pytest.mark.slow),  # the real MiniLM
                                  "magnus_fast",
                                  pytest.param("semantic", marks=pytest.mark.slow)])
@pytest.mark.slow  # 0.81 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_train_save_load_predict(kind, small_items, emb_cache, tmp_path):
    tr_items, tr_y, va_items, va_y = small_items
    model = fit_predictor(kind, tr_items, tr_y, cache_dir=emb_cache, n_estimators=20, max_iter=30)
    pred = predict_items(model, va_items, emb_cache)
    assert pred.shape == (len(va_items),) and np.all(pred >= 1)
    model.save(tmp_path / kind, meta={"data": "test"})
    again = load_predictor(tmp_path / kind)
    assert again.kind == kind
    # the cached-feature path and the live path (encoder) agree
    np.testing.assert_allclose(again.predict(va_items[:8]), pred[:8], rtol=1e-4)
    m = all_metrics(va_y, pred)
    assert m["n"] == len(va_items) and m["mae"] > 0
    if kind == "linear":
        assert m["pearson"] > 0.5  # input length explains a lot on these tasks


@pytest.mark.data
@pytest.mark.slow  # encodes every train and validation text with the real MiniLM: seconds
def test_magnus_beats_mean(small_items, emb_cache):
    tr_items, tr_y, va_items, va_y = small_items
    mean = fit_predictor("mean", tr_items, tr_y)
    mag = fit_predictor("magnus", tr_items, tr_y, cache_dir=emb_cache, n_estimators=30)
    assert (all_metrics(va_y, predict_items(mag, va_items, emb_cache))["mae"]
            < all_metrics(va_y, mean.predict(va_items))["mae"])


@pytest.mark.data
@pytest.mark.slow  # LoRA training steps on the real MiniLM base: seconds
def test_lora_tiny_run(small_items, tmp_path):
    from predictor.buckets import bucket_index
    from predictor.lora import LoraBucketPredictor

    tr_items, tr_y, va_items, _ = small_items
    model = LoraBucketPredictor(max_length=32, lora_r=4).fit(tr_items, tr_y, max_examples=48, max_steps=4,
                                                             batch_size=8, show_progress=False)
    assert model.train_info["steps"] == 4
    probs = model.predict_proba(va_items[:6])
    assert probs.shape == (6, 9) and np.allclose(probs.sum(1), 1, atol=1e-4)
    pred = model.predict(va_items[:6])
    assert set(pred.tolist()) <= set(model.values.tolist())  # bucket representatives (upper edge)
    model.save(tmp_path / "lora")
    files = {p.name for p in (tmp_path / "lora" / "adapter").iterdir()}
    assert "adapter_model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    again = load_predictor(tmp_path / "lora")
    np.testing.assert_allclose(again.predict_proba(va_items[:6]), probs, atol=1e-4)  # merged == unmerged
    assert (bucket_index(again.predict(va_items[:6])) == probs.argmax(1)).all()


@pytest.mark.data
@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_cli_train_eval_register(data_paths, tmp_path, monkeypatch):
    from cohort import settings as settings_mod
    from predictor.cli import app

    monkeypatch.setenv("COHORT_DATA_DIR", str(tmp_path / "var"))
    settings_mod.get_settings.cache_clear()
    try:
        runner = CliRunner()
        data = [a for p in data_paths for a in ("--data", str(p))]
        r = runner.invoke(app, ["train", "--kind", "linear", *data, "--out", str(tmp_path / "lin"),
                                "--limit-per-file", "100"])
        assert r.exit_code == 0, r.output
        meta = json.loads((tmp_path / "lin" / "meta.json").read_text())
        assert meta["kind"] == "linear" and meta["data"]["rows"] == 300 and meta["version"].startswith("v")
        assert meta["conformal"]["level"] == 0.9 and meta["conformal"]["groups"]["*"] == 90  # 30 per task held out
        out = tmp_path / "eval.json"
        r = runner.invoke(app, ["eval", "--model", str(tmp_path / "lin"), *data, "--json", str(out),
                                "--limit-per-file", "20", "--plot", str(tmp_path / "plots"),
                                "--throughput-n", "32"])
        assert r.exit_code == 0, r.output
        res = json.loads(out.read_text())
        assert set(res["overall"]) == {"n", "mae", "rmse", "pearson", "kendall_tau", "bucket_accuracy",
                                       "acc_within_50", "acc_within_100", "q90_coverage"}
        assert 0.0 <= res["overall"]["q90_coverage"] <= 1.0
        assert all(0.0 <= v["q90_coverage"] <= 1.0 for v in res["per_task"].values())
        assert res["overall"]["n"] == 60 and set(res["per_task"]) == {"mt_zh_en", "td", "ct_java_cs"}
        assert res["predictions_per_s"] > 0
        assert (tmp_path / "plots" / "pred_vs_actual.png").is_file()
        assert (tmp_path / "plots" / "error_cdf.png").is_file()
        r = runner.invoke(app, ["register", "--model", str(tmp_path / "lin")])
        assert r.exit_code == 0, r.output
        v = json.loads(r.output)["version"]
        from predictor.registry import Registry

        assert Registry(tmp_path / "var", "predictor").active() == v
    finally:
        settings_mod.get_settings.cache_clear()


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_lora_on_causal_lm_base(tmp_path):
    """A causal LM base (tiny random Llama saved to disk) gets a score head and q/v LoRA adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cohort.tokenizer import load_tokenizer
    from predictor.base import PredictItem
    from predictor.lora import LoraBucketPredictor

    tok = load_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.sep_token_id)
    base_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    items = [PredictItem("Echo.", "word " * n, n + 2) for n in range(1, 25)]
    y = [n * 3 for n in range(1, 25)]
    model = LoraBucketPredictor(base_model=str(base_dir), max_length=32, representative="mean")
    model.fit(items, y, max_steps=3, batch_size=8, show_progress=False)
    pred = model.predict(items[:5])
    assert pred.shape == (5,) and set(pred.tolist()) <= set(model.values.tolist())
    model.save(tmp_path / "m")
    again = LoraBucketPredictor.load(tmp_path / "m")
    np.testing.assert_allclose(again.predict(items[:5]), pred)
    again.set_representative("upper")
    assert set(again.predict(items[:5]).tolist()) <= {2.0 ** k - 1 for k in range(3, 12)}


@pytest.mark.data
@pytest.mark.slow  # encodes every train and validation text with the real MiniLM: seconds
def test_magnus_vector_cache_identical_predictions(small_items, emb_cache, tmp_path, monkeypatch):
    """Faithful Magnus encodes each distinct instruction / user text once: a repeated request is
    answered from the cache without touching the encoder, with the identical prediction."""
    import predictor.magnus as magnus_mod

    tr_items, tr_y, va_items, _ = small_items
    model = fit_predictor("magnus", tr_items, tr_y, cache_dir=emb_cache, n_estimators=10)
    model.save(tmp_path / "m")
    fresh = load_predictor(tmp_path / "m")
    # load_predictor serves with n_jobs=1 (with -1 the trees' threads add up in any order: 1e-14 noise)
    assert fresh.model.n_jobs == 1
    first = fresh.predict(va_items[:8])
    assert len(fresh._app_cache) == len({it.instruction for it in va_items[:8]})
    assert len(fresh._user_cache) == len({it.user_input for it in va_items[:8]})

    def no_encoder(*args, **kwargs):
        raise AssertionError("the encoder ran for a cached text")

    monkeypatch.setattr(magnus_mod, "encode", no_encoder)
    np.testing.assert_array_equal(fresh.predict(va_items[:8]), first)
    np.testing.assert_array_equal(fresh.predict(va_items[7::-1]), first[::-1])
    # ... and equal to the batch (cached-feature) path used for evaluation
    np.testing.assert_allclose(first, predict_items(model, va_items[:8], emb_cache), rtol=1e-4)
