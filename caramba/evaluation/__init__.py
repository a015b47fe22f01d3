"""Evaluation on top of the engine (caramba.infer): the long-context task suite (tasks,
task_words), answering it with many caches from shared context prefills (task_eval), and
perplexity and agreement against a baseline cache (evaluate). The eval mode
(caramba.runners.eval) and the autotune's quality gates run them."""
