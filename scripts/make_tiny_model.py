"""Write a tiny random-weight Llama model with a locally trained tokenizer into a directory.

Run it with the Python of the vLLM environment (it needs torch, transformers and
tokenizers); it downloads nothing. The result is well under 1 MB and is enough for
`vllm serve` to load, answer chat completions and export real metrics and spans.

    .venv-vllm/bin/python scripts/make_tiny_model.py OUTPUT_DIR

With `--diffusion CLASS` it writes instead a diffusion model directory for vLLM-Omni: only
a `model_index.json` naming CLASS, a pipeline a plugin registers whose weights are random
in its own code (the vLLM-Omni test harness registers one).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# Everything is built here; an accidental hub lookup must fail rather than hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "You are a helpful assistant.",
    "What is vLLM? vLLM is a fast engine for serving large language models.",
    "The watchdog sees a stalled stage, captures its stacks and cleans up the processes.",
    "Hello, world! Tell me a short story about a cat, a dog and a small red boat.",
    "One two three four five six seven eight nine ten. 0123456789",
]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is in the vocabulary, so any text the tests send can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def make_model(output: Path, seed: int = 0, architecture: str | None = None) -> Path:
    """Save the tokenizer and a 2-layer Llama with random bf16 weights into `output`.

    `architecture` renames the model class in its config, for a serving stack that
    registers its own class under that name (the vLLM-Omni test harness does).
    """
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=512)
    tokenizer.save_pretrained(output)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(output, safe_serialization=True)
    if architecture is not None:
        # save_pretrained writes the saving class's name; the config must name the other.
        config_path = output / "config.json"
        saved = json.loads(config_path.read_text())
        saved["architectures"] = [architecture]
        config_path.write_text(json.dumps(saved, indent=2) + "\n")
    return output


# The diffusers release the tiny diffusion model's index claims; vLLM-Omni reads only the
# class name.
DIFFUSERS_VERSION = "0.40.0"


def make_diffusion_model(output: Path, class_name: str) -> Path:
    """Write a diffusion model directory: `model_index.json` naming `class_name`, nothing
    else."""
    output.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION}
    (output / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--architecture", help="model class name to write into the config")
    parser.add_argument(
        "--diffusion",
        metavar="CLASS",
        help="write a diffusion model directory naming this registered pipeline class instead",
    )
    arguments = parser.parse_args()
    if arguments.diffusion is not None:
        print(make_diffusion_model(arguments.output, arguments.diffusion))
        return
    print(make_model(arguments.output, arguments.seed, arguments.architecture))


if __name__ == "__main__":
    main()
