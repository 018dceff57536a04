"""Weight packing: one host buffer, one copy, exact round trip."""
import pytest
import torch

from nightjar.transfer.weight_pack import ALIGN, pack_tensors, unpack_tensors


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.float16),
        torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        torch.arange(5, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),                                    # 0-dim
        torch.zeros(0, 4),                                    # empty
        torch.randn(4, 6, generator=g).t(),                   # non-contiguous
    ]


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_unpacking_returns_equal_tensors_with_the_same_shapes_and_dtypes(device):
    tensors = sample_tensors()
    buf, layout = pack_tensors(tensors)
    out = unpack_tensors(buf, layout, device)
    assert len(out) == len(tensors)
    for a, b in zip(tensors, out):
        assert b.device.type == device and b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(a, b.cpu())


def test_the_buffer_is_one_aligned_block_pinned_only_with_cuda():
    buf, layout = pack_tensors(sample_tensors())
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert all(e.offset % ALIGN == 0 for e in layout)
    assert buf.is_pinned() == torch.cuda.is_available()


def test_unpacked_tensors_do_not_alias_the_host_buffer():
    tensors = sample_tensors()
    buf, layout = pack_tensors(tensors)
    out = unpack_tensors(buf, layout, "cpu")
    buf.fill_(0)
    assert torch.equal(out[0], tensors[0])
