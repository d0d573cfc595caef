"""Every name list the rules and probes match code against, side by side.

A list that a rule and a probe both use lives here once; lists that look alike but mean different
things say so.
"""

from __future__ import annotations

import re

# -- loss scaling, precision, autograd ------------------------------------------------------------------
GRAD_SCALERS = frozenset(
    {
        "torch.amp.GradScaler",
        "torch.amp.grad_scaler.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.cuda.amp.grad_scaler.GradScaler",
        "torch.GradScaler",
        "torch.cpu.amp.GradScaler",
        # FSDP's subclass: same scale/unscale_/step contract.
        "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
        "torch.distributed.fsdp.ShardedGradScaler",
    }
)
# Contexts and decorators under which autograd records nothing (no graph, no gradients).
GRAD_DISABLED = frozenset({"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad"})
CLIP_FUNCTIONS = frozenset(
    f"{prefix}.{name}"
    for prefix in ("torch.nn.utils", "torch.nn.utils.clip_grad")
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_grad_norm")
)
CHECKPOINT_FUNCTIONS = frozenset(
    {
        "torch.utils.checkpoint.checkpoint",
        "torch.utils.checkpoint.checkpoint_sequential",
    }
)
# torch's wrapper of a module's forward: keywords other than its own go to torch's checkpoint (TL204's
# ``_wrapped_modules``, and the gate's ``rng_wrapper_callees``)
CHECKPOINT_WRAPPERS = frozenset(
    {
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",
    }
)
LOW_PRECISION_DTYPES = frozenset(
    {"torch.float16", "torch.half", "torch.bfloat16"},
)
OPTIMIZER_PREFIXES = (
    "torch.optim.",
    "bitsandbytes.optim.",
    "bnb.optim.",
    "apex.optimizers.",
    "timm.optim.",
    "torch.distributed.optim.",
    "deepspeed.ops.adam.",
    "deepspeed.ops.lamb.",
    "transformers.AdamW",
    "transformers.Adafactor",
    "transformers.optimization.AdamW",
    "transformers.optimization.Adafactor",
    "lion_pytorch.",
)
NOT_OPTIMIZERS = ("torch.optim.lr_scheduler", "torch.optim.swa_utils", "torch.optim.Optimizer")
AUTOCAST_FUNCTIONS = frozenset(
    {
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.autocast_mode.autocast",
        "torch.cuda.amp.autocast",
        "torch.cuda.amp.autocast_mode.autocast",
        "torch.cpu.amp.autocast",
        "torch.cpu.amp.autocast_mode.autocast",
    }
)
# Frameworks that do the loss scaling themselves when asked for fp16.
SCALING_FRAMEWORKS = (
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "deepspeed",
    "apex",
    "colossalai",
    "megatron",
    "msamp",
)
INFINITIES = frozenset({"math.inf", "torch.inf", "numpy.inf", "np.inf"})
# Names of the GradScaler class itself (a construction whose module cannot be resolved still counts).
SCALER_CLASS_SUFFIX = "GradScaler"

# -- modules, parameters and master weights ---------------------------------------------------------------
# Module methods that return the module itself, so a chain of them still denotes the module (TL105 and
# its probe).
MODULE_CHAIN = frozenset(
    {"cuda", "cpu", "xpu", "mps", "to", "type", "half", "bfloat16", "float", "double", "train", "eval"}
    | {"requires_grad_"}
)
# Wrappers whose ``.parameters()`` are the wrapped module's own parameters.
PARAMETER_SHARING_WRAPPERS = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DataParallel",
        "torch.nn.parallel.DataParallel",
        "torch.compile",
    }
)
# Whatever keeps fp32 master weights for a 16-bit model (matched on the last component, since these
# are often vendored copies): apex, DeepSpeed, Megatron, MS-AMP. Megatron-FSDP's
# ``fully_shard_optimizer`` steps fp32 main weights (its policy's ``main_params_dtype`` defaults to fp32).
MASTER_WEIGHT_CALLS = frozenset(
    {
        "FP16_Optimizer", "Float16OptimizerWithFloat16Params", "MixedPrecisionOptimizer", "FP16_Module",
        "fully_shard_optimizer",
    }
)  # fmt: skip
MASTER_WEIGHT_INITIALIZERS = ("apex.amp.initialize", "deepspeed.initialize", "msamp.initialize")
PARAM_CONTAINERS = frozenset(
    {
        "builtins.list",
        "builtins.tuple",
        "builtins.filter",
        "builtins.sorted",
        "itertools.chain",
        "builtins.iter",
    }
)

