"""Tensor/expert-parallel parity and throughput: engine rollouts + trainer recompute at one layout.

Run once per layout with torchrun (NCCL on GPUs, gloo on CPU), then compare the results:

    OUT=benchmarks/results/tp_parity_$(date -u +%F)
    torchrun --nproc-per-node 1 benchmarks/tp_parity.py run --tp 1 --out-dir $OUT
    torchrun --nproc-per-node 2 benchmarks/tp_parity.py run --tp 2 --out-dir $OUT
    torchrun --nproc-per-node 2 benchmarks/tp_parity.py run --tp 2 --reduce allreduce --out-dir $OUT  # optional
    python benchmarks/tp_parity.py compare --out-dir $OUT

Every run uses the same virtual-shard count V (``--virtual-shards``, default 2) and the same seeds,
so the TP=1 and TP=2 log-probs must be bitwise equal (rollout at TP=a vs trainer at TP=b for every
pair). ``--reduce allreduce`` is the Megatron-style baseline (a plain all-reduce of the row-parallel
partials): it shows what the fixed-order gather costs, and its log-probs are not expected to match.
The model is the bench preset shrunk to ``--layers`` layers (default 4: 3 KDA + 1 MLA+DSA); ``--smoke``
runs the tiny preset on CPU (gloo) to check the script end to end.

``run`` writes ``<out-dir>/<tag>.json`` from rank 0 (tag: tp{tp}_ep{ep}_V{V}_{reduce}): the layout,
tokens/s of the engine (generated tokens and prompt+generated) and of the trainer recompute, every
request's tokens and both log-prob lists. ``compare`` prints a table and writes ``compare.json``;
it exits 1 if two tree-reduce layouts with the same V disagree on any bit.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_config, build_on_device, env, setup_logging, write_json  # noqa: E402

log = logging.getLogger("benchmarks.tp_parity")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from zmrl.lora import LoraConfig, apply_lora
    from zmrl.model import ModelConfig, build_model
    from zmrl.parallel import ParallelConfig, destroy_parallel, init_parallel, shard_model
    from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
    from zmrl.trainer import compute_logprobs

    if not a.smoke:
        if not torch.cuda.is_available():
            sys.stderr.write("tp_parity.py: needs CUDA GPUs (or --smoke for a CPU check)\n")
            return 2
        # NVLink multicast (NVLS) must stay off on the lent machines.
        if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
            log.warning("NCCL_NVLS_ENABLE=%s: forcing 0", os.environ["NCCL_NVLS_ENABLE"])
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    else:
        torch.set_num_threads(1)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    pcfg = init_parallel(ParallelConfig(tp=a.tp, ep=a.ep, virtual_shards=a.virtual_shards, reduce=a.reduce,
                                        backend="gloo" if a.smoke else "nccl"))
    rank = dist.get_rank()
    device = torch.device("cpu") if a.smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if a.smoke else torch.bfloat16
    try:
        t0 = time.perf_counter()
        if a.smoke:
            cfg = ModelConfig.preset("tiny")
            model = build_model(cfg, seed=0, dtype=dtype)
        else:
            cfg = bench_config(a.layers)
            model = build_on_device(cfg, dtype, device, seed=0)  # a CUDA generator: same weights on every rank
        if a.lora:
            apply_lora(model, LoraConfig(r=a.lora, alpha=a.lora, init_b_std=0.01, init_seed=1))
        # Every layout must start from the same full weights (ranks and separate runs alike).
        with torch.no_grad():
            checksum = float(sum(p.double().sum() for p in model.parameters()))
        sums: list = [None] * dist.get_world_size()
        dist.all_gather_object(sums, checksum)
        if len(set(sums)) != 1:
            raise RuntimeError(f"ranks built different weights (checksums {sums})")
        shard_model(model, pcfg)
        model.eval()
        _sync()
        build_s = time.perf_counter() - t0

        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len + 7 * i,), generator=g).tolist()
                   for i in range(a.num_prompts)]
        params = [SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=100 + i) for i in range(a.num_prompts)]
        bs = 64
        blocks = sum(-(-(len(p) + a.max_tokens) // bs) for p in prompts) + 8
        ecfg = EngineConfig(block_size=bs, num_blocks=blocks, max_num_seqs=a.num_prompts,
                            max_num_batched_tokens=a.max_batched_tokens, enable_prefix_caching=False)
        # warm-up (Triton compiles, allocator) on a throw-away engine
        RolloutEngine(model, ecfg).generate(prompts[:2], SamplingParams(max_tokens=2, seed=1))
        engine = RolloutEngine(model, ecfg)
        _sync()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync()
        engine_s = time.perf_counter() - t0
        seqs = [list(o.prompt_token_ids) + list(o.token_ids) for o in outs]
        plens = [len(o.prompt_token_ids) for o in outs]
        gen_tokens = sum(len(o.token_ids) for o in outs)
        all_tokens = sum(len(s) for s in seqs)

        compute_logprobs(model, seqs[:1], plens[:1])  # warm-up of the packed shapes
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():  # the values are those of the autograd pass (same ops); timing the forward
            lps = compute_logprobs(model, seqs, plens, micro_batch_tokens=a.micro_batch_tokens)
        _sync()
        trainer_s = time.perf_counter() - t0
        result = {
            "env": env(),
            "layout": {"tp": a.tp, "ep": a.ep, "virtual_shards": a.virtual_shards, "reduce": a.reduce,
                       "world": dist.get_world_size(), "layers": cfg.num_hidden_layers, "smoke": a.smoke,
                       "dtype": str(dtype), "lora_r": a.lora},
            "build_s": build_s,
            "weights_checksum": checksum,
            "engine": {"seconds": engine_s, "generated_tokens": gen_tokens, "total_tokens": all_tokens,
                       "generated_tokens_per_s": gen_tokens / engine_s, "total_tokens_per_s": all_tokens / engine_s,
                       "steps": engine.num_steps},
            "trainer": {"seconds": trainer_s, "tokens": all_tokens, "tokens_per_s": all_tokens / trainer_s},
            "max_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else None,
            "requests": [{"tokens": s, "prompt_len": p, "engine_logprobs": o.logprobs.float().cpu().tolist(),
                          "trainer_logprobs": lp.detach().float().cpu().tolist()}
                         for s, p, o, lp in zip(seqs, plens, outs, lps)],
        }
        same = all(torch.equal(o.logprobs, lp.detach()) for o, lp in zip(outs, lps))
        if rank == 0:
            tag = f"tp{a.tp}_ep{a.ep}_V{a.virtual_shards}_{a.reduce}"
            write_json(Path(a.out_dir) / f"{tag}.json", result)
            print(f"{tag}: engine {gen_tokens / engine_s:.1f} generated tok/s ({all_tokens / engine_s:.1f} total), "
                  f"trainer {all_tokens / trainer_s:.1f} tok/s, rollout==trainer within this layout: {same}")
        return 0 if same else 1
    finally:
        destroy_parallel()


def _bitwise_equal(x: list[list[float]], y: list[list[float]]) -> tuple[int, int]:
    """(equal, total) token log-probs; floats from JSON are float32 values widened exactly."""
    eq = tot = 0
    for a, b in zip(x, y):
        ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        n = min(ta.numel(), tb.numel())
        eq += int((ta[:n] == tb[:n]).sum()) if ta.numel() == tb.numel() else 0
        tot += max(ta.numel(), tb.numel())
    return eq, tot


def compare(a: argparse.Namespace) -> int:
    files = sorted(glob.glob(os.path.join(a.out_dir, "tp*_ep*_V*_*.json")))
    if not files:
        sys.stderr.write(f"compare: no result files in {a.out_dir}\n")
        return 2
    runs = {Path(f).stem: json.loads(Path(f).read_text()) for f in files}
    print(f"{'layout':<26}{'engine gen tok/s':>18}{'engine tok/s':>14}{'trainer tok/s':>15}{'rollout==trainer':>18}")
    rows = {}
    for tag, r in runs.items():
        reqs = r["requests"]
        eq, tot = _bitwise_equal([q["engine_logprobs"] for q in reqs], [q["trainer_logprobs"] for q in reqs])
        rows[tag] = {"engine_generated_tokens_per_s": r["engine"]["generated_tokens_per_s"],
                     "engine_total_tokens_per_s": r["engine"]["total_tokens_per_s"],
                     "trainer_tokens_per_s": r["trainer"]["tokens_per_s"], "self_equal": f"{eq}/{tot}"}
        print(f"{tag:<26}{rows[tag]['engine_generated_tokens_per_s']:>18.1f}{rows[tag]['engine_total_tokens_per_s']:>14.1f}"
              f"{rows[tag]['trainer_tokens_per_s']:>15.1f}{eq:>10}/{tot:<7}")
    pairs = []
    failed = False
    for ta, tb in itertools.permutations(runs, 2):
        la, lb = runs[ta]["layout"], runs[tb]["layout"]
        ra, rb = runs[ta]["requests"], runs[tb]["requests"]
        same_tokens = [q["tokens"] for q in ra] == [q["tokens"] for q in rb]
        eq, tot = _bitwise_equal([q["engine_logprobs"] for q in ra], [q["trainer_logprobs"] for q in rb])
        # equal by construction: same V, fixed-order tree reduce on both sides (any tp, any ep)
        expected = la["reduce"] == lb["reduce"] == "tree" and la["virtual_shards"] == lb["virtual_shards"]
        if runs[ta].get("weights_checksum") != runs[tb].get("weights_checksum"):
            log.error("%s and %s were built with different weights: not comparable", ta, tb)
            expected = False
        ok = same_tokens and eq == tot
        failed |= expected and not ok
        pairs.append({"rollout": ta, "trainer": tb, "same_tokens": same_tokens, "bitwise_equal": f"{eq}/{tot}",
                      "expected_equal": expected, "ok": ok or not expected})
    print(f"\n{'rollout layout':<26}{'trainer layout':<26}{'same tokens':>12}{'bitwise equal':>16}  expected")
    for p in pairs:
        print(f"{p['rollout']:<26}{p['trainer']:<26}{str(p['same_tokens']):>12}{p['bitwise_equal']:>16}  "
              f"{'equal' if p['expected_equal'] else 'may differ'}{'' if p['ok'] else '  <-- MISMATCH'}")
    write_json(Path(a.out_dir) / "compare.json", {"env": env(), "throughput": rows, "pairs": pairs, "ok": not failed})
    print("\nPARITY " + ("FAILED" if failed else "OK"))
    return 1 if failed else 0


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one layout (launch with torchrun --nproc-per-node = tp * dp)")
    r.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    r.add_argument("--ep", type=int, default=1)
    r.add_argument("--virtual-shards", type=int, default=2)
    r.add_argument("--reduce", choices=["tree", "allreduce"], default="tree")
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--num-prompts", type=int, default=8)
    r.add_argument("--prompt-len", type=int, default=128)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--max-batched-tokens", type=int, default=4096)
    r.add_argument("--micro-batch-tokens", type=int, default=4096)
    r.add_argument("--lora", type=int, default=32, help="LoRA rank on every target (0: none)")
    r.add_argument("--smoke", action="store_true", help="tiny preset on CPU with gloo (checks the script)")
    r.add_argument("--out-dir", required=True)
    c = sub.add_parser("compare", help="compare every run in --out-dir")
    c.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    raise SystemExit(run(a) if a.cmd == "run" else compare(a))


if __name__ == "__main__":
    main()
