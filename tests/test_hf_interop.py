"""Hugging Face interop against transformers itself: import and export (bitwise round trips,
sharded files, refused configs), logits at tp 1, tp 2 and pp 2, greedy generation, and training
from an imported model at other layouts. Tiny random models are built offline from configs."""

import dataclasses
import json
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from harness import run_cli, run_on_ranks, worker_mesh
from hf_models import (
    IDS,
    TINY,
    assert_import_refused,
    greedy_of_transformers,
    imported_fixture,
    logits_at,
    max_difference,
    reference,
    save_models,
    train_and_export,
)
from safetensors.torch import load_file, save_file

import meshtrain
from meshtrain.checkpointing.checkpoint import (
    checkpoint_config,
    load_checkpoint,
    resolve_checkpoint,
)
from meshtrain.cli.main import _train_config, check_train, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config
from meshtrain.data.corpus import BatchSampler, load_corpus, split_tokens, synthetic_corpus
from meshtrain.data.tokenization import train_bpe
from meshtrain.errors import Code
from meshtrain.interop.hf_io import HFModelDirectory, hf_mapping, import_hf
from meshtrain.models import preset
from meshtrain.parallel.layers.context_parallel import context_parallel_positions
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "gpt2": transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2,
                                    n_head=4, initializer_range=0.1, bos_token_id=None,
                                    eos_token_id=None),
    "llama_gqa": transformers.LlamaConfig(**TINY),
    "llama3_v5": transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3),
    "llama3_v4": transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3),  # rewritten below
    "llama32_tied": transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3,
                                             tie_word_embeddings=True),
    # Qwen2: q/k/v biases; tied as the small Qwen2.5 models are, and untied as the 7B
    "qwen2_tied": transformers.Qwen2Config(**TINY, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default",
                                                            "rope_theta": 1e6}),
    "qwen2": transformers.Qwen2Config(**TINY),
    # Mistral: a window of 8 on sequences of 24 (v0.1); v0.2/v0.3 configs have none
    "mistral": transformers.MistralConfig(**TINY, sliding_window=8),
    "mistral_v03": transformers.MistralConfig(**TINY, sliding_window=None),
    # Qwen2's window (8) on the layers from max_window_layers (1) on: layer 0 attends all
    "qwen2_window": transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=1),
}


