"""The log-prob computation never materialises [tokens, vocab]: its largest tensor is chunk x vocab."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from artrl.train.logprobs import token_logprobs


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_tensor(n_tokens: int, chunk: int, vocab: int = 2048, hidden: int = 64) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(n_tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (n_tokens,))
    with LargestTensor() as mode:
        logp, ent = token_logprobs(h, head, targets, chunk_size=chunk)
        (logp.sum() + ent.sum()).backward()
    return mode.largest, logp.detach()


@pytest.mark.parametrize("chunk", [256, 512])
def test_peak_tensor_is_chunk_by_vocab_whatever_the_length(chunk):
    vocab = 2048
    sizes = [largest_tensor(n, chunk, vocab)[0] for n in (1024, 2048, 4096)]
    assert sizes == [chunk * vocab] * 3  # flat as the token count doubles


def test_chunked_logprobs_equal_the_full_computation():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 100, bias=False)
    h = torch.randn(300, 32)
    t = torch.randint(0, 100, (300,))
    logp, ent = token_logprobs(h, head, t, chunk_size=64)
    full = torch.log_softmax(head(h), -1)
    torch.testing.assert_close(logp, full.gather(-1, t[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
