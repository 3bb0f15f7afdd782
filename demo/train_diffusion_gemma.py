"""Train the bundled DiffusionGemma demo model (demo/diffusion_gemma_sort) from a seed.

The model is a real transformers DiffusionGemmaForBlockDiffusion (tiny: vocab
128, hidden 64, 4 layers, 4 experts, canvas 8) trained with the family's own
objective on the digit-sorting task of demo/task.py:

* a training sequence is the chat prompt plus the answer (answer, <turn|>,
  then <pad> to a whole number of canvases); one encoder pass over it gives
  the prefix KV cache of every canvas boundary (the encoder is causal), and
  every answer canvas is denoised by the decoder from the cache of the tokens
  before it, as generate() does;
* uniform renoising: each canvas token is replaced by a uniformly random
  vocabulary token with probability t ~ U(0, 1) (what generate's renoising
  feeds the decoder);
* self-conditioning: on half of the batches a first pass without
  self-conditioning runs under no_grad, and its logits divided by a sampling
  temperature in [t_min, t_max] are fed as `self_conditioning_logits` to the
  second pass, which carries the loss;
* cross-entropy on the clean canvas, through encoder (prefix KV cache) and decoder.

Runs on CPU (1-2 threads) in well under an hour; checkpoints periodically so
an interrupted run still leaves a usable model, evaluates with transformers'
own `generate` (the float reference) on the held-out set, and records the
result in the checkpoint's README.md and training_summary.json.

Run from the repository root, as a module (it shares code with tests/):

    .venv/bin/python -m demo.train_diffusion_gemma --out demo/diffusion_gemma_sort
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import time
from pathlib import Path

from demo import task as demo_task

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 128
CANVAS = 8
TURN_END = 106  # <turn|>: ends the model turn (an eos id in generation_config.json)
PAD = 0
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, sliding_window=64, num_experts=4, top_k_experts=2,
    moe_intermediate_size=64, use_bidirectional_attention="vision", eos_token_id=[1, TURN_END],
    max_position_embeddings=512,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
)
VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
    position_embedding_size=16,
)
# The released sampler defaults (google/diffusiongemma-26B-A4B-it generation_config.json);
# max_new_tokens = 4 canvases.
GENERATION = {
    "confidence_threshold": 0.005, "eos_token_id": [1, TURN_END, 50], "max_denoising_steps": 48,
    "max_new_tokens": 4 * CANVAS, "pad_token_id": PAD, "bos_token_id": 2,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "stability_threshold": 1, "t_max": 0.8, "t_min": 0.4,
}


def build_model(seed: int, text_overrides: dict | None = None):
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    config = DiffusionGemmaConfig(
        text_config=dict(TEXT, **(text_overrides or {})), vision_config=VISION, canvas_length=CANVAS,
        image_token_id=VOCAB - 1, boi_token_id=VOCAB - 3, eoi_token_id=VOCAB - 2,
        eos_token_id=[1, TURN_END],
    )
    torch.manual_seed(seed)
    return DiffusionGemmaForBlockDiffusion(config)


class Data:
    """Tokenized training examples, grouped so one batch shares its prefix length."""

    def __init__(self, tokenizer, seed: int):
        self.tok = tokenizer
        self.rng = random.Random(seed)

    def prompt_ids(self, digits: str) -> list[int]:
        return self.tok.apply_chat_template(
            demo_task.messages(digits), add_generation_prompt=True, tokenize=True,
            return_dict=False)

    def answer_ids(self, digits: str) -> list[int]:
        ids = self.tok.encode(demo_task.answer_text(digits), add_special_tokens=False) + [TURN_END]
        return ids + [PAD] * (-len(ids) % CANVAS)

    def batch(self, size: int):
        """(sequences [B, P + K*L], P, K): prompts of one length n with their
        answers padded to K canvases (one batch shares its prefix lengths)."""
        import torch

        n = self.rng.randint(demo_task.MIN_DIGITS, demo_task.MAX_DIGITS)
        rows = []
        while len(rows) < size:
            d = demo_task.sample_digits(self.rng, n)
            if not demo_task.in_heldout(d):
                rows.append(self.prompt_ids(d) + self.answer_ids(d))
        P = len(self.prompt_ids("0" * n))
        return torch.tensor(rows), P, (len(rows[0]) - P) // CANVAS


def prefix_cache(full, length: int, text_config):
    """A DynamicCache holding the first `length` positions of `full`. The
    encoder is causal, so this is exactly the cache of encoding those tokens alone."""
    from transformers import DynamicCache

    cache = DynamicCache(config=text_config)
    for i, layer in enumerate(full.layers):
        cache.update(layer.keys[:, :, :length], layer.values[:, :, :length], i)
    return cache


def decoder_logits(model, canvas, cache, sc_logits=None):
    """The decoder pass of DiffusionGemmaForBlockDiffusion.forward (lm_head, softcap)."""
    import torch

    hidden = model.model.decoder(decoder_input_ids=canvas, cache=cache,
                                 self_conditioning_logits=sc_logits).last_hidden_state
    cap = model.final_logit_softcapping
    return torch.tanh(model.lm_head(hidden).float() / cap) * cap


def train_step(model, seqs, P: int, K: int, gen, use_sc: bool):
    """Loss over every answer canvas of the batch.

    One encoder pass over prompt + answer canvases 0..K-2 gives the prefix
    cache of every canvas boundary; each canvas k is then renoised
    (uniform tokens with probability t ~ U(0, 1) per example) and denoised
    by the decoder from the cache of the P + k*L tokens before it. With
    self-conditioning, a first decoder pass (no grad) provides the logits,
    divided by a sampling temperature T ~ U(t_min, t_max), for the second.
    """
    import torch
    import torch.nn.functional as F

    B = seqs.shape[0]
    text_config = model.config.get_text_config(decoder=True)
    full = model.model.encoder(input_ids=seqs[:, : P + (K - 1) * CANVAS]).cache
    loss = 0.0
    for k in range(K):
        start = P + k * CANVAS
        target = seqs[:, start:start + CANVAS]
        t = torch.rand(B, 1, generator=gen)
        noisy = torch.rand(target.shape, generator=gen) < t
        canvas = torch.where(noisy, torch.randint(0, VOCAB, target.shape, generator=gen), target)
        sc = None
        if use_sc:
            with torch.no_grad():
                first = decoder_logits(model, canvas, prefix_cache(full, start, text_config))
            sc = first / (0.4 + 0.4 * torch.rand(B, 1, 1, generator=gen))
        logits = decoder_logits(model, canvas, prefix_cache(full, start, text_config), sc)
        loss = loss + F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    return loss / K


def evaluate(model, data: Data, digits_list: list[str], max_denoising_steps: int | None = None):
    """Held-out accuracy and denoising statistics with transformers' own generate (batch 1)."""
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
    )

    gen_cfg = copy.deepcopy(GENERATION)  # the config class pops keys from nested dicts
    if max_denoising_steps:
        gen_cfg["max_denoising_steps"] = max_denoising_steps
    cfg = DiffusionGemmaGenerationConfig(**gen_cfg)
    # The encoder runs once per canvas, the decoder once per denoising step:
    # the decoder calls between two encoder calls are that canvas's steps.
    calls: list[str] = []
    hooks = [model.model.encoder.register_forward_hook(lambda *a: calls.append("E")),
             model.model.decoder.register_forward_hook(lambda *a: calls.append("D"))]
    model.eval()
    correct = multi = multi_ok = 0
    per_canvas: list[int] = []
    try:
        with torch.no_grad():
            for d in digits_list:
                ids = torch.tensor([data.prompt_ids(d)])
                calls.clear()
                out = model.generate(ids, generation_config=cfg).sequences[0, ids.shape[1]:].tolist()
                per_canvas += [len(c) for c in "".join(calls).split("E")[1:]]
                text = data.tok.decode([i for i in out if i not in (PAD, TURN_END, 1)])
                ok = demo_task.is_correct(d, text) and TURN_END in out
                correct += ok
                if demo_task.num_blocks(d, CANVAS) > 1:
                    multi += 1
                    multi_ok += ok
    finally:
        for h in hooks:
            h.remove()
        model.train()
    n = len(digits_list)
    cap = cfg.max_denoising_steps
    return {
        "accuracy": correct / n, "n": n, "multi_canvas_accuracy": multi_ok / max(multi, 1),
        "multi_canvas_n": multi, "canvases": len(per_canvas),
        "steps_per_canvas": sum(per_canvas) / max(len(per_canvas), 1),
        "early_stop_rate": sum(s < cap for s in per_canvas) / max(len(per_canvas), 1),
    }


