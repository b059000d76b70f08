"""Errors in terms of settings: one type with a stable code and the settings it involves.

Library code raises `SettingError(Code.X, message)` when a setting, or a combination of settings
and the model, cannot work. The message names the settings in backticks (`pp_schedule`), which
the command line turns into flags; the code says what kind of problem it is, so the planner
groups the layouts it rejects by `code.value` and tests match the code, never the wording.
`SettingError` is a `ValueError`, so callers that catch those keep working.
"""

from __future__ import annotations

import re
from enum import Enum, unique


@unique
class Code(Enum):
    """Each kind of refusal: the member's name is its stable code, its value the short reason
    the planner lists rejected layouts under."""

    # values and choices of one setting
    CHOICE = "not one of the setting's choices"
    RANGE = "a setting out of its range"
    MIN_LR_ABOVE_LR = "min_lr exceeds lr"
    GIVEN_TWICE = "a setting given twice"
    SETTING_MISSING = "a required setting not given"
    SETTINGS_EXCLUSIVE = "settings that exclude one another"
    SETTING_TYPE = "a setting's value not of its type"
    UNKNOWN_SETTING = "a setting or section meshtrain does not know"
    OUT_PATH = "out is a file, not empty, holds a run, unwritable or misnamed"
    # degrees, batches, sequences
    DEGREES_WORLD = "degrees do not make the world size"
    BATCH_SPLIT = "global batch not divisible by micro-batch x dp"
    SEQ_LEN_MAX = "seq_len exceeds max_seq_len"
    CP_SEQ_LEN = "seq_len not divisible by 2 x cp"
    SP_SEQ_LEN = "seq_len / cp not divisible by tp (sp)"
    SP_WITHOUT_TP = "sp without tp > 1"
    TP_OVERLAP_WITHOUT_SP = "tp_overlap without sp"
    ALL2ALL_HEADS = "all2all: heads per rank not divisible by cp"
    CP_A2A = "cp_a2a missing under hybrid or not dividing cp"
    CP_A2A_HEADS = "hybrid: heads per rank not divisible by cp_a2a"
    CP_HYBRID_WITHOUT_CP = "cp_mode hybrid without cp > 1"
    CP_A2A_WITHOUT_HYBRID = "cp_a2a without cp_mode hybrid"
    CP_DROPOUT = "cp with dropout"
    GRAD_DTYPE = "grad_dtype neither fp32 nor the precision"
    RECOMPUTE_LAYERS = "recompute_layers without full recompute"
    # the model's shape against tensor and expert parallelism
    HEADS_TP = "heads not divisible by tp"
    KV_HEADS_TP = "kv heads and tp do not divide one another"
    MLP_WIDTH_TP = "MLP width not divisible by tp"
    EP_DEGREE = "ep does not divide dp x cp (x tp at etp 1)"
    ETP_DEGREE = "etp neither 1 nor tp"
    ETP_WITHOUT_MOE = "etp 1 without MoE"
    EP_WITHOUT_MOE = "ep > 1 without MoE"
    EXPERTS_EP = "experts not divisible by ep"
    MOE_SEQUENCE_SPLIT = "MoE capacity with sp or cp"
    MOE_SEQ_AUX_SPLIT = "MoE sequence-wise balancing loss with sp or cp"
    # tensor-parallel schemes
    GRID_TP = "tp does not form the scheme's grid"
    GRID_DEPTH = "tp_depth does not fit the scheme or tp"
    GRID_SHAPE = "heads or widths not divisible by the grid"
    GRID_BATCH_SPLIT = "micro-batch not divisible by the grid's batch split"
    SCHEME_COMBINATION = "grid scheme with sp, cp or MoE"
    TP_OVERLAP_SCHEME = "tp_overlap with a grid tp scheme"
    MESH_SCHEME = "mesh built for another tp scheme"
    # a torch DeviceMesh handed in, and DTensor state dicts out
    DEVICE_MESH_DIMS = "DeviceMesh dims meshtrain cannot map"
    DEVICE_MESH_DEGREES = "DeviceMesh dims do not match the degrees"
    DEVICE_MESH_LAYOUT = "DeviceMesh ranks not laid out as meshtrain's axes"
    DTENSOR_LAYOUT = "layout a DTensor state dict cannot describe"
    # ZeRO
    ZERO_PIPELINE = "zero 2/3 with pp > 1"
    ZERO_2BW = "zero with 2bw"
    ZERO_FP64 = "zero with fp64"
    OFFLOAD_WITHOUT_ZERO = "offload without zero"
    DP_SHARD = "dp_shard does not divide dp"
    DP_SHARD_WITHOUT_ZERO = "dp_shard without zero"
    DP_SHARD_MOE = "dp_shard with MoE"
    OFFLOAD_DIR = "offload_dir missing, unwritable or too small"
    ZERO_IMPL_STAGE = "zero_impl deepspeed without zero 3"
    ZERO_IMPL_TRAIN = "zero_impl deepspeed is for the planner only"
    # pipelines
    PP_LAYERS = "pp exceeds layers"
    PP_LAYERS_SPLIT = "pp_layers does not split the layers"
    CHUNK_LAYERS = "pp x virtual stages exceeds layers"
    VIRTUAL_STAGES_SCHEDULE = "virtual stages without interleaved"
    VIRTUAL_STAGES_PP = "virtual stages without pp > 1"
    INTERLEAVED_MICRO_BATCHES = "interleaved: micro-batches not divisible by pp"
    INTERLEAVED_LAYERS = "interleaved: layers not divisible by pp x vp"
    TWO_BW_PP = "2bw without pp > 1"
    TWO_BW_MICRO_BATCHES = "2bw: fewer micro-batches than pp"
    TWO_BW_PRECISION = "2bw needs fp32"
    TWO_BW_MOE = "2bw with MoE"
    ZERO_BUBBLE_PP = "zero-bubble schedule without pp > 1"
    ZERO_BUBBLE_SCHEME = "zero-bubble schedule with a grid tp scheme"
    ZB_V_LAYERS = "zb-v: fewer layers than 2 x pp"
    TRACE_SCHEDULE = "trace with a schedule that does not flush"
    SCHEDULE_COMBINATION = "a feature the pipeline schedule does not list"
    # compiled blocks
    COMPILE_MOE = "compile with MoE"
    COMPILE_SCHEME = "compile with a grid tp scheme"
    # FP8 training
    FP8_DEVICE = "fp8 on a device without FP8 tensor cores"
    FP8_PACKAGE = "fp8 without the torchao package"
    FP8_SCHEME = "fp8 with a grid tp scheme"
    FP8_PRECISION = "fp8 with fp64"
    FP8_TOKENS = "fp8: tokens per micro-batch not a multiple of 16"
    # the model alone
    MODEL_SHAPE = "model shape cannot be built"
    MODEL_UNSUPPORTED = "model feature not implemented"
    MODEL_MEMORY = "model states exceed the machine's memory"
    MOE_TOP_K = "MoE top-k exceeds the experts"
    MOE_GROUPS = "MoE expert groups that do not split the experts or hold the top-k"
    LAYER_PATTERN = "a per-layer pattern that lists no valid layers"
    MOE_SHARED = "a shared expert without its gate style, or without experts"
    MODEL_FIELDS = "model fields not the family's settings"
    TP_WIDTH = "a layer width not divisible by tp"
    LAYER_INPUT = "a parallel layer's input not of the width it takes"
    KV_CACHE = "no key/value cache for this model, layout or length"
    # the data
    DATA_BLEND = "data_path is not a blend of compatible files"
    DATA_SEQ_LEN = "a data split shorter than seq_len + 1 tokens"
    VOCAB_SIZE = "vocab_size smaller than the data's vocabulary"
    EOD_TOKEN = "eod_token not a token of the tokenizer, or none found"
    TOKENIZERS_PACKAGE = "a tokenizer.json without the tokenizers package"
    PYARROW_PACKAGE = "parquet or arrow inputs without the pyarrow package"
    RESET_POSITIONS_MASK = "reset_positions without document_mask"
    DOCUMENT_MASK_SPLIT = "document_mask with a scheme that splits micro-batches"
    DOCUMENTS_WITHOUT_EOD = "document settings on data without end-of-document tokens"
    # resuming a run
    RESUME_NO_CHECKPOINT = "resume without a checkpoint in out"
    RESUME_STEPS = "steps or stop_at at or below the checkpoint's step"
    INIT_FROM_SHAPE = "a setting that changes the init_from checkpoint's model shape"
    MAX_RESTARTS_RESUME = "max_restarts without auto_resume"
    # fault tolerance (replica groups under torchft)
    FT_PACKAGE = "fault_tolerance without the torchft package"
    FT_SETTING = "a replica-group setting without fault_tolerance"
    REPLICA_GROUPS = "replica_groups not dividing the ranks or the global batch"
    MIN_REPLICA_GROUPS = "min_replica_groups outside 1 .. replica_groups"
    REPLICA_GROUP_ID = "replica_group_id or lighthouse missing or out of range under torchrun"
    LIGHTHOUSE = "a lighthouse address that does not answer"
    REPLICA_GROUP_MISMATCH = "a replica group of another model or layout"
    # the machine a run launches on, and its logging
    CUDA_DEVICES = "device cuda without a CUDA device per local rank"
    WANDB_PACKAGE = "wandb_project without the wandb package"
    # the planner and the machine it plans for
    HARDWARE_PROFILE = "hardware neither a built-in profile nor a valid profile file"
    CALIBRATE_DEVICES = "calibration ranks exceed the CUDA devices"
    FROM_RUN = "from_run not a run directory with enough timed steps"
    LAYOUT_AUTO = "a setting layout auto cannot take or that contradicts layout"
    NO_LAYOUT_FITS = "no layout fits"
    # model files from elsewhere
    HF_CONFIG = "config.json describes no model meshtrain can import"
    HF_WEIGHTS = "safetensors weights missing, damaged or not config.json's model"
    HF_EXPORT = "model a Hugging Face architecture cannot hold"


class SettingError(ValueError):
    """A setting (or combination) that cannot work: `code` says which kind, `settings` names
    the settings involved (by default those the message names in backticks)."""

    def __init__(self, code: Code, message: str, *, settings: tuple[str, ...] | None = None):
        super().__init__(message)
        self.code = code
        self.settings = settings if settings is not None else tuple(
            dict.fromkeys(re.findall(r"`([a-z_0-9]+)`", message)))


def alternatives(choices) -> str:
    """Choices as a message lists them: `a, b or c`."""
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
