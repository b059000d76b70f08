"""The Llama family beyond the shared parity tests (which run it at the GPT tests' layouts):
its blocks, Hugging Face's implementation as an independent reference, grouped-query layouts,
checkpoints that reshard, the family check on load, and the command line."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from harness import LLAMA, raises_as_flags, run_cli, run_on_ranks, worker_mesh

from meshtrain import ParallelMesh, preset
from meshtrain.checkpointing.checkpoint import CheckpointError, latest_checkpoint, read_manifest
from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.interop.hf_io import hf_state_dict
from meshtrain.models.blocks import Rotary, rope_frequencies
from meshtrain.parallel.communication.comm import all_gather_objects
from meshtrain.parallel.layers.norms import RMSNorm
from meshtrain.parallel.layers.sharding import parameter_shards, unshard_tensor
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer


def test_rms_norm_is_computed_in_fp32_with_exact_gradients():
    from meshtrain.parallel.layers.norms import _RMSNormFn

    torch.manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.empty(6, dtype=torch.float64).uniform_(0.5, 1.5).requires_grad_()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(_RMSNormFn.apply(x, weight, None, 6, 1e-5), expected, rtol=1e-12,
                               atol=1e-12)  # fp64 stays fp64
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFn.apply(x, w, None, 6, 1e-5),
                                    (x, weight))  # input and weight gradients
    # bf16 in: statistics in fp32, rounded once to bf16 before the weight multiplies
    norm = RMSNorm(6, eps=1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(weight.detach())
    half = (x.detach() * 100).to(torch.bfloat16)
    wide = half.float()
    normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(norm(half), norm.weight * normed)


def test_rotary_scores_depend_only_on_the_distance():
    torch.manual_seed(0)
    rotary = Rotary(rope_frequencies(16, theta=10000.0))
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        return (rotary(q, torch.tensor([m])) * rotary(k, torch.tensor([n]))).sum()

    torch.testing.assert_close(score(3, 1), score(103, 101), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2))
    # llama3 scaling slows only the long wavelengths (low frequencies)
    plain = rope_frequencies(16, theta=500000.0)
    scaled = rope_frequencies(16, theta=500000.0, scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_positions": 64})
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8)


def test_rotary_angles_stay_fp32_in_a_16_bit_model():
    """`model.to(bf16)` must not round the frequencies: position 8191 would move by radians."""
    model = build_model(preset("llama-tiny", rope_theta=500000.0), ParallelMesh.local(), seed=0)
    positions = torch.arange(8192)
    fp32 = model.layers["0"].attn.rotary.angles(positions)
    model.to(torch.bfloat16)
    assert torch.equal(model.layers["0"].attn.rotary.angles(positions), fp32)


@pytest.mark.parametrize("kv,tied,scaled", [(4, False, False), (8, False, True),
                                            (2, True, True)], ids=str)
def test_logits_equal_transformers_llama(kv, tied, scaled):
    """Hugging Face's LlamaForCausalLM with our weights: a check of the conventions (rotary
    half split, RMSNorm, SwiGLU, grouped heads, llama3 scaling) that shares no code with us."""
    import transformers  # a test dependency: this reference must never be skipped
    rope = dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=64) \
        if scaled else {}
    cfg = preset("llama-tiny", num_kv_heads=kv, rope_theta=50000.0, tie_word_embeddings=tied,
                 **rope)
    ours = build_model(cfg, ParallelMesh.local(), seed=3).eval()
    parameters = {"rope_type": "llama3" if scaled else "default", "rope_theta": 50000.0}
    if scaled:
        parameters |= {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=kv, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_parameters=parameters, tie_word_embeddings=tied)).eval()
    missing, unexpected = theirs.load_state_dict(hf_state_dict(ours), strict=False)
    assert not unexpected and set(missing) == ({"lm_head.weight"} if tied else set())
    assert not tied or theirs.lm_head.weight is theirs.model.embed_tokens.weight  # loaded too
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert difference < 1e-5  # fp32


def test_grouped_query_layouts_that_cannot_be_split():
    with raises_as_flags(r"--num-kv-heads \(3\) must divide the number of heads \(8\)"):
        preset("llama-tiny", num_kv_heads=3).validate()
    odd = preset("llama-tiny", num_heads=12, num_kv_heads=4, hidden_size=96, ffn_hidden_size=192)
    with raises_as_flags(r"key/value heads \(4\) and --tp \(6\) must divide one another"):
        odd.validate_for_tp(6)
    odd.validate_for_tp(2)
    odd.validate_for_tp(4)


def _cfg(corpus, out, **parallel):
    return build_config({}, {"model": LLAMA | {"num_kv_heads": 1},
                             "train": {"steps": 6, "global_batch": 4, "micro_batch": 2,
                                       "seq_len": 16, "seed": 4},
                             "parallel": {"device": "cpu"} | parallel,
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every logical weight, as a checkpoint sees it: whole over the data-parallel axes (ZeRO
    gathers its shards), TP slices gathered, pipeline stages merged."""
    values, _, _ = trainer.sync.export()
    shards = parameter_shards(trainer.model)
    mine = {name: value.detach().clone() if shards[name] is None else
            unshard_tensor(value, shards[name], trainer.mesh) for name, value in values.items()}
    weights = {}
    for part in all_gather_objects(mine, trainer.mesh.pp):
        weights.update(part)
    return weights


