"""On a CPU without a fast half-precision matmul, 4-bit layers and the LM head compute in float32.

Whether this machine has one (oneDNN's AVX512-BF16 / AMX kernels) is a fact of the CPU, so each test sets
`fast_cpu_matmul` both ways and checks what the model computes in, and that the float32 head gives the same
logits and gradients as a float64 reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from artrl.models import quantization
from artrl.train import logprobs

pytest.importorskip("bitsandbytes")


def _four_bit_layer() -> torch.nn.Module:
    lin = torch.nn.Linear(64, 32, bias=False)
    layer = quantization.quantized_linear(lin, "4bit", torch.bfloat16)
    layer.weight = quantization.quantized_weight(layer, lin.weight.data.bfloat16(), torch.device("cpu"))
    return torch.nn.Sequential(layer)


@pytest.mark.parametrize("fast", [False, True])
def test_four_bit_layers_compute_in_float32_without_a_fast_bf16_matmul(monkeypatch, fast):
    monkeypatch.setattr(quantization, "fast_cpu_matmul", lambda dtype: fast)
    model = _four_bit_layer()
    quantization.prepare_quantized(model, "4bit")
    seen: list[torch.dtype] = []
    handle = model[0].register_forward_pre_hook(lambda m, args: seen.append(m.compute_dtype))
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = model(x)  # [3, 32]
    y.float().sum().backward()
    handle.remove()
    want = torch.bfloat16 if fast else torch.float32
    assert model[0].compute_dtype == want and seen == [want]  # the first forward did not reset it to bf16
    assert y.dtype == torch.bfloat16 and x.grad is not None and x.grad.dtype == torch.bfloat16


def test_float32_head_matches_a_float64_linear(monkeypatch):
    monkeypatch.setattr(logprobs, "HEAD_SLICE_ROWS", 7)  # 20 vocabulary rows: slices of 7, 7 and 6
    torch.manual_seed(0)
    hidden = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)  # [chunk, hidden]
    weight = torch.randn(20, 16, dtype=torch.bfloat16, requires_grad=True)  # [vocab, hidden]
    bias = torch.randn(20, dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn(5, 20, dtype=torch.float64)  # [chunk, vocab]
    out = logprobs._Float32Head.apply(hidden, weight, bias)
    assert out.dtype == torch.float32
    (out.double() * probe).sum().backward()
    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    ref = F.linear(h, w, b)
    (ref * probe).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in ((hidden.grad, h.grad), (weight.grad, w.grad), (bias.grad, b.grad)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)  # rounded to the inputs' bf16


@pytest.mark.parametrize("fast", [False, True])
def test_token_logprobs_take_the_float32_head_without_a_fast_bf16_matmul(monkeypatch, fast):
    monkeypatch.setattr(logprobs, "fast_cpu_matmul", lambda dtype: fast)
    calls = []
    original = logprobs._Float32Head.apply
    monkeypatch.setattr(logprobs._Float32Head, "apply", lambda *a: calls.append(1) or original(*a))
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)  # [n, hidden]
    targets = torch.randint(0, 50, (6,))
    logp, _ = logprobs.token_logprobs(hidden, head, targets, chunk_size=4)
    logp.sum().backward()
    assert bool(calls) is not fast
    ref = torch.log_softmax(F.linear(hidden.detach().double(), head.weight.double()), -1)
    torch.testing.assert_close(logp.double(), ref.gather(-1, targets[:, None]).squeeze(-1), rtol=0.05, atol=0.05)
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
