"""A local Ray for the scheduler tests: started once per session with 2 CPUs, stopped at the end.
Tests that need it take the `ray_local` fixture (skipped when Ray is not installed)."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: needs Ray (skipped cleanly when it is not installed)")


@pytest.fixture(scope="session")
def ray_local():
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()
