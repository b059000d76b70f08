"""Everything read from outside is checked before a rank starts (issue 56, item 2): a DCP
directory's files against its .metadata, every `--model-arg` value (finite, in range, of the
family's type), explicit settings the data would otherwise decide, and the packages a flag
needs; each is one line on stderr, exit 2, nothing written to --out. A DCP file damaged where
only reading it shows is one line too, from the rank (not DCP's tracebacks). The checkpoint
cases (RNG states of another size, a directory named for another step) are in
test_checkpoint_trust.py's DAMAGE table."""

import re
from pathlib import Path

import pytest
import torch

from meshtrain import ParallelMesh, preset
from meshtrain.checkpointing.model_files import write_model_checkpoint
from meshtrain.cli.main import main
from meshtrain.config import run_config
from meshtrain.interop.titan_dcp import export_dcp
from meshtrain.parallelize import build_model

# dcp.save/load(no_dist=True) in one process says it assumes one process: that is the point
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TRAIN = ["train", "--device", "cpu", "--seq-len", "16", "--global-batch", "2", "--micro-batch",
         "2", "--steps", "1", "--eval-every", "0"]
DISTCP = "__0_0.distcp"


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory) -> Path:
    """llama-tiny (byte vocabulary) exported by meshtrain as a DCP directory."""
    root, cfg = tmp_path_factory.mktemp("dcp"), preset("llama-tiny")
    model = build_model(cfg, ParallelMesh.local(), seed=5)
    state = {name: p.detach() for name, p in model.named_parameters()}
    write_model_checkpoint(root / "run" / "checkpoints", family="llama", cfg=cfg,
                           planned=[(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                           tensors=state.items(), config_toml="")
    export_dcp(root / "run" / "checkpoints" / "step_00000000", root / "dcp")
    assert (root / "dcp" / DISTCP).is_file()
    return root / "dcp"


def _refused(capsys, argv: list[str], out: Path) -> str:
    """The command's one stderr line after it exits 2; --out was not created."""
    assert main([*argv, "--out", str(out)]) == 2, argv
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("meshtrain: error: "), err
    assert not out.exists()
    return err


def _copy(dcp_dir: Path, to: Path, damage) -> Path:
    to.mkdir()
    for file in dcp_dir.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    damage(to / DISTCP)
    return to


@pytest.mark.parametrize("case, damage, problem", [
    ("truncated", lambda f: f.write_bytes(f.read_bytes()[:5000]),
     rf"{DISTCP} is truncated: 5000 bytes, its .metadata records data up to byte \d+"),
    ("deleted", Path.unlink, rf"{DISTCP} is missing \(its .metadata names it\)"),
])
def test_a_dcp_directory_missing_data_is_refused_before_ranks_start(case, damage, problem,
                                                                    dcp_dir, corpus, tmp_path,
                                                                    capsys):
    bad = _copy(dcp_dir, tmp_path / case, damage)
    err = _refused(capsys, [*TRAIN, "--data", corpus, "--init-from", str(bad)], tmp_path / "out")
    assert re.search(problem, err), err
    assert "the directory is damaged: restore it or save it again" in err


def _overwrite(file: Path) -> None:
    with open(file, "r+b") as f:
        f.write(b"\0" * 4096)


def test_a_dcp_file_damaged_inside_is_refused_before_ranks_start(dcp_dir, corpus, tmp_path,
                                                                 capsys):
    """Bytes overwritten in place: the sizes agree, and reading each tensor once shows it."""
    bad = _copy(dcp_dir, tmp_path / "zeroed", _overwrite)
    err = _refused(capsys, [*TRAIN, "--data", corpus, "--init-from", str(bad)], tmp_path / "out")
    assert f"DCP directory {bad}: {DISTCP} cannot be read at tok_embeddings.weight" \
           " (UnpicklingError: " in err, err


def test_a_dcp_read_that_fails_on_a_rank_is_one_error(dcp_dir, tmp_path):
    """The ranks meshtrain's launcher starts check sizes alone: a read failing there is one
    CheckpointError (the rank's one line), not DCP's exception with its tracebacks."""
    from meshtrain.checkpointing.checkpoint import CheckpointError
    from meshtrain.interop.checkpoint_formats import checkpoint_format

    bad = _copy(dcp_dir, tmp_path / "zeroed", _overwrite)
    checkpoint_format(bad).check(bad, preset("llama-tiny"), False)  # sizes: whole
    model = build_model(preset("llama-tiny"), ParallelMesh.local(), seed=0)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_format(bad).load(bad, model, ParallelMesh.local(), None)
    assert str(refused.value).startswith(f"DCP directory {bad}: (its tok_embeddings.weight)"
                                         " cannot be read (UnpicklingError: ")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("arg, problem", [
    ("init_std=-0.02", "init_std must be positive, got -0.02"),
    ("layernorm_eps=0", "layernorm_eps must be positive, got 0.0"),
    ("dropout=1e999", "--model-arg dropout must be a finite number, got '1e999'"),
    ("num_layers=2.5", "--model-arg num_layers must be of type int, got '2.5'"),
    ("tie_word_embeddings=maybe", "--model-arg tie_word_embeddings must be of type bool"),
    ("max_seq_len=8", "--seq-len 16 exceeds --max-seq-len 8"),  # the positions: refused
])
def test_every_model_arg_value_is_checked(arg, problem, corpus, tmp_path, capsys):
    err = _refused(capsys, [*TRAIN, "--data", corpus, "--model-arg", arg], tmp_path / "out")
    assert problem in err, err


@pytest.mark.parametrize("arg, problem", [
    ("rms_norm_eps=-1e-5", "rms_norm_eps must be positive"),
    ("rope_factor=0", "rope_factor must be positive"),
    ("rope_original_max_positions=0", "rope_original_max_positions must be positive"),
])
def test_every_llama_model_arg_value_is_checked(arg, problem, corpus, tmp_path, capsys):
    err = _refused(capsys, [*TRAIN, "--model", "llama-tiny", "--data", corpus, "--model-arg", arg],
                   tmp_path / "out")
    assert problem in err, err


def test_a_non_finite_number_from_any_source_is_refused():
    """Not only `model_arg`: a config made from a checkpoint or a Hugging Face file too."""
    with pytest.raises(ValueError, match="`moe_capacity_factor` must be a finite number"):
        preset("tiny", moe_capacity_factor=float("inf"))
    with pytest.raises(ValueError, match="`rope_theta` must be a finite number, got nan"):
        preset("llama-tiny", rope_theta=float("nan"))


def test_an_explicit_vocabulary_larger_than_the_datas_is_kept(corpus):
    """The data decides the vocabulary only when none is given; one smaller than the data's
    is refused (test_model_vocabulary.py), a larger one kept."""
    for flags in ({"vocab_size": 300}, {"model_arg": ["vocab_size=300"]}):
        cfg = run_config.build_config({}, {"model": flags, "data": {"data": corpus}})
        assert cfg.model_config(256).vocab_size == 300


def test_a_missing_wandb_package_names_the_install(corpus, tmp_path, capsys, monkeypatch):
    real = run_config.importlib.util.find_spec
    monkeypatch.setattr(run_config.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    err = _refused(capsys, [*TRAIN, "--data", corpus, "--wandb-project", "p"], tmp_path / "out")
    assert "--wandb-project needs the wandb package: pip install 'meshtrain[wandb]'" in err


def test_dcp_reads_are_whole_after_the_check(dcp_dir):
    """The check reads .metadata alone: a good directory passes it and loads unchanged."""
    from meshtrain.interop.checkpoint_formats import checkpoint_format

    fmt = checkpoint_format(dcp_dir)
    assert fmt.name == "dcp"
    fmt.check(dcp_dir, preset("llama-tiny"), True)
    model = build_model(preset("llama-tiny"), ParallelMesh.local(), seed=0)
    fmt.load(dcp_dir, model, ParallelMesh.local(), None)
    assert all(torch.isfinite(p).all() for p in model.parameters())
