import pytest


@pytest.fixture(scope="session")
def single_rank():
    """A one-rank gloo process group in the test process (the training worker needs torch.distributed)."""
    from tests.backends.fsdp_utils.fsdp_test_utils import ensure_single_rank_group

    ensure_single_rank_group()
