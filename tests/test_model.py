"""The whole GPT at tp in {1, 2, 4} against the dense single-process model."""

import pytest
import torch
from harness import run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain import ParallelMesh, preset
from meshtrain.parallel import CommRecorder, named_full_tensors
from meshtrain.parallel.communication.comm import all_gather
from meshtrain.parallelize import build_model

TOL = dict(rtol=1e-5, atol=1e-6)


def _batch(vocab, b=2, s=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _check_gpt(tp, vocab, attention):
    mesh = worker_mesh(tp=tp)
    cfg = preset("tiny", vocab_size=vocab, attention=attention)
    dense = build_model(cfg, ParallelMesh.local(), seed=7)
    model = build_model(cfg, mesh, seed=7)
    inputs, targets = _batch(vocab)

    # Same seed -> same weights at every tp.
    dense_params = dict(named_full_tensors(dense))
    full_params = dict(named_full_tensors(model))
    assert full_params.keys() == dense_params.keys()
    for name, full in full_params.items():
        assert_close(full, dense_params[name], rtol=0, atol=0, msg=name)

    ref_logits = dense(inputs)
    ref_loss = dense.loss(ref_logits, targets)
    ref_loss.backward()
    with CommRecorder() as fwd:
        logits = model(inputs)
        loss = model.loss(logits, targets)
    with CommRecorder() as bwd:
        loss.backward()

    assert logits.shape[-1] == -(-vocab // tp) * tp // tp
    full_logits = all_gather(logits.detach(), mesh.tp, dim=-1)[..., :vocab]
    assert_close(full_logits, ref_logits.detach(), **TOL)
    assert_close(loss, ref_loss, **TOL)
    dense_grads = dict(named_full_tensors(dense, grads=True))
    full_grads = dict(named_full_tensors(model, grads=True))
    assert full_grads.keys() == dense_grads.keys()
    for name, grad in full_grads.items():
        assert_close(grad, dense_grads[name], **TOL, msg=name)

    if tp > 1:
        b, s = inputs.shape
        bsh = b * s * cfg.hidden_size * 4
        layers = cfg.num_layers
        # Forward: embedding g + two g per layer (attention out, MLP out); then the loss's two
        # O(b*s) all-reduces. Backward: two f per layer (QKV in, MLP in) + the head's f.
        tp_fwd = fwd.select("all_reduce", "tp")
        assert [r.payload_bytes for r in tp_fwd[:-2]] == [bsh] * (1 + 2 * layers)
        assert [r.payload_bytes for r in tp_fwd[-2:]] == [b * s * 4, 2 * b * s * 4]
        assert [r.payload_bytes for r in bwd.select("all_reduce", "tp")] == [bsh] * (1 + 2 * layers)
        assert fwd.count() == len(tp_fwd) and bwd.count() == 2 * layers + 1


@pytest.mark.parametrize("tp,vocab", [(1, 250), (2, 251), (4, 250)])
def test_gpt_matches_dense(tp, vocab):
    run_on_ranks(tp, _check_gpt, tp, vocab, "sdpa")


def test_gpt_eager_attention_matches_dense():
    run_on_ranks(2, _check_gpt, 2, 97, "eager")


def test_sdpa_and_eager_attention_agree():
    mesh = ParallelMesh.local()
    inputs, targets = _batch(64)
    losses = []
    for attention in ("sdpa", "eager"):
        model = build_model(preset("tiny", vocab_size=64, attention=attention), mesh, seed=1)
        losses.append(model.loss(model(inputs), targets))
    assert_close(losses[0], losses[1], **TOL)


def _check_dropout_consistent():
    """With dropout on, TP ranks still agree on every replicated activation."""
    mesh = worker_mesh(tp=2)
    model = build_model(preset("tiny", vocab_size=64, dropout=0.3), mesh, seed=1)
    inputs, targets = _batch(64)
    from meshtrain.contracts import AuxiliaryOutputs
    from meshtrain.parallel.layers.rng import REPLICATED

    assert model.factory.hidden_stream == REPLICATED
    positions = torch.arange(inputs.shape[1])
    hidden = model.embedding(inputs, positions, model.rng)
    for block in model.layers.values():
        hidden = block(hidden, model.rng, positions, AuxiliaryOutputs())
    gathered = all_gather(hidden.detach().unsqueeze(0), mesh.tp, dim=0)
    assert_close(gathered[0], gathered[1], rtol=0, atol=0)
    # and the per-rank (attention) stream really differs between TP ranks
    from meshtrain.parallel.layers.rng import TENSOR_PARALLEL
    with model.rng.fork(TENSOR_PARALLEL):
        draw = torch.rand(4)
    draws = all_gather(draw.unsqueeze(0), mesh.tp, dim=0)
    assert not torch.equal(draws[0], draws[1])


def test_dropout_masks_replicated_across_tp():
    run_on_ranks(2, _check_dropout_consistent)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b",
                                  "megatron-8.3b"])
