"""RunPlan: the cheap checks fail in a second, before any weights are read."""

import pytest
from transformers import LlamaConfig

import streamx.plan as plan
from streamx.config import load_config
from streamx.models import ModelNotFoundError
from streamx.store import StoreError


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if anything tries to load a model."""
    calls = []

    def load_model(*args, **kw):
        calls.append(args)
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(plan, "load_model", load_model)
    return calls


@pytest.fixture
def config_only_model(tmp_path):
    """A model folder holding its config.json and nothing else: 6 layers."""
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_missing_data_fails_before_the_model(tmp_path, no_weights):
    cfg = load_config(None, model="Org/not-even-looked-up", data=str(tmp_path / "missing.jsonl"),
                      out=str(tmp_path / "s.zarr"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        plan.make_plan(cfg)
    assert not no_weights


def test_layer_ids_out_of_range_fail_from_the_config_alone(tmp_path, config_only_model, no_weights):
    cfg = load_config(None, model=config_only_model, layers="2,99", out=str(tmp_path / "s.zarr"))
    with pytest.raises(ValueError, match=r"layer ids \[99\] out of range: valid ids are 0..6"):
        plan.make_plan(cfg)
    assert not no_weights


def test_foreign_output_folder_fails_before_the_model(tmp_path, config_only_model, no_weights):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    cfg = load_config(None, model=config_only_model, out=str(tmp_path / "out"))
    with pytest.raises(StoreError, match="exists and is not a streamx store"):
        plan.make_plan(cfg)
    assert not no_weights and (tmp_path / "out" / "notes.txt").exists()


def test_missing_model_is_one_line_and_reads_nothing(tmp_path, no_weights):
    cfg = load_config(None, model=str(tmp_path / "no-model-here"), out=str(tmp_path / "s.zarr"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        plan.make_plan(cfg)
    assert not no_weights
