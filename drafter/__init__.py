"""The online drafter: a small EAGLE-style head over the policy's own hidden states, embeddings and
lm_head, drafting with the request's coupled noise, trained on the policy's own rollouts.

    head.py       the draft head (attention / mlp kinds), run unrolled or against its KV cache
    features.py   the policy's hidden states over whole sequences; padded head rows
    draft.py      coupled draft chains for many requests at once (what the proposer runs)
    simulate.py   exact offline acceptance of a head on a saved rollout
    buffer.py     the ring of training features, bounded by tokens
    trainer.py    soft cross-entropy to the processed target distribution, unrolled steps
    warm_start.py a head trained offline for a policy
    export.py     safetensors + config in vLLM's EAGLE layout, and loading with checks
    bench.py      python -m drafter.bench --offline

The engine-side proposer comes with the engine's hidden-state hooks (notes/drafter-hooks.md).
"""
import rollout  # noqa: F401 -- first: it sets OpenMP's wait policy before torch loads (rollout/threads.py)
