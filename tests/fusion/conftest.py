"""Shared fixtures for compiler tests: scenario clusters and cached GPT-style cost models."""
import pytest


@pytest.fixture(scope="session")
def gpt_xl():
    """A GPT-2 XL-sized graph on the meta device with its measured node costs."""
    from fusion.cost.flops import measure_costs
    from tests.testing_models import gpt_model

    m = gpt_model(48, 1600, 25, 50257, 1024, 1, device="meta")
    return m, measure_costs(m.graph)


@pytest.fixture(scope="session")
def gpt_small():
    from fusion.cost.flops import measure_costs
    from tests.testing_models import gpt_model

    m = gpt_model(12, 768, 12, 50257, 256, 1, device="meta")
    return m, measure_costs(m.graph)