# -- backward, logging ------------------------------------------------------------------------------------
# Calls that run a backward pass: ``loss.backward()``, ``fabric.backward(loss)``,
# ``accelerator.backward(loss)``, Lightning's ``self.manual_backward(loss)``.
BACKWARD_NAMES = frozenset({"backward", "manual_backward"})
# Method names that record or print a value (TL302: a loss passed to one is read, not accumulated).
LOGGING_METHODS = frozenset(
    {
        "log", "info", "debug", "warning", "warn", "error", "write", "add_scalar", "add_scalars",
        "log_metrics", "log_dict", "set_postfix", "set_description", "format",
    }
)  # fmt: skip

# -- token data and losses (TL301, TL502) ------------------------------------------------------------------
CROSS_ENTROPY_FUNCTIONS = frozenset(
    {
        "torch.nn.functional.cross_entropy",
        "torch.nn.functional.nll_loss",
        "torch.cross_entropy",
    }
)
CROSS_ENTROPY_CLASSES = frozenset(
    {
        "torch.nn.CrossEntropyLoss",
        "torch.nn.NLLLoss",
        "torch.nn.modules.loss.CrossEntropyLoss",
        "torch.nn.modules.loss.NLLLoss",
    }
)
# Library loss functions that are a cross-entropy with ``ignore_index=-100`` by default.
TOKEN_LOSS_FUNCTIONS = frozenset(
    {
        "litgpt.utils.chunked_cross_entropy",
        "lit_gpt.utils.chunked_cross_entropy",
        "litgpt.chunked_cross_entropy",
    }
)
# Hugging Face class-name suffixes: models whose ``.loss`` averages over (valid) tokens ...
LM_SUFFIXES = (
    "ForCausalLM",
    "LMHeadModel",
    "ForMaskedLM",
    "ForSeq2SeqLM",
    "ForConditionalGeneration",
    "ForTokenClassification",
    "WithLMHead",
    "ForPreTraining",
    "ForVision2Seq",
    "ForImageTextToText",
    "ForSpeechSeq2Seq",
)
# ... and models whose ``.loss`` averages over examples of a fixed-size batch.
PER_EXAMPLE_SUFFIXES = (
    "ForSequenceClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForImageClassification",
    "ForAudioClassification",
    "ForNextSentencePrediction",
    "ForSemanticSegmentation",
    "ForObjectDetection",
)
# Collators and data modules that pad token sequences (labels padded with -100) or mask prompts.
PADDING_DATA = frozenset(
    {
        "DataCollatorForLanguageModeling",
        "DataCollatorForSeq2Seq",
        "DataCollatorWithPadding",
        "DataCollatorForTokenClassification",
        "DataCollatorForWholeWordMask",
        "DataCollatorForPermutationLanguageModeling",
        "DataCollatorForCompletionOnlyLM",
        "DataCollatorForChatML",
        "pad_sequence",
        "SFTDataset",
        "get_sft_collate_fn",
        "Alpaca",
        "Alpaca2k",
        "AlpacaGPT4",
        "Deita",
        "Dolly",
        "FLAN",
        "JSON",
        "LIMA",
        "LongForm",
    }
)
PADDING_PACKAGES = ("transformers", "trl", "torch", "litgpt", "lit_gpt")
# Collators and data modules whose batches are language-modelling data (``.loss`` is per token).
LM_DATA = PADDING_DATA - {"DataCollatorWithPadding", "pad_sequence"}
# Identifiers (names, attributes, string keys, keywords) that mean padded or masked token data.
PADDING_WORDS = frozenset(
    {
        "attention_mask",
        "decoder_attention_mask",
        "pad_token_id",
        "pad_token",
        "pad_id",
        "pad_idx",
        "pad_index",
        "padding_idx",
        "padding_value",
        "padding_side",
        "pad_to_multiple_of",
        "label_pad_token_id",
        "pad_sequence",
        "pad_right",
        "pad_left",
        "mask_prompt",
        "loss_mask",
        "labels_mask",
        "label_mask",
    }
)
# Wrappers whose result is the model they were given (first argument, or receiver for methods).
MODEL_WRAPPERS = frozenset(
    {
        "prepare",
        "prepare_model",
        "setup",
        "setup_module",
        "get_peft_model",
        "prepare_model_for_kbit_training",
        "DistributedDataParallel",
        "DDP",
        "DataParallel",
        "FullyShardedDataParallel",
        "FSDP",
        "compile",
        "to",
        "cuda",
        "half",
        "bfloat16",
        "float",
        "train",
    }
)
MEAN_PRESERVING_METHODS = frozenset(
    {"mean", "float", "to", "squeeze", "contiguous", "clone", "type", "double"}
)
COUNT_METHODS = frozenset({"sum", "count_nonzero"})
# Words in a name that make it something other than an accumulation step count.
NOT_A_STEP_COUNT = ("token", "item", "elem", "loss", "norm", "mask", "valid", "weight", "sample", "sum")

