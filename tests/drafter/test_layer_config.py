"""The head's layer sizes in the run config: checked, and naming the warm-start folder they
need (a cached head of another shape is never picked up)."""
import pytest

from rl_integration.config import load_config
from rl_integration.demo.policy import drafter_folder


def test_the_layer_keys_are_checked_and_passed_on():
    d = load_config(None, ["rollout.drafter.num_heads=4", "rollout.drafter.num_kv_heads=2",
                           "rollout.drafter.intermediate_size=128"]).rollout.drafter
    assert d.layer() == {"intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ValueError, match="'rollout.drafter.num_heads'.*multiple"):
        load_config(None, ["rollout.drafter.num_heads=3", "rollout.drafter.num_kv_heads=2"])
    with pytest.raises(ValueError, match="'rollout.drafter.intermediate_size'"):
        load_config(None, ["rollout.drafter.intermediate_size=0"])


def test_the_warm_start_folder_names_the_layer():
    assert drafter_folder("/p", "attention", 64).endswith("drafter-attention-w64-v1")  # the policy's layer
    assert drafter_folder("/p", "attention", 64, {"intermediate_size": 128, "num_heads": 2, "num_kv_heads": 1}) \
        .endswith("drafter-attention-w64-f128h2k1-v1")
    mlp = drafter_folder("/p", "mlp", None, {"intermediate_size": 64, "num_heads": None})
    assert mlp.endswith("drafter-mlp-f64-v1")
