import json

import pytest

from engine_lib.errors import ConfigError
from engine_lib.model.checkpoints import REAL_CONFIG, preset_config
from engine_lib.model.config import Qwen2Config


def test_real_config_parameter_count():
    cfg = Qwen2Config.from_json(REAL_CONFIG)
    assert cfg.num_parameters() == 1_543_714_304
    assert (cfg.head_dim, cfg.num_kv_groups) == (128, 6)


def test_matches_transformers_parameter_count():
    import torch
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    cfg = preset_config("tiny")
    with torch.device("meta"):
        hf = Qwen2ForCausalLM(HFConfig(**cfg.to_hf_dict()))
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 7}, "does not divide hidden_size"),
    ({"num_key_value_heads": 5}, "does not divide num_attention_heads"),
    ({"use_sliding_window": True}, "sliding"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama"}, "model_type"),
    ({"num_hidden_layers": 0}, "positive integer"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
])
def test_bad_configs_raise_clear_errors(tmp_path, change, message):
    raw = json.loads(REAL_CONFIG.read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        Qwen2Config.from_json(tmp_path)


def test_missing_and_invalid_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Qwen2Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Qwen2Config.from_json(tmp_path)
