import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def dcp():
    """``torch.distributed.checkpoint.state_dict`` with a one-rank gloo group in this process (started
    here unless one is already running, and destroyed at the end of the module)."""
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint import state_dict

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29800 + os.getpid() % 190))
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield state_dict
    if started:
        dist.destroy_process_group()
