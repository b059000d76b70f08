"""One model vocabulary: the [model] settings are `TransformerConfig`'s fields that declare their
help, each a flag and a TOML key with the field's help and choices; a setting not given leaves
the preset's value, so every preset comes back unchanged through the config path."""

import dataclasses
import tomllib

import pytest

from meshtrain.cli.main import _train_config
from meshtrain.cli.parsers import build_parser
from meshtrain.config import run_config
from meshtrain.config.run_config import build_config
from meshtrain.config.settings import CONFIG_SETTINGS, ModelSettings
from meshtrain.errors import Code, SettingError
from meshtrain.models import PRESETS, TransformerConfig, preset

CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(TransformerConfig)}


def _model(*words: str, vocab_size: int = 256) -> TransformerConfig:
    return _train_config(build_parser().parse_args(["train", *words])).model_config(vocab_size)


def test_the_model_settings_are_the_config_fields_that_declare_their_help():
    settings = {f.name: f for f in dataclasses.fields(ModelSettings)}
    assert list(settings) == ["model", *CONFIG_SETTINGS, "model_arg"]
    assert {"num_layers", "dropout", "attention", "moe_experts", "moe_z_loss_coef"} \
        <= set(CONFIG_SETTINGS)
    for name in CONFIG_SETTINGS:
        declared, setting = CONFIG_FIELDS[name].metadata, settings[name]
        assert setting.default is None  # unset: the preset's value stands
        assert setting.metadata["help"].startswith(declared["help"] + " (default: ")
        assert setting.metadata["choices"] == declared["choices"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_comes_back_unchanged_without_model_flags(name):
    base = PRESETS[name]
    seq_len = str(min(64, base.max_seq_len))
    assert _model("--model", name, "--seq-len", seq_len, vocab_size=base.vocab_size) == base
    assert build_config({"model": {"model": name}, "train": {"seq_len": int(seq_len)}},
                        {}).model_config(base.vocab_size) == base


@pytest.fixture
def moe_preset(monkeypatch):
    """A preset that sets what no built-in one does: experts, routing, dropout, the kernel."""
    cfg = preset("tiny", moe_experts=4, moe_top_k=2, moe_every=2, moe_capacity_factor=2.0,
                 moe_aux_loss_coef=0.02, moe_z_loss_coef=1e-3, dropout=0.1, attention="eager")
    monkeypatch.setitem(PRESETS, "moe-tiny", cfg)
    return cfg


def test_a_preset_with_experts_keeps_them_without_flags_and_config_toml_reproduces_it(
        moe_preset):
    model = _model("--model", "moe-tiny", vocab_size=moe_preset.vocab_size)
    assert model == moe_preset
    assert _model("--model", "moe-tiny", "--moe-top-k", "1", "--dropout", "0",
                  vocab_size=moe_preset.vocab_size) \
        == dataclasses.replace(moe_preset, moe_top_k=1, dropout=0.0)
    cfg = build_config({"model": {"model": "moe-tiny"}}, {})
    saved = tomllib.loads(cfg.resolved(model, cfg.plan.resolved(2)).to_toml())
    assert saved["model"]["moe_experts"] == 4 and saved["model"]["attention"] == "eager"
    assert build_config(saved, {}).model_config(1) == model  # the run's own vocabulary


def test_a_config_toml_written_before_model_settings_were_unset_loads_the_same_model():
    """Runs used to write every model setting's default: explicit values, the same model."""
    old = tomllib.loads('[model]\nmodel = "llama-tiny"\nnum_layers = 3\nvocab_size = 256\n'
                        'max_seq_len = 256\ndropout = 0.0\nattention = "sdpa"\n'
                        'moe_experts = 0\nmoe_top_k = 1\nmoe_every = 1\n'
                        'moe_capacity_factor = 1.25\nmoe_aux_loss_coef = 0.01\n'
                        'moe_z_loss_coef = 0.0\n')
    assert build_config(old, {}).model_config(256) \
        == preset("llama-tiny", num_layers=3, vocab_size=256, max_seq_len=256)


def test_model_arg_sets_a_setting_once_and_refuses_it_twice():
    assert _model("--model-arg", "dropout=0.1").dropout == 0.1  # given once: set
    config = _model("--model-arg", "vocab_size=300", "--model-arg", "max_seq_len=512")
    assert (config.vocab_size, config.max_seq_len) == (300, 512)  # not the run's defaults
    for words in (["--dropout", "0.1", "--model-arg", "dropout=0.2"],
                  ["--model-arg", "dropout=0.1", "--model-arg", "dropout=0.2"]):
        with pytest.raises(SettingError, match="`model_arg` dropout is given twice") as refused:
            _model(*words)
        assert refused.value.code is Code.GIVEN_TWICE
        assert ("as `dropout` too" in str(refused.value)) == (words[0] == "--dropout")


@pytest.mark.parametrize("text", ["inf", "-inf", "nan"])
def test_model_arg_refuses_a_value_that_is_not_finite(text):
    with pytest.raises(SettingError, match=f"`model_arg` rope_theta must be a finite number,"
                                           f" got '{text}'") as refused:
        _model("--model", "llama-tiny", "--model-arg", f"rope_theta={text}")
    assert refused.value.code is Code.RANGE


def test_config_toml_keeps_what_model_arg_set_in_model_arg():
    cfg = build_config({"model": {"model": "llama-tiny", "model_arg": ["num_layers=3"]}}, {})
    model = cfg.model_config(256)
    saved = tomllib.loads(cfg.resolved(model, cfg.plan.resolved(1)).to_toml())
    assert "num_layers" not in saved["model"] and saved["model"]["model_arg"] == ["num_layers=3"]
    assert build_config(saved, {}).model_config(256) == model


def test_init_from_keeps_the_checkpoints_settings_unless_given(monkeypatch, moe_preset):
    saved = dataclasses.replace(moe_preset, vocab_size=256)
    monkeypatch.setattr(run_config, "saved_model", lambda path, **_: saved)
    cfg = build_config({"checkpoint": {"init_from": "/nonexistent/run"}}, {})
    assert cfg.model_config(256) == saved
    cfg.model.dropout, cfg.model.moe_top_k = 0.0, 1
    assert cfg.model_config(256) == dataclasses.replace(saved, dropout=0.0, moe_top_k=1)
    cfg.model.moe_experts = 2
    with pytest.raises(ValueError, match="`moe_experts` 2 would change the moe_experts"):
        cfg.model_config(256)


@pytest.mark.parametrize("given", [["--vocab-size", "100"], ["--model-arg", "vocab_size=100"]])
def test_a_vocabulary_smaller_than_the_datas_is_refused_as_the_setting(given, corpus, tmp_path,
                                                                      capsys):
    from meshtrain.cli.main import main

    assert main(["train", *given, "--data", corpus, "--out", str(tmp_path / "run")]) == 2
    assert "error: --vocab-size 100 is smaller than the data's vocabulary" \
        in capsys.readouterr().err


@pytest.mark.parametrize("saved, flags, expected", [
    ({"dropout": 0.0, "attention": "sdpa"}, ["--model-arg", "dropout=0.1"],
     {"dropout": 0.1}),  # a config.toml of before: every setting written
    ({"model_arg": ["dropout=0.1", "rope_theta=1e6"]}, ["--dropout", "0.2"],
     {"dropout": 0.2, "rope_theta": 1e6}),
    ({"model_arg": ["dropout=0.1"]}, ["--model-arg", "dropout=0.1"], {"dropout": 0.1})],
    ids=["old-key-then-model-arg", "model-arg-then-flag", "same-command"])
def test_a_resume_sets_each_model_setting_once(monkeypatch, saved, flags, expected):
    """What the command gives replaces the saved value of the same setting, whether either
    came as its key or in `model_arg`."""
    from meshtrain.checkpointing import resuming

    tables = {"model": {"model": "llama-tiny", "vocab_size": 256} | saved}
    monkeypatch.setattr(resuming, "saved_settings", lambda out: tables)
    config = _model("--out", "/nonexistent/run", "--resume", *flags)
    assert {name: getattr(config, name) for name in expected} == expected
