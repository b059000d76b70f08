"""DCP checkpoints under torchtitan's Llama 3 names (issue 30, item 3): meshtrain's export loads
into torchtitan's own model, torchtitan's save starts a meshtrain run at tp 2 x dp 2, and an
export re-enters meshtrain at tp 2 x dp 2, each with the dense model's logits."""

import dataclasses
import json
import sys
import types
from importlib.util import find_spec

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import raises_as_flags, run_cli, run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.checkpointing.checkpoint import resolve_checkpoint
from meshtrain.checkpointing.model_files import write_model_checkpoint
from meshtrain.cli.main import check_train
from meshtrain.config.run_config import build_config
from meshtrain.interop.titan_dcp import SIDECAR, export_dcp
from meshtrain.models import preset
from meshtrain.parallel.layers.sharding import named_full_tensors
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

# dcp.save/load(no_dist=True) in one process says it assumes one process: that is the point;
# torchtitan is imported where used (4 s), not by the ranks, which import this module
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.skipif(find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed: pip install -e '.[titan]'")]

CFG = preset("llama-tiny")  # 4 layers, hidden 64, 8 heads, 4 key/value heads, SwiGLU 176
TOKENS = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
TOL = dict(atol=1e-5, rtol=1e-5)


_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _without_triton() -> None:
    """torchtitan's model package imports its expert-parallel Triton kernels (for MoE), and so
    Triton, which it does not require and a dense Llama never calls. Where Triton is not
    installed (this CPU machine: installed, every process that imports dynamo loads it and
    prints nanobind's leak report at exit), those kernels are names that refuse to run."""
    if find_spec("triton") is not None or _EP_KERNELS in sys.modules:
        return

    def absent(*_args, **_kwargs):
        raise RuntimeError("torchtitan's expert-parallel kernels need triton")

    def kernel(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return absent

    kernels = types.ModuleType(_EP_KERNELS)
    kernels.__getattr__ = kernel
    sys.modules[_EP_KERNELS] = kernels


def _titan_model(cfg=CFG) -> torch.nn.Module:
    """torchtitan's Llama 3 of `cfg`'s dims, built by torchtitan (fused QKV, complex RoPE), with
    its causal SDPA core: its flex attention compiles (30 s on CPU) to the same numbers."""
    _without_triton()
    from torchtitan.models import llama3 as titan
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    h, v = cfg.hidden_size, cfg.vocab_size
    layers = titan._build_llama3_layers(
        n_layers=cfg.num_layers, dim=h, n_heads=cfg.num_heads, n_kv_heads=cfg.kv_heads,
        hidden_dim=cfg.ffn_size, attn_backend="flex", rope=ComplexRoPE.Config(
            dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = titan.Llama3Model.Config(
        dim=h, vocab_size=v, tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=h),
        norm=RMSNorm.Config(normalized_shape=h, eps=cfg.rms_norm_eps), layers=layers,
        lm_head=Linear.Config(in_features=h, out_features=v),
        enable_weight_tying=cfg.tie_word_embeddings).build()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():  # torchtitan's init is left to its trainer
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    return model


def _titan_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def _dense_logits(state: dict, cfg=CFG) -> torch.Tensor:
    model = build_model(cfg, ParallelMesh.local(), seed=0)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(TOKENS)


def _checkpoint(root, cfg=CFG) -> dict:
    """A meshtrain Llama checkpoint of random weights in `root`/run; its full tensors."""
    model = build_model(cfg, ParallelMesh.local(), seed=5)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so a swapped norm shows
            p.add_(torch.randn_like(p) * 0.05)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    write_model_checkpoint(root / "run" / "checkpoints", family="llama", cfg=cfg,
                           planned=[(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                           tensors=state.items(), config_toml="")
    return state


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A meshtrain Llama checkpoint, its full tensors and its DCP export (the command)."""
    root = tmp_path_factory.mktemp("dcp")
    state = _checkpoint(root)
    run_cli("export", str(root / "run"), "--format", "dcp", "--out", str(root / "dcp"))
    return root, state


def _check_in_torchtitan(folder, state, cfg=CFG):
    model = _titan_model(cfg)
    titan_state = model.state_dict()
    assert "layers.0.attention.qkv_linear.wk.weight" in titan_state  # the fused wqkv, split
    dcp.load(titan_state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(titan_state)
    assert_close(_titan_logits(model), _dense_logits(state, cfg), **TOL)


def test_export_loads_into_torchtitan(exported):
    root, state = exported
    _check_in_torchtitan(root / "dcp", state)


def test_tied_export_loads_into_torchtitan(tmp_path):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    state = _checkpoint(tmp_path, cfg)
    export_dcp(resolve_checkpoint(tmp_path / "run"), tmp_path / "dcp")
    _check_in_torchtitan(tmp_path / "dcp", state, cfg)


def _run_config(corpus, init_from, **model):
    return build_config({}, {"model": model, "train": {"seq_len": 24, "global_batch": 4,
                                                       "micro_batch": 1, "seed": 3},
                             "parallel": {"device": "cpu"}, "data": {"data": corpus},
                             "checkpoint": {"out": f"{init_from}_out", "init_from": init_from}})


def _logits_at_tp2_dp2(corpus, init_from, model):
    """Logits of a run started from `init_from` at tp 2 x dp 2 (every rank, whole vocabulary)
    and its full weights."""
    mesh = worker_mesh(tp=2, dp=2)
    trainer = Trainer.build(_run_config(corpus, init_from, **model), mesh)
    trainer.start_from(init_from)
    net = trainer.model
    net.eval()
    with torch.no_grad():
        logits = net.full_logits(net(TOKENS))
    return logits, dict(named_full_tensors(net))


def test_torchtitan_save_starts_a_run_at_tp2_dp2(tmp_path, corpus):
    model = _titan_model()
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "titan", no_dist=True)
    expected = _titan_logits(model)
    results = run_on_ranks(4, _logits_at_tp2_dp2, corpus, str(tmp_path / "titan"),
                           {"num_heads": CFG.num_heads})
    for logits, _ in results:
        assert_close(logits, expected, **TOL)
    assert_close(_dense_logits(results[0][1]), expected, **TOL)


def test_export_reenters_meshtrain_at_tp2_dp2(exported, corpus):
    root, state = exported
    check_train(_run_config(corpus, str(root / "dcp")), 4)  # what `train` checks first
    results = run_on_ranks(4, _logits_at_tp2_dp2, corpus, str(root / "dcp"), {})
    expected = _dense_logits(state)
    for logits, weights in results:
        assert_close(logits, expected, **TOL)
        assert all(torch.equal(weights[name], state[name]) for name in state)  # bitwise


def test_bad_dcp_input_is_refused(exported, tmp_path, corpus):
    root, _ = exported
    (tmp_path / "empty").mkdir()
    with raises_as_flags(r"no checkpoint there"):
        _run_config(corpus, str(tmp_path / "empty")).model_config(256)
    dcp.save({"wte": torch.zeros(3, 4)}, checkpoint_id=tmp_path / "other", no_dist=True)
    with raises_as_flags(r"--init-from .*other: a DCP directory without tok_embeddings.weight.*"
                         r"it is not torchtitan's Llama 3"):
        _run_config(corpus, str(tmp_path / "other"), num_heads=8).model_config(256)
    model = _titan_model()
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "titan", no_dist=True)
    with raises_as_flags(r"does not record its heads: give --num-heads"):
        _run_config(corpus, str(tmp_path / "titan")).model_config(256)
    with raises_as_flags(r"--num-heads 16 would change the num_heads \(8\)"):
        _run_config(corpus, str(root / "dcp"), num_heads=16).model_config(256)
    sidecar = json.loads((root / "dcp" / SIDECAR).read_text())
    sidecar["model"]["ffn_hidden_size"] = 128  # a config its tensors do not fit
    (tmp_path / "titan" / SIDECAR).write_text(json.dumps(sidecar))
    with raises_as_flags(r"layers.0.feed_forward.w1.weight has shape \(176, 64\) there, \(128,"
                         r" 64\)"):
        _run_config(corpus, str(tmp_path / "titan")).model_config(256)
    gpt = build_model(preset("tiny"), ParallelMesh.local(), seed=0)
    state = {name: p.detach() for name, p in gpt.named_parameters()}
    write_model_checkpoint(tmp_path / "gpt" / "checkpoints", family="gpt",
                           cfg=preset("tiny"), config_toml="", tensors=state.items(),
                           planned=[(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
    with raises_as_flags(r"DCP directories hold torchtitan's Llama 3; checkpoint .*gpt.* holds a"
                         r" gpt model: export it with format hf or meshtrain"):
        export_dcp(resolve_checkpoint(tmp_path / "gpt"), tmp_path / "gpt_dcp")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_dcp(resolve_checkpoint(root / "run"), root / "dcp")