def _as_transformers_4(path: Path) -> None:
    """config.json in transformers 4's rotary form, with fields that must not be refused."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "torch_dtype": "float32",
               "pretraining_tp": 2, "attention_dropout": 0.1, "use_cache": False,
               "pad_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))


def _tokenizer_json() -> str:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    """Each variant saved by transformers (the GPT-2 one with a tokenizer), plus a sharded copy
    of the GQA Llama."""
    root = tmp_path_factory.mktemp("hf")

    def shard_gqa(name: str, model) -> None:
        if name == "llama_gqa":
            model.save_pretrained(root / "sharded", max_shard_size="20KB")

    paths = save_models(root, CONFIGS, shard_gqa) | {"sharded": root / "sharded"}
    _as_transformers_4(paths["llama3_v4"])
    (paths["gpt2"] / "tokenizer.json").write_text(_tokenizer_json())
    return paths


imported = imported_fixture()
"""Each variant imported by the command line into a run directory."""


@pytest.mark.parametrize("variant", [v for v in CONFIGS if v != "llama3_v4"] + ["sharded"])
def test_import_then_export_is_bitwise_and_loads_cleanly(hf, imported, variant, tmp_path,
                                                         capfd):
    out = tmp_path / "hf"
    assert main(["export", str(imported[variant]), "--format", "hf", "--out", str(out)]) == 0
    source = hf[variant] / "model.safetensors"
    original = load_file(source) if source.exists() else {
        key: tensor for shard in hf[variant].glob("*.safetensors") for key, tensor in
        load_file(shard).items()}
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    capfd.readouterr()
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert "LOAD REPORT" not in capfd.readouterr().err  # transformers' table of such keys
    with torch.no_grad():
        assert max_difference(theirs.eval()(IDS).logits, reference(hf[variant])(IDS).logits) \
            < 1e-5


def test_dense_logits_equal_transformers(hf, imported):
    """`meshtrain.load_model` of the run directory and of the Hugging Face one (fp32)."""
    for variant in CONFIGS:
        with torch.no_grad():
            expected = reference(hf[variant])(IDS).logits
            for source in (imported[variant], hf[variant]):
                logits = meshtrain.load_model(source)(IDS)
                assert logits.shape == (2, 24, 256)
                assert max_difference(logits, expected) < 1e-5, (variant, source)


def test_sample_reads_an_imported_run(imported):
    sample = run_cli("sample", str(imported["llama_gqa"]), "--prompt", "ab",
                     "--max-new-tokens", "4", "--device", "cpu")
    assert sample.stdout.startswith("ab")


def test_both_rotary_config_forms_import_alike(hf):
    v4, v5 = HFModelDirectory(hf["llama3_v4"]).cfg, HFModelDirectory(hf["llama3_v5"]).cfg
    assert v4 == v5
    assert (v5.rope_scaling, v5.rope_theta, v5.rope_factor, v5.rope_original_max_positions) == \
        ("llama3", 500000.0, 8.0, 16)


def test_tokenizer_travels_with_the_model(hf, imported, tmp_path):
    assert (imported["gpt2"] / "tokenizer.json").read_text() == _tokenizer_json()
    assert main(["export", str(imported["gpt2"]), "--format", "hf", "--out", str(tmp_path)]) == 0
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("hello world")["input_ids"] == [1, 2]


@pytest.mark.parametrize("variant", ["gpt2", "llama_gqa", "llama32_tied", "qwen2_tied",
                                     "qwen2", "mistral", "qwen2_window"])
def test_logits_equal_transformers_at_tp2_and_pp2(hf, imported, variant):
    with torch.no_grad():
        expected = reference(hf[variant])(IDS).logits
    for degrees in ({"tp": 2}, {"pp": 2}):
        results = run_on_ranks(2, logits_at, str(imported[variant]), IDS, degrees)
        for logits in (r for r in results if r is not None):
            assert max_difference(logits, expected) < 1e-5, degrees


def _context_parallel_logits(run: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's positions and their logits (load-balanced chunks, true positions)."""
    mesh = worker_mesh(cp=2)
    path = resolve_checkpoint(run)
    model = build_model(checkpoint_config(path), mesh).eval()
    load_checkpoint(path, model=model, mesh=mesh)
    mine = context_parallel_positions(ids.shape[1], 2, mesh.cp.rank)
    with torch.no_grad():
        return mine, model.full_logits(model(ids[:, mine], mine))


@pytest.mark.parametrize("variant", ["mistral", "qwen2_window"])
def test_windowed_logits_equal_transformers_at_cp2(hf, imported, variant):
    """A window of 8 on sequences of 24 (Mistral's on every layer, Qwen2's from layer 1 on),
    split over two context-parallel ranks."""
    with torch.no_grad():
        expected = reference(hf[variant])(IDS).logits
    cfg = HFModelDirectory(hf[variant]).cfg
    assert (cfg.sliding_window, cfg.window_start_layer) == (8, variant == "qwen2_window")
    assert HFModelDirectory(hf["mistral_v03"]).cfg.sliding_window is None
    assert HFModelDirectory(hf["qwen2"]).cfg.sliding_window is None
    for mine, logits in run_on_ranks(2, _context_parallel_logits, str(imported[variant]), IDS):
        assert max_difference(logits, expected[:, mine]) < 1e-5


@pytest.mark.parametrize("variant", ["gpt2", "llama_gqa", "llama32_tied", "qwen2_tied",
                                     "qwen2", "mistral", "qwen2_window"])
def test_greedy_generation_equals_transformers(hf, variant):
    prompt = IDS[:, :6]
    theirs = greedy_of_transformers(hf[variant], prompt)
    model = meshtrain.load_model(hf[variant])
    assert torch.equal(model.generate(prompt, 12), theirs)
    sampled = model.generate(prompt, 12, temperature=1.0, top_k=5, seed=1)
    assert sampled.shape == (2, 18) and torch.equal(sampled[:, :6], prompt)
    assert torch.equal(sampled, model.generate(prompt, 12, temperature=1.0, top_k=5, seed=1))


def _first_batch_loss(model, corpus: str, **sampler) -> float:
    """The dense model's mean loss on step 1's global batch (what the run logs first)."""
    tokens = load_corpus(corpus).tokens
    train_tokens, _ = split_tokens(tokens, 0.05)
    batches = BatchSampler(train_tokens, **sampler).micro_batches(0, dp_rank=0, dp_size=1)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                  for x, y in batches]
    return torch.stack(losses).mean().item()


