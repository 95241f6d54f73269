"""OpenAI's sampling defaults (temperature 1, top_p 1), a model's generation config over them,
the native endpoint's own greedy default, and ignore_eos as a sampling parameter."""

from __future__ import annotations

import json

from cohort.sampling_defaults import OPENAI_DEFAULTS, sampling_defaults
from gateway.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest


def test_a_model_without_generation_config_gets_openais_defaults(tmp_path):
    d = sampling_defaults(str(tmp_path))
    assert d.values == OPENAI_DEFAULTS and d.source == "openai"
    assert sampling_defaults("cohort/tiny-random-llama").card() == {"temperature": 1.0, "top_p": 1.0,
                                                                    "source": "openai"}


def test_generation_config_overrides_what_it_sets_and_bad_values_are_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 50.0, "do_sample": True}))
    d = sampling_defaults(str(tmp_path))
    assert d.source == "generation_config"
    assert d.values == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}  # 50 is outside [0.01, 10]


def test_left_out_fields_take_the_defaults_and_sent_ones_win():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling().temperature == 1.0 and chat.sampling().top_p == 1.0
    sp = chat.sampling(defaults)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.9, 20)
    sent = CompletionRequest(prompt="hi", temperature=0, top_p=0.5, top_k=-1).sampling(defaults)
    assert (sent.temperature, sent.top_p, sent.top_k) == (0.0, 0.5, 0)
    assert sent.greedy and not chat.sampling().greedy


def test_native_endpoint_keeps_its_greedy_default():
    assert GenerateRequest(input="hi").sampling().greedy


def test_ignore_eos_reaches_the_worker_as_a_sampling_parameter():
    assert CompletionRequest(prompt="hi", ignore_eos=True).sampling().ignore_eos
    assert not CompletionRequest(prompt="hi").sampling().ignore_eos
