"""Builds the tiny, randomly initialised models the vLLM tier serves, from nothing: no model
hub, no downloads. Deterministic (fixed seeds), a few seconds, ~4 MB each.

    python tiny_models.py OUT_DIR   ->  OUT_DIR/tiny-llama, OUT_DIR/tiny-llava,
                                        OUT_DIR/tiny-llama-b (another model: other weights, one
                                        more layer), OUT_DIR/tiny-lora (a LoRA adapter of
                                        tiny-llama in PEFT's layout)

Run it with the vLLM venv's python (it needs torch, tokenizers, transformers, safetensors).
Sizes follow what vLLM's CPU backend accepts: head_dim 32 (16 is refused), bf16 at run time.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

SEED = 11
SECOND_SEED = 29
#: Built after the first two, each with its own stamp, so an existing model dir gains them.
EXTRAS = ("tiny-llama-b", "tiny-lora")
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")
VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IMAGE_TOKEN = "<image>"
READY = ".complete"
SEED_TEXT = (
    "the quick brown fox jumps over lazy dog hello world what is your name tell me a story "
    "about cats dogs birds one two three four five six seven eight nine ten yes no maybe "
    "system user assistant prefill decode encode cache server proxy request response token"
)
#: ChatML-style turns; list contents keep their text parts (and, for LLaVA, image slots).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}IMAGE_SLOT"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = SEED_TEXT.split() + ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
                          for _ in range(2500)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) + rng.choice(".?!,")
             for _ in range(20000)]
    return lines + ["0123456789 {}[]()<>\"'`~@#$%^&*-_=+|/\\;:"] * 8


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (any input text encodes), trained on generated words."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS, PAD, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE.replace("IMAGE_SLOT", "")
    return fast


def text_config(tok: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)


def _generation_config(tok: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)


def build_llama(out: Path) -> PreTrainedTokenizerFast:
    torch.manual_seed(SEED)
    tok = build_tokenizer()
    tok.save_pretrained(out)
    LlamaForCausalLM(text_config(tok)).to(torch.float32).save_pretrained(out)
    _generation_config(tok).save_pretrained(out)
    return tok


def build_second_llama(out: Path) -> None:
    """Another text model for the multi-model cases: same tokenizer, other weights and depth,
    so its greedy answers differ from tiny-llama's."""
    torch.manual_seed(SECOND_SEED)
    tok = build_tokenizer()
    tok.save_pretrained(out)
    cfg = text_config(tok)
    cfg.num_hidden_layers = 3
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    _generation_config(tok).save_pretrained(out)


def build_lora(out: Path, base: Path) -> None:
    """A rank-8 LoRA adapter of tiny-llama's attention (q_proj, v_proj), as PEFT saves one:
    ``adapter_config.json`` and ``adapter_model.safetensors``. Its B matrices are not zero (a
    trained adapter's are not), so it changes what the model says."""
    torch.manual_seed(SEED + 1)
    cfg = LlamaConfig.from_pretrained(base)
    sizes = {"q_proj": cfg.num_attention_heads * cfg.head_dim,
             "v_proj": cfg.num_key_value_heads * cfg.head_dim}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in LORA_TARGETS:
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(LORA_RANK, cfg.hidden_size) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[module], LORA_RANK) * 0.5
    save_file({k: v.contiguous() for k, v in tensors.items()},
              out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(LORA_TARGETS), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=2))


def build_llava(out: Path, tok: PreTrainedTokenizerFast) -> None:
    """A CLIP tower on 28x28 images (patch 14: 4 image tokens) in front of the same Llama."""
    torch.manual_seed(SEED)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=28, patch_size=14,
                              projection_dim=64)
    cfg = LlavaConfig(vision_config=vision, text_config=text_config(tok),
                      image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                      vision_feature_select_strategy="default", vision_feature_layer=-2,
                      projector_hidden_act="gelu")
    LlavaForConditionalGeneration(cfg).to(torch.float32).save_pretrained(out)
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                   vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                   num_additional_image_tokens=1,
                   chat_template=CHAT_TEMPLATE.replace("IMAGE_SLOT", IMAGE_TOKEN + "\n"),
                   ).save_pretrained(out)
    _generation_config(tok).save_pretrained(out)
    _rename_vision_tower(out / "model.safetensors")


def _rename_vision_tower(path: Path) -> None:
    """vLLM loads LLaVA's CLIP tower from ``vision_tower.vision_model.*`` (the released
    checkpoints' layout); transformers 5 writes ``vision_tower.*``."""
    prefix, wanted = "vision_tower.", "vision_tower.vision_model."
    weights = load_file(path)
    renamed = {(wanted + k[len(prefix):] if k.startswith(prefix) and not k.startswith(wanted)
                else k): v.contiguous() for k, v in weights.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def main() -> None:
    root = Path(sys.argv[1])
    llama, llava = root / "tiny-llama", root / "tiny-llava"
    if not (root / READY).exists():
        llama.mkdir(parents=True, exist_ok=True)
        llava.mkdir(parents=True, exist_ok=True)
        tok = build_llama(llama)
        build_llava(llava, tok)
    builders = {"tiny-llama-b": build_second_llama,
                "tiny-lora": lambda out: build_lora(out, llama)}
    for name in EXTRAS:
        out = root / name
        if not (out / READY).exists():
            out.mkdir(parents=True, exist_ok=True)
            builders[name](out)
            (out / READY).touch()
    (root / READY).touch()
    print(f"tiny models ready in {root}")


if __name__ == "__main__":
    main()
