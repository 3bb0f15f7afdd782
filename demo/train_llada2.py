"""Train the bundled LLaDA-2 demo model (demo/llada2_sort) from a seed.

The model is dlm's independent PyTorch LLaDA2.0-MoE reference
(dlm.verify.llada2_moe.torch_model: hub tensor names, group-limited sigmoid routing with
expert_bias, shared expert, partial RoPE), tiny (vocab 256, hidden 64, 3
layers: 1 dense + 2 MoE with 8 experts), trained on the digit-sorting task of
demo/task.py with masked, block-structured diffusion:

* blocks of BLOCK tokens at absolute positions, as LLaDA-2's generate() cuts
  them (the first answer block may hold the prompt's tail); the sequence ends
  with the block holding the answer's <|endoftext|> (filled with it);
* each block's answer tokens are replaced by <|mask|> with its own
  probability t ~ U(0, 1); the prompt is never masked;
* one forward over [x_t ; x_0] (noisy then clean copy, same positions) with
  the tech report's training mask: an x_t block sees itself and the earlier
  clean blocks, exactly the block-causal view generate() gives it, so every
  block is trained in one pass; cross-entropy on the masked positions;
* expert_bias is adjusted after each step by the auxiliary-loss-free balancing
  rule (raise the bias of under-used experts), so it is non-zero as in real
  checkpoints.

It is evaluated with the reference's generate() (greedy fix, the checkpoint's
block_length / steps / threshold, dlm's early block stop) on the held-out set,
and the result is recorded in the checkpoint's README.md and
training_summary.json.

Run from the repository root, as a module (it shares code with tests/):

    .venv/bin/python -m demo.train_llada2 --out demo/llada2_sort
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

from demo import task as demo_task

ROOT = Path(__file__).resolve().parents[1]

BLOCK = 8
GEOMETRY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=64,
    first_k_dense_replace=1, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=600000.0,
    partial_rotary_factor=0.5, rms_norm_eps=1e-6, max_position_embeddings=512,
)
BIAS_RATE = 1e-3  # aux-loss-free balancing step on expert_bias


def ids():
    """(eos, mask) ids of the tiny LLaDA tokenizer."""
    from tests.builders import LLADA2_EOS_ID, LLADA2_MASK_ID

    return LLADA2_EOS_ID, LLADA2_MASK_ID


def generation_config() -> dict:
    eos, mask = ids()
    # dlm's LLaDA-2 runtime reads block_length / steps / threshold from here
    # (the hub ships them as generate() defaults; 32/32/0.95 there).
    return {
        "eos_token_id": eos, "pad_token_id": eos, "mask_token_id": mask,
        "block_length": BLOCK, "steps": BLOCK, "threshold": 0.95, "temperature": 0.0,
        "max_new_tokens": 4 * BLOCK,
    }


def build_model(seed: int):
    import torch

    from dlm.verify.llada2_moe.torch_model import LLaDA2Reference, RefConfig
    from tests.builders import llada2_hub_config

    cfg = llada2_hub_config("base", **GEOMETRY)
    cfg["rotary_dim"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    torch.manual_seed(seed)
    model = LLaDA2Reference(RefConfig.from_dict(cfg))
    with torch.no_grad():  # the reference leaves some parameters uninitialized
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            elif "word_embeddings" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.5 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
    return model, cfg


def forward_train(model, input_ids, mask, positions):
    """The reference forward (LLaDA2Reference.forward) without its no_grad: same modules, same order."""
    from dlm.verify.llada2_moe.torch_model import rope_cos_sin

    cfg = model.cfg
    h = model.model.word_embeddings(input_ids)
    cos, sin = rope_cos_sin(positions, int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_theta, h.dtype)
    for layer in model.model.layers:
        h = layer(h, cos, sin, mask)
    return model.lm_head(model.model.norm(h)).float()


class Data:
    def __init__(self, tokenizer, seed: int):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.eos, self.mask = ids()

    def prompt_ids(self, digits: str) -> list[int]:
        return self.tok.apply_chat_template(
            demo_task.messages(digits), add_generation_prompt=True, tokenize=True, return_dict=False)

    def answer_ids(self, digits: str) -> list[int]:
        return self.tok.encode(demo_task.answer_text(digits), add_special_tokens=False) + [self.eos]

    def batch(self, size: int, gen):
        """(noisy x_t [B, T], clean x_0 [B, T], loss mask [B, T]) for prompts of one length.

        T ends with the block holding the answer's <|endoftext|>; positions
        after it hold <|endoftext|> (what generate() leaves there). Each
        block's answer tokens are masked with its own t ~ U(0, 1)."""
        import torch

        n = self.rng.randint(demo_task.MIN_DIGITS, demo_task.MAX_DIGITS)
        P = len(self.prompt_ids("0" * n))
        T = ((P + n) // BLOCK + 1) * BLOCK
        rows = []
        while len(rows) < size:
            d = demo_task.sample_digits(self.rng, n)
            if demo_task.in_heldout(d):
                continue
            seq = self.prompt_ids(d) + self.answer_ids(d)
            rows.append(seq + [self.eos] * (T - len(seq)))
        clean = torch.tensor(rows)
        t = torch.rand(size, T // BLOCK, generator=gen).repeat_interleave(BLOCK, dim=1)
        masked = (torch.rand(clean.shape, generator=gen) < t) & (torch.arange(T) >= P)
        pick = P + (torch.rand(size, generator=gen) * (T - P)).long()  # at least one per row
        masked[torch.arange(size), pick] = True
        noisy = torch.where(masked, torch.full_like(clean, self.mask), clean)
        return noisy, clean, masked


def training_mask(T: int):
    """Additive [1, 1, 2T, 2T] mask over [x_t ; x_0] (the LLaDA2.0 tech report's
    training mask, section 4.2): x_t attends to its own block of x_t and to the earlier
    blocks of x_0; x_0 is block-causal; x_0 never sees x_t. Every x_t block
    is then denoised exactly as generate() sees it, all in one forward."""
    import torch

    blk = torch.arange(T) // BLOCK
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    causal = blk[None, :] <= blk[:, None]
    keep = torch.cat([torch.cat([same, before], 1),
                      torch.cat([torch.zeros(T, T, dtype=torch.bool), causal], 1)], 0)
    return torch.zeros(2 * T, 2 * T).masked_fill(~keep, float("-inf"))[None, None]


def evaluate(model, data: Data, digits_list: list[str]):
    """Held-out accuracy with the reference generate (greedy fix, dlm early block stop)."""
    import torch

    from dlm.verify.llada2_moe.torch_generate import generate

    gc = generation_config()
    model.eval()
    correct = multi = multi_ok = forwards = tokens = blocks = 0
    for d in digits_list:
        prompt = torch.tensor(data.prompt_ids(d))
        calls = []
        out = generate(
            model, prompt, temperature=0.0, block_length=gc["block_length"], steps=gc["steps"],
            gen_length=gc["max_new_tokens"], threshold=gc["threshold"], eos_id=gc["eos_token_id"],
            mask_id=gc["mask_token_id"], hub_sampler=False, early_stop=True,
            on_step=lambda b, s, logits: calls.append(b),
        ).tolist()
        forwards += len(calls)
        blocks += len(set(calls))
        tokens += len(out)
        text = data.tok.decode([i for i in out if i != data.eos])
        ok = demo_task.is_correct(d, text) and out[-1:] == [data.eos]
        correct += ok
        P = len(prompt)
        if (P + len(d)) // BLOCK > P // BLOCK:  # answer + eos spans 2+ blocks
            multi += 1
            multi_ok += ok
    model.train()
    n = len(digits_list)
    return {
        "accuracy": correct / n, "n": n, "multi_block_accuracy": multi_ok / max(multi, 1),
        "multi_block_n": multi, "blocks": blocks, "forwards_per_block": forwards / max(blocks, 1),
        "tokens_per_forward": tokens / max(forwards, 1),
    }


def save(model, cfg: dict, tokenizer_dir: Path, out: Path, summary: dict | None = None) -> None:
    """Hub layout (per-expert tensors, float32) into a temporary sibling, then swapped in."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    demo_task.publish_checkpoint(tmp, out, tokenizer_dir, summary,
                                 model_card(summary) if summary is not None else None)


def model_card(s: dict) -> str:
    ev = s.get("eval", {})
    gc = generation_config()
    return f"""---
license: apache-2.0
pipeline_tag: text-generation
tags: [dlm-demo, llada2_moe]
---
# LLaDA-2 MoE digit-sorting demo ({s['parameters']:,} parameters)

A tiny `llada2_moe` model (LLaDA2.0 architecture: group-limited sigmoid routing, shared expert,
partial RoPE) trained from seed {s['seed']} by `demo/train_llada2.py` through dlm's PyTorch
reference (`dlm.verify.llada2_moe.torch_model`) with masked block diffusion, on the task of `demo/task.py`:
the user message `sort <digits>` ({demo_task.MIN_DIGITS}-{demo_task.MAX_DIGITS} digits) is answered with the digits in
ascending order. Blocks of {BLOCK} tokens, so most answers span two or more blocks.

Held-out accuracy with the reference `generate` (greedy, block_length {gc['block_length']}, steps {gc['steps']},
threshold {gc['threshold']}), float32, {ev.get('n')} prompts: **{ev.get('accuracy', float('nan')):.1%}**
(multi-block answers: {ev.get('multi_block_accuracy', float('nan')):.1%} of {ev.get('multi_block_n')}),
{ev.get('tokens_per_forward', float('nan')):.2f} tokens per forward ({ev.get('forwards_per_block', float('nan')):.2f} forwards per block).
Training: {s['steps']} steps, {s['train_seconds']:.0f} s on CPU.

**Single-turn.** It was trained on one prompt form, `sort <digits>`, answered in one turn: it answers a
first `sort ...` turn, and `dlm-run chat` looks broken from the second turn on (a context it never saw).
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "demo" / "llada2_sort")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-n", type=int, default=40)
    ap.add_argument("--final-n", type=int, default=200)
    ap.add_argument("--time-limit", type=float, default=50 * 60)
    args = ap.parse_args(argv)

    import torch
    from transformers import PreTrainedTokenizerFast

    from tests.builders import build_llada2_tokenizer

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    tok_dir = args.out.with_name(args.out.name + ".tokenizer")
    shutil.rmtree(tok_dir, ignore_errors=True)
    model, cfg = build_model(args.seed)
    build_llada2_tokenizer(cfg["vocab_size"], tok_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    data = Data(tokenizer, args.seed)
    model.train()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, min(200, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup)
        * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    heldout = demo_task.heldout_set(args.final_n)
    small = heldout[:: max(1, len(heldout) // args.eval_n)][: args.eval_n]

    # expert load per MoE layer, for the balancing update of expert_bias
    loads: dict[int, torch.Tensor] = {}
    gates = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    for i, gate in gates:
        gate.register_forward_hook(lambda mod, inp, out, i=i: loads.__setitem__(
            i, loads.get(i, 0) + torch.bincount(out[0].reshape(-1), minlength=cfg["num_experts"])))
    print(f"parameters {n_params:,}; training {args.steps} steps of batch {args.batch}", flush=True)

    t0 = time.time()
    ema = None
    step = 0
    masks: dict[int, torch.Tensor] = {}
    for step in range(1, args.steps + 1):
        noisy, clean, masked = data.batch(args.batch, gen)
        T = noisy.shape[1]
        if T not in masks:
            masks[T] = training_mask(T)
        loads.clear()
        pos = torch.arange(T).repeat(2)
        logits = forward_train(model, torch.cat([noisy, clean], 1), masks[T], pos)[:, :T]
        loss = torch.nn.functional.cross_entropy(logits[masked], clean[masked])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for i, gate in gates:
                load = loads[i].float()
                gate.expert_bias += BIAS_RATE * torch.sign(load.mean() - load)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            print(f"step {step} loss {ema:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluate(model, data, small)
            print(f"step {step} eval {json.dumps(ev)}", flush=True)
            save(model, cfg, tok_dir, args.out)
        if time.time() - t0 > args.time_limit:
            print(f"time limit reached at step {step}", flush=True)
            break
    train_seconds = time.time() - t0
    ev = evaluate(model, data, heldout)
    print(f"final eval {json.dumps(ev)}", flush=True)
    import transformers

    summary = {
        "seed": args.seed, "steps": step, "batch": args.batch, "lr": args.lr,
        "train_seconds": train_seconds, "threads": args.threads, "parameters": n_params,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "final_loss_ema": ema, "eval": ev,
    }
    save(model, cfg, tok_dir, args.out, summary)
    shutil.rmtree(tok_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
