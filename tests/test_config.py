"""Settings: layer-id presets and parsing, the one layer-id check, and config loading."""

from pathlib import Path

import pytest
import yaml

from streamx.config import RegenerateConfig, RunConfig, check_layer_ids, load_config, resolve_layer_ids


def test_presets_for_qwen3_8b():
    # speculators' EAGLE-3 default [2, L//2, L-3] + L; z-lab DFlash [1, 9, 17, 25, 33] in its numbering, plus one
    assert resolve_layer_ids("eagle3", 36) == [2, 18, 33, 36]
    assert resolve_layer_ids("dflash", 36) == [2, 10, 18, 26, 34, 36]
    assert resolve_layer_ids("eagle3", 4) == [1, 2, 4]  # [2, 2, 1, 4]: ids that meet on a tiny model count once
    assert resolve_layer_ids("eagle3", 2) == [0, 1, 2]  # [2, 1, -1, 2]: clipped to the model's ids
    assert resolve_layer_ids("dflash", 2) == [0, 1, 2]  # [2, 1, 1, 1, 0, 2]


def test_ids_are_parsed_and_sorted():
    assert resolve_layer_ids(" 30, 2,15 ", 30) == [2, 15, 30]


@pytest.mark.parametrize("layers, message", [
    ("2,2,5", r"duplicate layer ids \[2\]"),
    ("2,31", r"layer ids \[31\] out of range: valid ids are 0..30"),
    ("-1", r"layer ids \[-1\] out of range"),
    ("", "--layers is empty"),
    ("two", "--layers must be a preset"),
])
def test_bad_ids_name_the_valid_range(layers, message):
    with pytest.raises(ValueError, match=message):
        resolve_layer_ids(layers, 30)


def test_capture_order_is_checked_not_fixed():
    """Slot j holds ids[j]: code that hands over ids (capture, a store) must give them ascending."""
    assert check_layer_ids([0, 4], 4) == [0, 4]
    with pytest.raises(ValueError, match="ascending without duplicates"):
        check_layer_ids([4, 0], 4)


def test_unknown_field_and_bad_values_are_one_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("token_budgett: 10\n")
    with pytest.raises(ValueError, match="unknown config field.*token_budgett"):
        load_config(config)
    with pytest.raises(ValueError, match=r"--token-budget \(100\) must be >= --max-length \(200\), .*: add "
                                         r"--token-budget 200"):
        load_config(None, token_budget=100, max_length=200)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_the_defaults_are_declared_once_and_the_yaml_spells_them_out():
    """configs/default.yaml holds RunConfig's own defaults (a non-editable install, which has no configs/
    folder, runs with the same settings as --config configs/default.yaml); a value that drifts fails here."""
    path = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
    spelled = yaml.safe_load(path.read_text())
    defaults = RunConfig().to_dict()
    assert spelled and {k: defaults[k] for k in spelled} == spelled
    assert load_config(path) == load_config(None) == RunConfig()


def test_regenerate_settings_are_declared_once_and_the_yaml_spells_them_out():
    path = Path(__file__).resolve().parent.parent / "configs" / "regenerate.yaml"
    spelled = yaml.safe_load(path.read_text())
    defaults = RegenerateConfig().to_dict()
    assert spelled and {k: defaults[k] for k in spelled} == spelled
    assert load_config(path, RegenerateConfig) == RegenerateConfig()
    assert load_config(None, RegenerateConfig, endpoint="http://a:1/v1").endpoint == ["http://a:1/v1"]
    with pytest.raises(ValueError, match="truncated must be one of keep, drop-turn, drop-row"):
        load_config(None, RegenerateConfig, truncated="cut")
    with pytest.raises(ValueError, match="unknown config field"):
        load_config(None, RegenerateConfig, layers="eagle3")  # a run setting