def test_presets_are_valid_configs(name):
    cfg = preset(name)
    cfg.validate()
    assert cfg.hidden_size % cfg.num_heads == 0


def test_preset_parameter_counts():
    assert abs(preset("gpt2").num_parameters() - 124.4e6) < 0.2e6
    assert abs(preset("gpt2-xl").num_parameters() - 1557.6e6) < 1e6
    assert abs(preset("gpt3-175b").num_parameters() / 1e9 - 175) < 1.5


def test_invalid_model_shapes():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        preset("nope")
    with pytest.raises(ValueError, match="divisible by the number of heads"):
        preset("tiny", hidden_size=66).validate()
    with pytest.raises(ValueError, match=r"number of heads \(4\) must be divisible by tp \(3\)"):
        preset("tiny").validate_for_tp(3)


def test_tiny_model_counted_parameters():
    model = build_model(preset("tiny"), ParallelMesh.local(), seed=0)
    assert sum(p.numel() for p in model.parameters()) == preset("tiny").num_parameters()


def test_loss_averages_over_non_ignored_tokens():
    model = build_model(preset("tiny", vocab_size=64), ParallelMesh.local(), seed=0)
    inputs, targets = _batch(64)
    targets = targets.clone()  # a view of the same ids as the inputs
    targets[:, 5:] = -100
    logits = model(inputs)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert_close(model.loss(logits, targets), expected, **TOL)


def test_family_fields_live_on_the_base_config_and_model_arg_sets_any_of_them():
    """Key/value heads, QKV biases and tying are base fields every family reads without
    getattr; `--model-arg KEY=VALUE` sets any field of the chosen family's config."""
    from meshtrain.cli.main import _train_config
    from meshtrain.cli.parsers import build_parser

    def model(*words):
        return _train_config(build_parser().parse_args(["train", *words])).model_config(256)

    llama = model("--model", "llama-tiny", "--model-arg", "rope_theta=1e6", "--model-arg",
                  "qkv_bias=true", "--model-arg", "rms_norm_eps=1e-6")
    assert (llama.rope_theta, llama.qkv_bias, llama.rms_norm_eps) == (1e6, True, 1e-6)
    biases = (llama.num_heads + 2 * llama.kv_heads) * llama.head_dim * llama.num_layers
    plain = preset("llama-tiny")
    assert llama.num_parameters() == plain.num_parameters() + biases
    assert sum(p.numel() for p in build_model(llama, ParallelMesh.local()).parameters()) \
        == llama.num_parameters()
    gpt = preset("tiny")
    assert (gpt.kv_heads, gpt.qkv_bias, gpt.tie_embeddings) == (gpt.num_heads, True, True)
    for words, message in (
            (["--model-arg", "rope_theta=1e6"], "`model_arg` 'rope_theta=1e6' is not KEY=VALUE"),
            (["--model", "llama-tiny", "--model-arg", "rope_theta=fast"],
             "`model_arg` rope_theta must be of type float"),
            (["--model", "llama-tiny", "--num-layers", "2", "--model-arg", "num_layers=3"],
             "`model_arg` num_layers is given twice"),
            (["--num-kv-heads", "2"], "`num_kv_heads` cannot change in GPT")):
        with pytest.raises(ValueError, match=message):
            model(*words)
