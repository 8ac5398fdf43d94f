"""`olmax convert hf-to-olmax | olmax-to-hf` and `olmax parity`; `add_commands` hooks them into olmax.cli."""

from __future__ import annotations

import contextlib
import os
import sys

from olmax.arguments import given, old_spelling
from olmax.errors import ExitCode, InteropError


def cmd_hf_to_olmax(args) -> None:
    from olmax import storage
    from olmax.interop.hf import hf_to_olmax

    target = given(args, "out", "the output directory (--out OUT)", required=True)
    with storage.local_copy(args.src) as src:
        cfg = hf_to_olmax(src, target, origin=args.src)
    m = cfg.model
    mlp = f"MLP {m.mlp_hidden}" if m.mlp == "dense" else f"{m.moe.num_experts} experts of {m.moe.expert_hidden}, " \
        f"top-{m.moe.top_k}"
    print(f"wrote {target}/0: olmax weights-only checkpoint of {args.src} (family {m.family}, {m.n_layers} layers, "
          f"d_model {m.d_model}, {m.n_heads}/{m.kv_heads} heads, {mlp}, vocab {m.vocab_size} padded to "
          f"{m.padded_vocab}, layer pattern {m.layer_pattern}, window {m.sliding_window})")


def cmd_olmax_to_hf(args) -> None:
    from olmax import storage
    from olmax.interop.hf import olmax_to_hf

    target = given(args, "out", "the output directory (--out OUT)", required=True)
    with storage.local_copy(args.tokenizer) if args.tokenizer else contextlib.nullcontext() as tokenizer:
        cfg, step = olmax_to_hf(args.ckpt, target, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30),
                                tokenizer=tokenizer)
    from olmax.model.families import HF_CLASSES

    print(f"wrote {target}: {HF_CLASSES[cfg.model.family]} ({args.dtype}) from {args.ckpt} step {step}, "
          f"vocab trimmed to {cfg.model.vocab_size}")


def _check_parity_paths(checkpoint: str, hf: str | None) -> None:
    """Refuse a local checkpoint or --hf directory that is not there before the references' imports (a minute of
    silence before the refusal)."""
    from olmax import storage

    if not storage.is_remote(checkpoint) and not os.path.exists(checkpoint):
        raise InteropError(f"{checkpoint}: no such checkpoint; give an olmax checkpoint or run directory")
    if hf and not storage.is_remote(hf):
        if not os.path.isdir(hf):
            raise InteropError(f"--hf {hf}: no such directory; give an HF model directory (config.json and "
                               "safetensors)")
        if not os.path.isfile(os.path.join(hf, "config.json")):
            raise InteropError(f"--hf {hf} is not an HF model directory: config.json is missing")


def cmd_parity(args) -> None:
    from olmax import storage

    checkpoint = given(args, "checkpoint", "the olmax checkpoint (olmax parity CHECKPOINT)", required=True)
    _check_parity_paths(checkpoint, args.hf)
    from olmax.interop.parity import format_report, run_parity, to_json

    with storage.local_copy(args.hf) if args.hf else contextlib.nullcontext() as hf:  # a bucket's: copied whole
        report = run_parity(
            checkpoint, hf_dir=hf, olmo_core=args.reference == "olmo-core", dtype=args.dtype,
            tokens=args.tokens, seq_len=args.seq_len, batches=args.batches, batch_size=args.batch_size,
            seed=args.seed, float64_reference=not args.no_float64,
        )
    if args.hf:
        report["comparisons"]["hf"]["reference"] = args.hf
    print(to_json(report) if args.json else format_report(report))
    if not report["passed"]:
        sys.exit(ExitCode.FAILED)


def add_commands(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="convert checkpoints between HF transformers and olmax")
    verbs = convert.add_subparsers(dest="convert_command", required=True)

    p = verbs.add_parser("hf-to-olmax",
                         help="HF Olmo3ForCausalLM / OlmoeForCausalLM directory -> weights-only olmax checkpoint")
    p.add_argument("src", help="directory with config.json and model.safetensors (or shards + index)")
    p.add_argument("--out", help="new checkpoint directory; the weights land in OUT/0 (usable as init_from)")
    old_spelling(p, "out", "out", "write the output directory as --out OUT")
    p.set_defaults(func=cmd_hf_to_olmax)

    p = verbs.add_parser("olmax-to-hf",
                         help="olmax checkpoint (latest step) -> HF Olmo3ForCausalLM / OlmoeForCausalLM directory")
    p.add_argument("ckpt", help="olmax checkpoint directory (training or weights-only); its latest step is used")
    p.add_argument("--out", help="new directory for config.json and safetensors")
    old_spelling(p, "out", "out", "write the output directory as --out OUT")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="tensor dtype written (default: %(default)s)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split into shards of at most this many GB (default: %(default)s)")
    p.add_argument("--tokenizer", help="the run's tokenizer.json, copied into OUT (HF's AutoTokenizer reads it)")
    p.set_defaults(func=cmd_olmax_to_hf)

    p = subparsers.add_parser("parity", help="logit parity of an olmax checkpoint against HF / OLMo-core")
    p.add_argument("checkpoint", nargs="?", help="olmax checkpoint directory (latest step)")
    old_spelling(p, "--olmax", "checkpoint", "give the checkpoint as the first argument, `olmax parity CHECKPOINT`")
    p.add_argument("--hf", help="HF Olmo3ForCausalLM / OlmoeForCausalLM directory, run in float32")
    p.add_argument("--reference", choices=("olmo-core",), help="also compare with OLMo-core's OLMo 3 model")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="olmax compute dtype (default: %(default)s)")
    p.add_argument("--seq-len", type=int, help="tokens per instance (default: twice the sliding window)")
    p.add_argument("--batches", type=int, default=1, help="batches of inputs compared (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per batch (default: %(default)s)")
    p.add_argument("--tokens", help="raw token shard to read inputs from (default: random token ids)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--no-float64", action="store_true",
                   help="skip the float64 run of the reference (its float32 error then is not measured, and a "
                        "fixed max |delta logit| of 1e-4 applies); for models whose float64 copy does not fit")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_parity)
