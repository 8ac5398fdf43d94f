"""Evaluation: held-out loss and per-domain perplexity, checkpoint KL, lm-eval-harness, curve comparison,
in-loop evals. The CLI verbs are in cli.py; the trainer's hook is in_loop.make_in_loop_eval."""
