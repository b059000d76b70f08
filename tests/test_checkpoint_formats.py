"""The checkpoint-format registry: one answer to "what is this directory", and the refusals a
format owns."""

import pytest

from meshtrain.checkpointing.checkpoint import CheckpointError
from meshtrain.interop.checkpoint_formats import (
    DCP,
    HUGGING_FACE,
    NATIVE,
    checkpoint_format,
    saved_model,
)


def test_each_directory_has_one_format(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert checkpoint_format(tmp_path / "dcp") is DCP
    assert checkpoint_format(tmp_path / "hf") is HUGGING_FACE
    assert checkpoint_format(tmp_path / "run") is NATIVE  # its refusal is the checkpoint's


def test_a_hugging_face_init_from_is_refused_before_ranks_start(tmp_path):
    with pytest.raises(CheckpointError, match="import-hf"):
        HUGGING_FACE.check(tmp_path, None, True)


def test_a_model_that_cannot_be_read_names_the_setting_that_gave_it(tmp_path):
    with pytest.raises(CheckpointError, match="^`init_from` "):
        saved_model(tmp_path / "missing", setting="init_from")
    with pytest.raises(CheckpointError, match="^(?!`init_from`)"):
        saved_model(tmp_path / "missing")
