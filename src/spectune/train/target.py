"""Target fine-tuning with QLoRA: the base loaded in 4-bit NF4 (bitsandbytes), a LoRA adapter on every linear
layer (peft), trained by TRL's SFTTrainer on assistant tokens only. `merge` folds the adapter into the NF4 base it
was trained on, dequantized to 32-bit, ready for GGUF export.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from spectune.atomic import atomic_path
from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.models.load import load_tokenizer, save_tokenizer
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.threads import configure_torch_threads
from spectune.train.common import (
    TrainConfig,
    TrainResult,
    TrainSettings,
    console,
    folder_bytes,
    has_cuda,
    load_task_data,
    train_and_save,
    trainer_settings,
    write_report,
)


class FinetuneSettings(TrainSettings):
    """QLoRA's settings: the `finetune:` section of a run config and the flags of `spectune finetune`."""

    four_bit: bool = Field(True, description="QLoRA (NF4 4-bit base) or, off, plain LoRA on a 16/32-bit base.")
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: list[str] | str = Field("all-linear", description="Layers that get an adapter.")


class FinetuneConfig(FinetuneSettings, TrainConfig):
    """Everything `spectune finetune` takes."""

    model: Path = Field(description=f"The target: {MODEL_REFERENCE}.")


class FinetuneResult(TrainResult):
    adapter: Path
    trainable_parameters: int
    total_parameters: int
    adapter_bytes: int
    four_bit: bool  # read off the model trained: its base held NF4 weights
    nf4_linear_layers: int


def compute_dtype() -> Any:
    """bf16 on a GPU that has it, else f32 (CPU)."""
    import torch

    return torch.bfloat16 if has_cuda() and torch.cuda.is_bf16_supported() else torch.float32


def fsdp_launch() -> bool:
    """Whether `accelerate launch` started this process with an FSDP config (configs/accelerate/)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


def local_device() -> int | str:
    """This process's GPU (torchrun's LOCAL_RANK: each rank its own), else the CPU."""
    return int(os.environ.get("LOCAL_RANK", "0")) if has_cuda() else "cpu"


def quantization_config() -> Any:
    """NF4 with double quantization. Under FSDP the 4-bit weights are stored in the compute dtype: FSDP shards only
    floating-point tensors, so uint8 storage would not be sharded (bitsandbytes' FSDP-QLoRA)."""
    from transformers import BitsAndBytesConfig

    storage = {"bnb_4bit_quant_storage": compute_dtype()} if fsdp_launch() else {}
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype(),
        **storage,
    )