def _save(corpus, out, degrees, parallel):
    trainer = Trainer.build(_cfg(corpus, out, **parallel), worker_mesh(**degrees))
    for step in range(2):
        trainer.train_step(step)
    trainer.save(Path(out), 2)
    return _full_weights(trainer)


def _resume(corpus, out, degrees, parallel):
    trainer = Trainer.build(_cfg(corpus, out, **parallel), worker_mesh(**degrees))
    assert trainer.resume(Path(out)) == 2
    return _full_weights(trainer), trainer.train_step(2)["loss"]


def test_checkpoint_reshards_across_layouts(corpus, tmp_path):
    """One key/value head: saved at tp 2 x dp 2 with ZeRO-1 (the head on both TP ranks, the
    optimizer sharded over dp), it loads bitwise at tp 4 (the head on all 4), at tp 2 x pp 2,
    at dp 2 with ZeRO-3 and at one rank, and every layout continues with the same next loss."""
    saved = run_on_ranks(4, _save, corpus, str(tmp_path), {"tp": 2, "dp": 2}, {"zero": 1})[0]
    losses = []
    for world, degrees, parallel in ((4, {"tp": 4}, {}), (4, {"tp": 2, "pp": 2}, {}),
                                     (2, {"dp": 2}, {"zero": 3}), (1, {}, {})):
        weights, loss = run_on_ranks(world, _resume, corpus, str(tmp_path), degrees,
                                     parallel)[0]
        assert weights.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(weights[name], tensor), (degrees, name)
        losses.append(loss)
    assert losses[:3] == pytest.approx([losses[3]] * 3, rel=1e-5)


def test_checkpoints_record_the_family_and_compare_shapes(corpus, tmp_path):
    run_on_ranks(1, _save, corpus, str(tmp_path), {}, {})
    path = latest_checkpoint(tmp_path / "checkpoints")
    assert read_manifest(path)["family"] == "llama"
    with pytest.raises(CheckpointError, match="holds a llama model, not a gpt"):
        read_manifest(path, preset("tiny"))
    saved = _cfg(corpus, str(tmp_path)).model_config(256)
    read_manifest(path, dataclasses.replace(saved, max_seq_len=4096))  # rotary: no table
    with pytest.raises(CheckpointError, match="kv_heads 1 there vs 8 here"):  # None: 8 heads
        read_manifest(path, dataclasses.replace(saved, num_kv_heads=None))


@pytest.mark.extended  # the README's train -> reshard resume -> export -> sample runs that path
def test_command_line_trains_resumes_exports_and_samples(corpus, tmp_path):
    out = tmp_path / "run"
    common = ["--model", "llama-tiny", "--device", "cpu", "--data", corpus, "--seq-len", "32",
              "--global-batch", "4", "--micro-batch", "2", "--steps", "4", "--eval-every", "2",
              "--out", str(out)]
    run_cli("train", "--nproc", "2", "--tp", "2", "--stop-at", "2", *common)
    run_cli("train", "--nproc", "2", "--pp", "2", "--resume", *common)  # tp 2 -> pp 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert main(["export", str(out), "--out", str(tmp_path / "llama.safetensors")]) == 0
    sample = run_cli("sample", str(out), "--prompt", "the ", "--max-new-tokens", "8",
                  "--nproc", "2", "--tp", "2", "--device", "cpu")  # logits gathered over tp
    assert sample.stdout.startswith("the ")


def test_a_llama_run_refuses_another_family(corpus, tmp_path, capsys):
    """Refused before any rank starts, in this process."""
    common = ["--model", "llama-tiny", "--device", "cpu", "--data", corpus, "--seq-len", "32",
              "--global-batch", "4", "--micro-batch", "2", "--steps", "1", "--eval-every", "0",
              "--out", str(tmp_path / "run")]
    assert main(["train", *common]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--out", common[-1], "--steps", "2"]) == 0  # carried
    capsys.readouterr()
    assert main(["train", "--nproc", "2", "--resume", "--model", "tiny", *common[2:],
                 "--steps", "6"]) == 2
    wrong = capsys.readouterr().err
    assert "holds a llama model, not a gpt" in wrong and len(wrong.strip().splitlines()) == 1
    foreign = main(["train", "--model", "tiny", "--num-kv-heads", "2", "--device", "cpu",
                    "--data", corpus, "--out", str(tmp_path / "gpt")])
    assert foreign == 2
    assert "--num-kv-heads cannot change in GPT" in capsys.readouterr().err