# Names that say "optimizer" when the construction is out of sight: optimizer, optim, opt, opt_g, optD,
# g_optimizer, self.optimizer_d.
OPTIMIZER_NAME = re.compile(r"^(opt|optim|optimizer|optimiser)([_0-9A-Z]\w*)?$|^\w+_(opt|optim|optimizer)$")
# Words in the last part of a class's qualified name that make it worth asking whether it is an optimizer
# (a project's own class: its bases are looked up only then).
OPTIMIZER_WORDS = re.compile(r"adam|optim|sgd|lamb|lion|adafactor|rmsprop|adagrad|lars", re.IGNORECASE)

# Anything in a scope that controls DDP's gradient synchronisation during accumulation.
SYNC_CONTROLS = frozenset(
    {"no_sync", "no_backward_sync", "require_backward_grad_sync", "accumulate", "skip_sync", "sync_gradients"}
)
# Names that set Accelerate up for an engine other than DDP (see ``training.prepared_models``).
OTHER_ENGINES = ("deepspeed", "fsdp", "fullyshardeddataparallel")


def is_step_count_name(name: str) -> bool:
    """``accum_steps``, ``gradient_accumulation_steps``, ``accumulate_grad_batches``, ``grad_accum``...
    but not ``accum_tokens`` or ``accum_loss`` (a token count or a running total)."""
    lowered = name.lower()
    if not ("accum" in lowered or lowered in ("gas", "grad_acc", "n_acc")):
        return False
    return not any(part in lowered for part in NOT_A_STEP_COUNT)


# DistributedDataParallel under its public names.
DDP_CLASSES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DistributedDataParallel",
    }
)

# Signs that the file trains with more than one process.
DATA_PARALLEL = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.distributed.init_process_group",
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard",
        "accelerate.Accelerator",
        "deepspeed.initialize",
        "lightning.Fabric",
        "lightning.fabric.Fabric",
        "lightning.fabric.strategies.FSDPStrategy",
        "lightning.fabric.strategies.DDPStrategy",
    }
)

