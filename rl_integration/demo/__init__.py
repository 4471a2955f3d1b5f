"""The embedded demo: a generated addition task with a heavy-tailed response length
(task.py), its fixed tokenizer (tokenizer.py), and a tiny policy warm-started on it and cached
as an ordinary Hugging Face checkpoint (policy.py). `spectail demo` trains it with GRPO."""
