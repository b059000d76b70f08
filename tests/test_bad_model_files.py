"""Model files that cannot be used are refused before any work, in one line naming the file and
the fix, exit 2: Hugging Face directories whose config.json, index or safetensors files are
absurd, damaged or not the model the config describes (`import-hf`, `load_model`), and
meshtrain checkpoints whose metadata disagrees with their tensors or with itself (export, sample,
`--resume`, `--init-from`). Tiny models are built offline from transformers configs."""

import dataclasses
import hashlib
import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import meshtrain
from meshtrain import ParallelMesh, preset
from meshtrain.cli.main import main
from meshtrain.errors import Code, SettingError
from meshtrain.parallelize import build_model

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "gpt2": transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2,
                                    n_head=4, bos_token_id=None, eos_token_id=None),
    "llama": transformers.LlamaConfig(**SMALL),
    "mistral": transformers.MistralConfig(**SMALL, sliding_window=8),
}
SHARD = "model-00002-of-00007.safetensors"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    """Each family saved by transformers, plus the Llama in 7 shards with an index."""
    root, paths = tmp_path_factory.mktemp("hf"), {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(root / name)
        paths[name] = root / name
        if name == "llama":
            model.save_pretrained(root / "sharded", max_shard_size="20KB")
            paths["sharded"] = root / "sharded"
    assert (paths["sharded"] / SHARD).is_file()
    return paths


def _one_line(capsys, argv: list[str]) -> str:
    """The command's only stderr line, after it exits 2 (a refused input)."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("meshtrain: error: "), err
    return err


def _config(**fields):
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        for key, value in fields.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (d / "config.json").write_text(json.dumps(config))
    return edit


def _write(name: str, data: bytes | str):
    def edit(d: Path) -> None:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return edit


def _index(edit_map):
    def edit(d: Path) -> None:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        edit_map(index)
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


def _bytes(edit_bytes, name: str = "model.safetensors"):
    def edit(d: Path) -> None:
        (d / name).write_bytes(edit_bytes((d / name).read_bytes()))
    return edit


def _tensors(**replaced):
    """model.safetensors with tensors replaced (None: removed)."""
    def edit(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        for key, value in replaced.items():
            key = key.replace("__", ".")
            if value is None:
                del tensors[key]
            else:
                tensors[key] = value
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return edit


def _garbage_header(data: bytes) -> bytes:
    length = struct.unpack("<Q", data[:8])[0]
    return data[:8] + b"\xff" * length + data[8 + length:]


def _first_key(index: dict, file: str) -> None:
    index["weight_map"][next(iter(index["weight_map"]))] = file


NORM = "model__norm__weight"
HF_CASES = {  # case: (base directory, damage, what the one line names)
    # config.json
    "hidden-string": ("llama", _config(hidden_size="32"),
                      "config.json \"hidden_size\": '32' is not a positive integer"),
    "hidden-fraction": ("llama", _config(hidden_size=32.0), '"hidden_size": 32.0 is not a'),
    "hidden-negative": ("llama", _config(hidden_size=-32), '"hidden_size": -32 is not a'),
    "heads-zero": ("llama", _config(num_attention_heads=0), '"num_attention_heads": 0 is not'),
    "layers-zero": ("llama", _config(num_hidden_layers=0), '"num_hidden_layers": 0 is not'),
    "layers-billion": ("llama", _config(num_hidden_layers=10**9),
                       "describes 1,000,000,000 layers, its safetensors files hold 21 tensors"),
    "vocab-beyond-int64": ("llama", _config(vocab_size=2**64),
                           "makes meshtrain's embedding.word.weight [18446744073709551616, 32],"
                           " more than its safetensors files hold altogether (34,976 numbers)"),
    "theta-beyond-float": ("llama", _config(rope_parameters={"rope_type": "default",
                                                              "rope_theta": 10**400}),
                           '"rope_theta": 1000000000000000000000000000000000000... is not'),
    "vocab-list": ("llama", _config(vocab_size=[256]), '"vocab_size": [256] is not a'),
    "intermediate-zero": ("llama", _config(intermediate_size=0), '"intermediate_size": 0 is'),
    "kv-heads-zero": ("llama", _config(num_key_value_heads=0), '"num_key_value_heads": 0 is'),
    "heads-not-dividing-hidden": ("llama", _config(num_attention_heads=5, head_dim=None),
                                  '"num_attention_heads" 5 does not divide "hidden_size" 32'),
    "kv-heads-not-dividing": ("llama", _config(num_key_value_heads=3),
                              '"num_key_value_heads" 3 does not divide "num_attention_heads" 4'),
    "eps-nan": ("llama", _config(rms_norm_eps=math.nan), '"rms_norm_eps": nan is not a finite'),
    "rope-list": ("llama", _config(rope_parameters=[1]), '"rope_parameters": [1] is not an'),
    "tie-string": ("llama", _config(tie_word_embeddings="yes"), '"tie_word_embeddings": \'yes\''),
    "window-string": ("mistral", _config(sliding_window="x"), '"sliding_window": \'x\' is not'),
    "gpt2-inner-zero": ("gpt2", _config(n_inner=0), '"n_inner": 0 is not a positive integer'),
    "gpt2-heads-string": ("gpt2", _config(n_head="4"), '"n_head": \'4\' is not a positive'),
    "missing-hidden": ("llama", _config(hidden_size=None), 'config.json has no "hidden_size"'),
    "unknown-model-type": ("llama", _config(architectures=None, model_type="gemma"),
                           "config.json \"architectures\": 'gemma' cannot be imported"),
    "architectures-string": ("llama", _config(architectures="LlamaForCausalLM"),
                             '"architectures": \'LlamaForCausalLM\' is not a list'),
    "config-not-json": ("llama", _write("config.json", "{oops"), "config.json is not JSON"),
    "config-a-list": ("llama", _write("config.json", "[1, 2]"),
                      "config.json holds an array, not a JSON object"),
    "config-nested": ("llama", _write("config.json", "[" * 100_000 + "]" * 100_000),
                      r"config.json is not JSON (nested too deeply)"),
    # the index and the files
    "shard-missing": ("sharded", _index(lambda i: _first_key(i, "nope.safetensors")),
                      "model.safetensors.index.json lists nope.safetensors, which is not there"),
    "shard-escaping": ("sharded", _index(lambda i: _first_key(i, "../llama/model.safetensors")),
                       "names '../llama/model.safetensors' for lm_head.weight, not a file"),
    "index-not-json": ("sharded", _write("model.safetensors.index.json", "{oops"),
                       "model.safetensors.index.json is not JSON"),
    "index-without-map": ("sharded", _index(lambda i: i.pop("weight_map")),
                          'model.safetensors.index.json has no "weight_map"'),
    "shard-truncated": ("sharded", _bytes(lambda b: b[:200], SHARD),
                        f"{SHARD} is not a readable safetensors file"),
    "header-garbage": ("llama", _bytes(_garbage_header),
                       "model.safetensors is not a readable safetensors file"),
    "data-truncated": ("llama", _bytes(lambda b: b[:-100]), "file not fully covered"),
    # tensors against config.json
    "shape-wrong": ("llama", _tensors(model__layers__0__mlp__down_proj__weight=torch.zeros(32, 63)),
                    "model.layers.0.mlp.down_proj.weight (model.safetensors) has shape [32, 63],"
                    " config.json's LlamaForCausalLM needs [32, 64]"),
    "gpt2-shape-transposed": ("gpt2", _tensors(transformer__h__0__attn__c_attn__weight=torch.zeros(
        96, 32)), "transformer.h.0.attn.c_attn.weight (model.safetensors) has shape [96, 32]"),
    "tensor-missing": ("llama", _tensors(model__layers__1__mlp__up_proj__weight=None),
                       "its safetensors files have no model.layers.1.mlp.up_proj.weight"),
    "dtype-int": ("llama", _tensors(**{NORM: torch.ones(32, dtype=torch.int32)}),
                  "model.norm.weight (model.safetensors) is I32, not a float dtype"),
    "dtype-bool": ("llama", _tensors(**{NORM: torch.ones(32, dtype=torch.bool)}), "is BOOL"),
    "dtype-fp8": ("llama", _tensors(**{NORM: torch.ones(32).to(torch.float8_e4m3fn)}),
                  "is F8_E4M3, not a float dtype meshtrain imports"),
    "dtypes-mixed-in-one-tensor": ("llama", _tensors(
        model__layers__0__self_attn__k_proj__weight=torch.zeros(16, 32, dtype=torch.float16)),
        "k_proj.weight, model.layers.0.self_attn.v_proj.weight have different dtypes"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_import_refuses_a_bad_directory_in_one_line(case, hf, tmp_path, capsys):
    base, damage, named = HF_CASES[case]
    source = Path(shutil.copytree(hf[base], tmp_path / "hf"))
    damage(source)
    line = _one_line(capsys, ["import-hf", str(source), "--out", str(tmp_path / "run")])
    assert str(source) in line and named in line, line
    assert not (tmp_path / "run").exists()


def test_load_model_refuses_before_building(hf, tmp_path, monkeypatch):
    """The Python API opens the same checks, with the code of the kind of problem."""
    source = Path(shutil.copytree(hf["llama"], tmp_path / "hf"))
    _tensors(**{NORM: torch.ones(32, dtype=torch.int32)})(source)
    monkeypatch.setattr("meshtrain.inference.dense.build_model", None)  # never reached
    with pytest.raises(SettingError) as refused:
        meshtrain.load_model(source)
    assert refused.value.code is Code.HF_WEIGHTS
    _config(hidden_size="32")(source)
    with pytest.raises(SettingError) as refused:
        meshtrain.load_model(source)
    assert refused.value.code is Code.HF_CONFIG


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "qwen2-tiny", "llama-moe"])
def test_parameter_shapes_are_the_built_models(name):
    """What checkpoints and imports are checked against is what the family builds."""
    cfg = dataclasses.replace(preset("llama-tiny"), moe_experts=4, moe_every=2,
                              tie_word_embeddings=True) if name == "llama-moe" else preset(name)
    model = build_model(cfg, ParallelMesh.local())
    assert cfg.parameter_shapes() == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sum(map(math.prod, cfg.parameter_shapes().values())) == cfg.num_parameters()


@pytest.mark.parametrize("field", ["num_kv_heads", "ffn_hidden_size"])
def test_a_zero_width_is_not_the_default(field):
    with pytest.raises(SettingError, match=f"`{field}` must be positive"):
        preset("llama-tiny", **{field: 0})


TRAIN = ["--device", "cpu", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "2",
         "--steps", "2", "--save-every", "1", "--eval-every", "0"]


@pytest.fixture(scope="module")
def made_run(corpus, tmp_path_factory) -> Path:
    """A tiny GPT run stopped after step 1, in this process."""
    run = tmp_path_factory.mktemp("made") / "run"
    assert main(["train", *TRAIN, "--stop-at", "1", "--data", corpus, "--out", str(run)]) == 0
    return run


def _recommit(ck: Path, name: str) -> None:
    """digests.json updated for `name`, as an editor covering their tracks would."""
    record = json.loads((ck / "digests.json").read_text())
    record["files"][name] = hashlib.sha256((ck / name).read_bytes()).hexdigest()
    (ck / "digests.json").write_text(json.dumps(record))


def _edited(name: str, edit):
    """The JSON file's value changed in place by `edit`, committed."""
    def damage(ck: Path) -> None:
        value = json.loads((ck / name).read_text())
        edit(value)
        _replaced(name, lambda _: json.dumps(value))(ck)
    return damage


def _replaced(name: str, text_of):
    """The file's text replaced by `text_of(its text)`, committed."""
    def damage(ck: Path) -> None:
        (ck / name).write_text(text_of((ck / name).read_text()))
        _recommit(ck, name)
    return damage


def _vocabulary_for_positions(manifest: dict) -> None:
    manifest["model"]["vocab_size"] += 1  # the same parameter count, other shapes
    manifest["model"]["max_seq_len"] -= 1


MANIFEST = "manifest.json"
CHECKPOINT_CASES = {  # case: (damage to the checkpoint, what the one line names)
    "hidden-narrower-than-tensors": (
        _edited(MANIFEST, lambda m: m["model"].update(hidden_size=32)),
        "manifest.json: its model settings make 67264 parameters, its model tensors hold"
        " 232832"),
    "vocabulary-for-positions": (
        _edited(MANIFEST, _vocabulary_for_positions),
        "manifest.json: model/embedding.word.weight has shape [256, 64], but its model settings"
        " make embedding.word.weight [257, 64]"),
    "step-disagrees": (_edited("train_state.json", lambda s: s.update(step=0)),
                       "train_state.json: is at step 0, manifest.json at 1"),
    "loss-scale-infinite": (
        _edited("train_state.json", lambda s: s.update(loss_scaler={"scale": math.inf,
                                                                    "clean_steps": 0})),
        "train_state.json: its loss_scaler {'scale': inf, 'clean_steps': 0} is not a finite"),
    "manifest-truncated": (_replaced(MANIFEST, lambda text: text[:100]),
                           "manifest.json: not valid JSON"),
    "manifest-nested": (_replaced(MANIFEST, lambda _: "[" * 100_000 + "]" * 100_000),
                        "manifest.json: not valid JSON (nested too deeply)"),
    "config-truncated": (_replaced("config.toml", lambda text: text[:30]),
                         "config.toml: not valid TOML"),
    "layout-not-degrees": (_edited(MANIFEST, lambda m: m["layout"].update(tp="x")),
                           "manifest.json: its layout"),
}


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_inconsistent_checkpoint_is_refused_in_one_line(case, made_run, corpus, tmp_path,
                                                        capsys):
    damage, named = CHECKPOINT_CASES[case]
    run = Path(shutil.copytree(made_run, tmp_path / "run"))
    checkpoint = run / "checkpoints" / "step_00000001"
    damage(checkpoint)
    commands = [["export", str(run), "--out", str(tmp_path / "m.safetensors")],
                ["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")],
                ["sample", str(run), "--device", "cpu"],
                ["train", *TRAIN, "--data", corpus, "--out", str(run), "--resume"],
                ["train", *TRAIN, "--data", corpus, "--out", str(tmp_path / "new"),
                 "--init-from", str(run)]]
    for argv in commands:
        line = _one_line(capsys, argv)
        assert f"checkpoint {checkpoint}: {named}" in line, line
        assert line.rstrip().endswith("restore it or use an earlier one"), line
    assert {p.name for p in tmp_path.iterdir()} == {"run"}  # nothing written


def test_an_import_larger_than_the_free_memory_is_refused_before_writing(hf, tmp_path, capsys,
                                                                          monkeypatch):
    """It streams a tensor at a time: two copies of the largest must fit MemAvailable."""
    monkeypatch.setattr("meshtrain.machine_fit.available_host_bytes", lambda: 2 * 32 * 256 * 4 - 1)
    line = _one_line(capsys, ["import-hf", str(hf["llama"]), "--out", str(tmp_path / "run")])
    assert f"importing {hf['llama']} holds two copies of its largest tensor" in line, line
    assert "[256, 32]: 0.0 GiB, more than the 0.0 GiB available (MemAvailable)" in line, line
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr("meshtrain.machine_fit.available_host_bytes", lambda: 2 * 32 * 256 * 4)
    assert main(["import-hf", str(hf["llama"]), "--out", str(tmp_path / "run")]) == 0