# BatchNorm modules, whose forward in training mode updates running statistics (TL203).
BATCHNORM_CLASSES = frozenset(
    f"torch.nn.{name}" for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")
) | frozenset(f"torch.nn.modules.batchnorm.{name}" for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"))

# Dropout, as a module or a function: draws random numbers in training mode (TL204).
DROPOUT_MODULES = frozenset(
    f"torch.nn.{name}" for name in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout")
)
DROPOUT_CALLS = DROPOUT_MODULES | frozenset(
    f"torch.nn.functional.{name}" for name in ("dropout", "dropout1d", "dropout2d", "dropout3d")
)

# FSDP1 (the module wrapper) under its public names (TL503, TL506).
FSDP_CLASSES = frozenset(
    {
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
    }
)
# FSDP2: shards a module in place and replaces its parameters by DTensors (TL503).
FULLY_SHARD = frozenset(
    {
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard.fully_shard",
    }
)
# Data samplers that shard and shuffle by an epoch seed (TL505).
DISTRIBUTED_SAMPLERS = frozenset(
    {"torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler"}
)
DEEPSPEED_INITIALIZE = frozenset({"deepspeed.initialize"})
# FSDP's mixed-precision configurations (TL110): FSDP1's MixedPrecision and FSDP2's policy.
FSDP_MIXED_PRECISION = frozenset(
    {
        "torch.distributed.fsdp.MixedPrecision",
        "torch.distributed.fsdp.fully_sharded_data_parallel.MixedPrecision",
        "torch.distributed.fsdp.api.MixedPrecision",
        "torch.distributed.fsdp.MixedPrecisionPolicy",
        "torch.distributed._composable.fsdp.MixedPrecisionPolicy",
        "torch.distributed.fsdp._fully_shard.MixedPrecisionPolicy",
    }
)
# The word in a flag that selects DeepSpeed's code path (TL504): `if args.deepspeed:`,
# `if not self.use_deepspeed:`.
DEEPSPEED_SWITCH = "deepspeed"


# -- measurement (TL401-TL404) -----------------------------------------------------------------------------
DEVICE_MODULES = ("torch.cuda", "torch.cuda.memory", "torch.xpu", "torch.xpu.memory", "torch.mps")
PEAK_READINGS = frozenset(
    f"{m}.{f}" for m in DEVICE_MODULES for f in ("max_memory_allocated", "max_memory_reserved")
)
MEMORY_READINGS = PEAK_READINGS | frozenset(
    f"{m}.{f}" for m in DEVICE_MODULES for f in ("memory_allocated", "memory_reserved", "mem_get_info")
)
# Calls that reset the peak a reading reports (any receiver: ``torch.cuda`` or a device module alias).
RESET_METHODS = frozenset(
    {"reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached"}
)
EMPTY_CACHE = frozenset({"torch.cuda.empty_cache", "torch.cuda.memory.empty_cache", "torch.xpu.empty_cache"})
# Calls that hand an optimizer over without stepping it (Accelerate, Fabric, DeepSpeed...).
OPTIMIZER_WRAPPERS = frozenset(
    {"prepare", "setup", "setup_optimizers", "initialize", "prepare_optimizer", "register_optimizer"}
)
# Wall clocks an interval is read with.
CLOCKS = frozenset(
    {
        "time.time",
        "time.perf_counter",
        "time.monotonic",
        "time.time_ns",
        "time.perf_counter_ns",
        "time.monotonic_ns",
        "timeit.default_timer",
    }
)
# Calls that wait for the device: explicit synchronisation and device-to-host copies.
SYNC_METHODS = frozenset({"synchronize", "item", "tolist", "cpu", "numpy", "barrier", "mark_step", "wait"})

# -- checkpointing and attention (TL205, TL405) ------------------------------------------------------------
# Calls that make the checkpointed blocks' inputs require grad, which is all the reentrant variant
# needs (PEFT's prepare_model_for_kbit_training calls enable_input_require_grads itself; the hook idiom
# `make_inputs_require_grad` and DeepSpeed-Chat's helper do the same by hand).
INPUT_GRAD_FIXES = (
    "enable_input_require_grads",
    "prepare_model_for_kbit_training",
    "prepare_model_for_int8_training",
    "make_inputs_require_grad",
    "prepare_model_for_gradient_checkpointing",
    "gradient_checkpointing_compatible",
)
# torch's fused attention kernels: a module that calls one does not materialise the scores
SDPA = frozenset(
    {"torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward"}
)
