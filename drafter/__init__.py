"""The online drafter: a small EAGLE-style head over the policy's own hidden states, embeddings and
lm_head, drafting with the request's coupled noise, trained on the policy's own rollouts.

    head.py       the draft head (attention / mlp kinds, optional window), run unrolled or on new rows
    head_cache.py its KV cache per engine slot (a ring for a windowed head), one query per request
    features.py   the policy's hidden states over whole sequences; padded head rows
    coupled.py    the drafts' coupled sampler (the token rollout.core.sampling would pick) and margins
    draft.py      coupled draft chains for many requests at once (what the proposer runs)
    proposer.py   the "drafter" proposer in the engine: features per slot, batched drafts, buffer
    simulate.py   exact offline acceptance of a head on a saved rollout
    buffer.py     the ring of training features, bounded by tokens
    trainer.py    soft cross-entropy to the processed target distribution, unrolled steps
    online.py     training on what the engine ran (between steps, or in idle slices on Ray)
    warm_start.py a head trained offline for a policy
    export.py     safetensors + config in vLLM's EAGLE layout, and loading with checks
"""