@pytest.mark.extended  # 9 s; importing then training is default in the fine-tune case below
def test_training_from_an_imported_model_at_tp2_dp2(imported, corpus, tmp_path):
    run = imported["llama_gqa"]
    _, out, _ = train_and_export(run, tmp_path, corpus, "--tp", "2")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    start = _first_batch_loss(meshtrain.load_model(run), corpus, seq_len=16, global_batch=4,
                              micro_batch=1, seed=0)
    assert rows[0]["loss"] == pytest.approx(start, rel=1e-5)  # the imported weights, step 0


def _llama3_style_tokenizer(path: Path, text: str) -> tokenizers.Tokenizer:
    """A BPE trained on `text` (`<|endoftext|>` ends documents) that puts `<|begin_of_text|>`
    before every input, as Llama 3's does."""
    tok = tokenizers.Tokenizer.from_str(train_bpe([text], vocab_size=300))
    tok.add_special_tokens(["<|begin_of_text|>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    tok.save(str(path))
    return tok


def test_fine_tune_with_the_models_own_tokenizer(tmp_path):
    """The guide's path: a Hugging Face directory with its tokenizer, imported; data prepared
    with that tokenizer; training at pp 2; an export that transformers loads, tokenizer and all,
    with the tokenizer's end-of-document and begin-of-text ids in config.json."""
    hf_dir, run, out, exported = (tmp_path / name for name in ("hf", "run", "tuned", "export"))
    text = synthetic_corpus(6_000, seed=5).tobytes().decode()
    (tmp_path / "a.txt").write_text(text[:3000])
    (tmp_path / "b.txt").write_text(text[3000:])
    hf_dir.mkdir()
    tok = _llama3_style_tokenizer(hf_dir / "tokenizer.json", text)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY | {"vocab_size": tok.get_vocab_size()})).save_pretrained(hf_dir)
    assert main(["import-hf", str(hf_dir), "--out", str(run)]) == 0
    tokens = tmp_path / "tokens.bin"
    assert main(["prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--workers", "1",
                 "--tokenizer", str(run / "tokenizer.json"), "--out", str(tokens)]) == 0
    run_cli("train", "--init-from", str(run), "--data", str(tokens), "--nproc", "2", "--pp", "2",
            "--device", "cpu", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2",
            "--steps", "2", "--eval-every", "0", "--out", str(out))
    assert main(["export", str(out), "--format", "hf", "--out", str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    bos = tok.token_to_id("<|begin_of_text|>")
    assert (config["eos_token_id"], config["bos_token_id"]) == (0, bos)
    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    assert (theirs.eos_token, theirs.bos_token) == ("<|endoftext|>", "<|begin_of_text|>")
    ids = torch.tensor([theirs("the cat")["input_ids"]])
    assert ids[0].tolist() == tok.encode("the cat").ids and ids[0, 0] == bos
    with torch.no_grad():
        assert max_difference(meshtrain.load_model(out)(ids),
                               reference(exported)(ids).logits) < 1e-5


def _start_from(run: str, corpus: str, out: str):
    cfg = build_config({}, {"checkpoint": {"init_from": run, "out": out},
                            "parallel": {"device": "cpu", "zero": 3},
                            "train": {"precision": "bf16", "seq_len": 16, "global_batch": 4,
                                      "micro_batch": 2, "steps": 2},
                            "data": {"data": corpus}})
    trainer = Trainer.build(cfg, worker_mesh(dp=2))
    trainer.start_from(run)
    values, states, step = trainer.sync.export()
    loss = trainer.train_step(0)["loss"]
    return {name: value.clone() for name, value in values.items()}, states, step, loss


def test_init_from_under_zero3_in_bf16(imported, corpus, tmp_path):
    """fp32 master weights sharded over dp are the imported weights exactly; no optimizer
    state is carried."""
    run = imported["llama3_v5"]
    values, states, step, loss = run_on_ranks(2, _start_from, str(run), corpus,
                                              str(tmp_path))[0]
    weights = dict(meshtrain.load_model(run).lm.named_parameters())
    assert values.keys() == weights.keys() and states is None and step is None
    assert all(torch.equal(values[n], weights[n].detach()) for n in weights)
    assert values[next(iter(values))].dtype == torch.float32 and loss == loss  # finite


def _train_error(capsys, *flags) -> str:
    assert main(["train", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    return err


def test_init_from_takes_the_checkpoint_shape_and_refuses_others(hf, imported, corpus,
                                                                 tmp_path, capsys):
    run, out = str(imported["llama_gqa"]), str(tmp_path / "new")
    common = ["--init-from", run, "--data", corpus, "--out", out]
    assert "--model tiny is not the shape of the Llama model in --init-from" in \
        _train_error(capsys, *common, "--model", "tiny")
    assert "--num-layers 3 would change the num_layers (2)" in \
        _train_error(capsys, *common, "--num-layers", "3")
    assert "--init-from nowhere: no checkpoint there" in \
        _train_error(capsys, "--init-from", "nowhere", "--data", corpus, "--out", out)
    # shape settings that agree, and settings of this run's own, are accepted
    cfg = _train_config(build_parser().parse_args(
        ["train", *common, "--num-heads", "4", "--num-kv-heads", "2", "--dropout", "0.1",
         "--seq-len", "128", "--device", "cpu"]))
    check_train(cfg, 1)
    saved = checkpoint_config(run)
    assert cfg.model_config(256) == dataclasses.replace(saved, dropout=0.1, max_seq_len=128)
    assert main(["import-hf", run, "--out", out]) == 2
    assert "no config.json there" in capsys.readouterr().err
    assert main(["import-hf", str(hf["gpt2"]), "--out", run]) == 2
    assert "--out " + run + " holds a run" in capsys.readouterr().err


def _write_config(path: Path, base: str, **fields) -> Path:
    path.mkdir()
    config = CONFIGS[base].to_dict() | fields
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("base,fields,named", [
    ("gpt2", {"activation_function": "relu"}, '"activation_function": \'relu\''),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, '"scale_attn_by_inverse_layer_idx"'),
    ("gpt2", {"tie_word_embeddings": False}, '"tie_word_embeddings"'),
    ("llama_gqa", {"hidden_act": "gelu"}, '"hidden_act"'),
    ("llama_gqa", {"attention_bias": True}, '"attention_bias"'),
    ("llama_gqa", {"mlp_bias": True}, '"mlp_bias"'),
    ("llama_gqa", {"head_dim": 0}, '"head_dim": 0'),
    ("llama_gqa", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     "\"rope_parameters\": rope type 'yarn'"),
    ("llama_gqa", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "\"rope_scaling\": rope type 'linear'"),
    ("llama_gqa", {"architectures": ["GemmaForCausalLM"]}, '"architectures"'),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"]}, '"layer_types"'),
    ("qwen2", {"hidden_act": "gelu"}, '"hidden_act"'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_configs_are_one_line_errors(base, fields, named, tmp_path, capsys):
    assert_import_refused(CONFIGS[base].to_dict() | fields, named, tmp_path, capsys)


def test_a_window_the_architecture_cannot_hold_is_not_exported():
    """Exported as is, a windowed Llama or GPT-2 would attend the whole sequence, and Mistral
    windows every layer."""
    for family, fields, named in (("llama", {"sliding_window": 8}, "`sliding_window` 8"),
                                  ("gpt", {"sliding_window": 8}, "`sliding_window` 8"),
                                  ("mistral", {"window_start_layer": 1},
                                   "`window_start_layer` 1")):
        cfg = preset({"llama": "llama-tiny", "gpt": "tiny", "mistral": "mistral-tiny"}[family],
                     **fields)
        with pytest.raises(ValueError, match=named + ".*export it with format meshtrain") as e:
            hf_mapping(family).window_to_hf(cfg)
        assert e.value.code is Code.HF_EXPORT
    windowed = preset("qwen2-tiny", sliding_window=8, window_start_layer=3)
    assert hf_mapping("qwen2").window_to_hf(windowed)["layer_types"] == \
        ["full_attention"] * 3 + ["sliding_attention"]


def test_files_of_the_base_model_and_stray_tensors(hf, tmp_path):
    """GPT-2 files saved from the base model (no `transformer.` prefix, causal-mask buffers)
    import; a weight no map reads is refused rather than dropped."""
    tensors = {key.removeprefix("transformer."): tensor
               for key, tensor in load_file(hf["gpt2"] / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    source = _write_config(tmp_path / "base", "gpt2")
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    import_hf(source, tmp_path / "run")
    with torch.no_grad():
        assert torch.equal(meshtrain.load_model(tmp_path / "run")(IDS),
                           meshtrain.load_model(hf["gpt2"])(IDS))
    save_file(tensors | {"h.0.attn.c_attn.lora": torch.ones(2)}, source / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="1 tensors such as h.0.attn.c_attn.lora have no place"):
        import_hf(source, tmp_path / "again")