def load_base(model_dir: Path, four_bit: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32 if not has_cuda() else "auto"}
    if four_bit:
        kwargs["quantization_config"] = quantization_config()
        if fsdp_launch():  # every rank loads the same way and FSDP places the shards; dtype = the 4-bit storage
            kwargs["dtype"] = compute_dtype()
        else:
            kwargs["device_map"] = {"": local_device()}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise SpectuneError(f"{model_dir}: cannot load the model: {exc}") from exc
    # On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights at the first eval-mode forward into an
    # inference-only layout with no autograd kernel: training after the trainer's first evaluation then dropped the
    # gradient through every frozen layer ("gemv_4bit: an autograd kernel was not registered"), and biased layers
    # (Qwen2) failed outright. Keep the trainable layout.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def _smallest_layer_width(model: Any) -> int:
    import torch

    widths = [min(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    bnb_widths = [min(m.in_features, m.out_features) for m in model.modules() if hasattr(m, "quant_state")]
    return min(widths + bnb_widths)


def add_lora(model: Any, config: FinetuneConfig) -> Any:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    width = _smallest_layer_width(model)
    if config.lora_r > width:
        raise SpectuneError(f"lora_r = {config.lora_r} is larger than the narrowest layer ({width}): lower --lora-r")
    if config.four_bit:
        checkpointing = config.gradient_checkpointing if config.gradient_checkpointing is not None else has_cuda()
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def finetune(config: FinetuneConfig) -> FinetuneResult:
    """QLoRA (or LoRA with four_bit=False) SFT of a target on task data; returns where the adapter is."""
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    from spectune.train.steps import show_steps  # imports transformers

    configure_torch_threads()
    config = config.model_copy(update={"model": resolve_model(config.model)})
    tokenizer = load_tokenizer(config.model, config.chat_template)
    data = load_task_data(tokenizer, config)
    set_seed(config.seed)  # LoRA init too: a run is reproducible, and --resume continues the same run
    model = add_lora(load_base(config.model, config.four_bit), config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    settings = trainer_settings(config)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**settings),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
    )
    if not trainer.args.bf16:
        # TRL casts QLoRA adapters to bf16 (QLoRA paper); without bf16 hardware keep f32, which is also what
        # peft restores on --resume, so a resumed run continues exactly.
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    steps = trainer.args.max_steps if trainer.args.max_steps > 0 else _planned_steps(trainer)
    tokens_per_step = data.trained_tokens / max(1, len(data.train)) * config.batch_size * config.grad_accum
    console.print(
        f"{'QLoRA (NF4)' if config.four_bit else 'LoRA'} on {config.model}: trainable {trainable:,} of {total:,} "
        f"parameters ({100 * trainable / total:.2f}%), {len(data.train)} dialogues, {steps} steps, "
        f"~{tokens_per_step:,.0f} trained tokens per step"
    )
    adapter = config.out / "adapter"
    show_steps(trainer, "QLoRA" if config.four_bit else "LoRA")
    outcome = train_and_save(trainer, tokenizer, config, adapter, data)
    nf4_layers = count_nf4_layers(trainer.model)
    result = FinetuneResult(
        **outcome.model_dump(),
        adapter=adapter,
        trainable_parameters=trainable,
        total_parameters=total,
        adapter_bytes=folder_bytes(adapter),
        four_bit=nf4_layers > 0,
        nf4_linear_layers=nf4_layers,
    )
    write_report(config.out / "finetune.json", config, result, data)
    return result


def count_nf4_layers(model: Any) -> int:
    """How many linear layers of `model` hold NF4 4-bit weights (bitsandbytes): what QLoRA really trained on."""
    import bitsandbytes as bnb

    return sum(
        isinstance(module, bnb.nn.Linear4bit) and module.weight.quant_state.quant_type == "nf4"
        for module in model.modules()
    )


def _planned_steps(trainer: Any) -> int:
    import math

    args = trainer.args
    per_epoch = math.ceil(
        len(trainer.train_dataset) / (args.per_device_train_batch_size * args.gradient_accumulation_steps)
    )
    return math.ceil(per_epoch * args.num_train_epochs)


MERGE_TOLERANCE = 1e-3  # merged logits within this of base + adapter, or the merge is refused


class MergeResult(BaseModel):
    model: Path
    max_logit_diff: float
    checked_tokens: int
    merged_into: str  # "nf4 base, dequantized" (the model as trained) or "unquantized base"


def merge_base(base: Path, four_bit: bool) -> Any:
    """The weights the adapter is folded into. After QLoRA, the NF4 base it was trained on, dequantized to f32: the
    merged model is then the model that was trained and evaluated (merging into the unquantized original instead
    changed the greedy answers of Gemma 3 270M on 18 of 20 SGD prompts: merge_check_gemma3_270m_sgd.json, in git at
    fac0e59)."""
    import torch

    if not four_bit:
        return load_base(base, four_bit=False)
    model = load_base(base, four_bit=True)
    return model.dequantize(dtype=torch.float32).to("cpu")


class MergeConfig(Settings):
    """Everything `spectune merge` takes."""

    base: Path = Field(description=f"The base the adapter was trained on: {MODEL_REFERENCE}.")
    adapter: Path = Field(description="The LoRA adapter folder.")
    out: Path = Field(description="Where to write the merged HF model.")
    four_bit: bool = Field(
        True, description="The adapter was trained on the NF4 base (QLoRA): merge into it, dequantized."
    )


def merge(config: MergeConfig) -> MergeResult:
    """Fold a (Q)LoRA adapter into the base it was trained on (`four_bit`: the NF4 base, dequantized); checks
    merged == base + adapter."""
    import torch
    from peft import PeftModel

    base, adapter, out, four_bit = resolve_model(config.base), config.adapter, config.out, config.four_bit
    if not (adapter / "adapter_config.json").is_file():
        raise SpectuneError(f"{adapter}: not a LoRA adapter folder (no adapter_config.json)")
    tokenizer = load_tokenizer(adapter if (adapter / "tokenizer_config.json").is_file() else base)
    with_adapter = PeftModel.from_pretrained(merge_base(base, four_bit), str(adapter))
    with_adapter.eval()
    probe = tokenizer(
        "Hello! I would like to book an appointment for Tuesday at 3 pm, please.",
        return_tensors="pt",
        add_special_tokens=False,
    )["input_ids"]
    with torch.no_grad():
        expected = with_adapter(input_ids=probe).logits
        merged = with_adapter.merge_and_unload()
        got = merged(input_ids=probe).logits
    diff = float((expected - got).abs().max())
    if diff > MERGE_TOLERANCE:
        raise SpectuneError(f"merged logits differ from base + adapter by {diff:.2e} (> {MERGE_TOLERANCE:.0e})")
    with atomic_path(out) as tmp:
        merged.save_pretrained(str(tmp))
        save_tokenizer(tokenizer, tmp)
    into = "nf4 base, dequantized" if four_bit else "unquantized base"
    return MergeResult(model=out, max_logit_diff=diff, checked_tokens=int(probe.numel()), merged_into=into)
