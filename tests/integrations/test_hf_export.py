"""export_hf: a committed step (saved by the Accelerate helper to SeaweedFS) becomes a folder
that AutoModelForCausalLM.from_pretrained opens, with the same logits as the trained model;
the config comes from the step or from config=; what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

try:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the hf extra is installed by scripts/setup.sh: missing means a broken install
    raise ImportError("transformers/accelerate are not installed; pip install -e '.[test,hf]'") from e

from cloudckpt import AppState, Checkpointer
from cloudckpt.errors import AlreadyExists, ConfigError, IncompatibleCheckpoint
from cloudckpt.integrations.hf_accelerate import AcceleratorCheckpointer
from cloudckpt.integrations.hf_export import export_hf


def _config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=32, **kw)


@pytest.fixture
def trained(s3_bucket, tmp_path):
    """A tiny Llama trained 3 steps, saved as step3 by AcceleratorCheckpointer; (model, step url)."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = LlamaForCausalLM(_config(tie_word_embeddings=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16))
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    folder = s3_bucket + "/acc"
    with AcceleratorCheckpointer(accelerator, folder, model=model, optimizer=optimizer,
                                 work_dir=str(tmp_path / "w")) as c:
        c.save_state(3, {"step": 3})
    return accelerator.unwrap_model(model).eval(), folder + "/step3"


def test_export_hf_folder_opens_with_from_pretrained_and_gives_the_same_logits(trained, tmp_path):
    model, step = trained
    out = tmp_path / "hf"
    result = export_hf(step, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert result["step"] == 3 and result["config"] == str(out / "config.json")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded) is LlamaForCausalLM
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_export_hf_bf16_sets_the_config_dtype_and_loads_as_bf16(trained, tmp_path):
    model, step = trained
    export_hf(step, str(tmp_path / "hf16"), dtype="bfloat16")
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf16"))
    assert loaded.dtype == torch.bfloat16
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(loaded.state_dict()[w], model.state_dict()[w].to(torch.bfloat16))


def test_export_hf_refuses_to_overwrite_and_a_remote_destination(trained, tmp_path):
    _, step = trained
    export_hf(step, str(tmp_path / "hf"))
    with pytest.raises(AlreadyExists, match="model.safetensors"):
        export_hf(step, str(tmp_path / "hf"))
    export_hf(step, str(tmp_path / "hf"), overwrite=True)
    with pytest.raises(ConfigError, match="local folder"):
        export_hf(step, "s3://somewhere/out")


def test_export_hf_of_a_plain_step_needs_config(s3_bucket, tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    step = s3_bucket + "/plain/step1"
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as c:
        c.save(step, AppState(model), {"step": 1})
    with pytest.raises(ConfigError, match="pass config="):
        export_hf(step, str(tmp_path / "a"))
    with pytest.raises(IncompatibleCheckpoint, match="model_type"):
        export_hf(step, str(tmp_path / "b"), config={"hidden_size": 32})
    model.config.save_pretrained(str(tmp_path / "cfg"))
    export_hf(step, str(tmp_path / "c"), config=str(tmp_path / "cfg"))  # a folder holding config.json
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "c")).eval()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