def save(model, tokenizer_dir: Path, out: Path, summary: dict | None = None) -> None:
    """Write the hub-layout checkpoint to a temporary sibling, then swap it in."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    cfg = json.loads((tmp / "config.json").read_text())
    tc = cfg["text_config"]  # hub form, as released: flat global_head_dim keys
    tc.pop("per_layer_config", None)
    tc["global_head_dim"] = TEXT["global_head_dim"]
    tc["num_global_key_value_heads"] = TEXT["num_global_key_value_heads"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    demo_task.publish_checkpoint(tmp, out, tokenizer_dir, summary,
                                 model_card(summary) if summary is not None else None)


def model_card(s: dict) -> str:
    ev = s.get("eval", {})
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [dlm-demo, diffusion_gemma]
---
# DiffusionGemma digit-sorting demo ({s['parameters']:,} parameters)

A tiny `DiffusionGemmaForBlockDiffusion` (transformers {s['transformers']}) trained from seed {s['seed']}
by `demo/train_diffusion_gemma.py` on the task of `demo/task.py`: the user
message `sort <digits>` ({demo_task.MIN_DIGITS}-{demo_task.MAX_DIGITS} digits) is answered with the digits in
ascending order. Canvas length {CANVAS}, so answers of 8 or more digits span several canvases.

Held-out accuracy with transformers' `generate` and the released sampler defaults
(`generation_config.json`), float32, {ev.get('n')} prompts: **{ev.get('accuracy', float('nan')):.1%}**
(multi-canvas answers: {ev.get('multi_canvas_accuracy', float('nan')):.1%} of {ev.get('multi_canvas_n')}),
{ev.get('steps_per_canvas', float('nan')):.2f} denoising steps per canvas (cap {GENERATION['max_denoising_steps']}); the early-stop
rule ended {ev.get('early_stop_rate', float('nan')):.1%} of {ev.get('canvases')} canvases before the cap.
Training: {s['steps']} steps, {s['train_seconds']:.0f} s on CPU.

**Text only.** The model was trained on text alone. Its checkpoint holds a vision tower only because
transformers cannot build `DiffusionGemmaForBlockDiffusion` without one: that tower is transformers'
untrained initialization, frozen during training, and the tokenizer has no image token. Convert it with
`dlm-convert demo/diffusion_gemma_sort --text-only` (as `scripts/demo.sh` does): the conversion is then a
text-generation model and `dlm-run serve` takes it without an image warning.

**Single-turn.** It was trained on one prompt form, `sort <digits>`, answered in one turn: it answers a
first `sort ...` turn, and `dlm-run chat` looks broken from the second turn on (a context it never saw).
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "demo" / "diffusion_gemma_sort")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=TEXT["hidden_size"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-n", type=int, default=40, help="held-out prompts for periodic evals")
    ap.add_argument("--final-n", type=int, default=200, help="held-out prompts for the final eval")
    ap.add_argument("--eval-steps", type=int, default=None,
                    help="cap max_denoising_steps in evaluations (smoke tests); default: the checkpoint's")
    ap.add_argument("--time-limit", type=float, default=50 * 60, help="stop training after this many seconds")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    from tests.builders import build_diffusion_gemma_tokenizer

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    tok_dir = args.out.with_name(args.out.name + ".tokenizer")
    shutil.rmtree(tok_dir, ignore_errors=True)
    build_diffusion_gemma_tokenizer(VOCAB, tok_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    data = Data(tokenizer, args.seed)
    model = build_model(args.seed, {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden}).train()
    params = [p for n, p in model.named_parameters() if ".vision_tower." not in n and ".embed_vision." not in n]
    for n, p in model.named_parameters():
        p.requires_grad_(".vision_tower." not in n and ".embed_vision." not in n)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, min(200, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    sc_rng = random.Random(args.seed + 1)
    heldout = demo_task.heldout_set(args.final_n)
    small = heldout[:: max(1, len(heldout) // args.eval_n)][: args.eval_n]
    print(f"parameters {n_params:,}; training {args.steps} steps of batch {args.batch}", flush=True)

    t0 = time.time()
    ema = None
    step = 0
    for step in range(1, args.steps + 1):
        seqs, P, K = data.batch(args.batch)
        loss = train_step(model, seqs, P, K, gen, use_sc=sc_rng.random() < 0.5)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            print(f"step {step} loss {ema:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluate(model, data, small, args.eval_steps)
            print(f"step {step} eval {json.dumps(ev)}", flush=True)
            save(model, tok_dir, args.out)
        if time.time() - t0 > args.time_limit:
            print(f"time limit reached at step {step}", flush=True)
            break
    train_seconds = time.time() - t0
    model.eval()
    ev = evaluate(model, data, heldout, args.eval_steps)
    print(f"final eval {json.dumps(ev)}", flush=True)
    summary = {
        "seed": args.seed, "steps": step, "batch": args.batch, "lr": args.lr,
        "train_seconds": train_seconds, "threads": args.threads, "parameters": n_params,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "final_loss_ema": ema, "eval": ev,
    }
    save(model, tok_dir, args.out, summary)
    shutil.rmtree(tok_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
