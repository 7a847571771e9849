"""torch.profiler table of one 4-bit projection (Qwen3-0.6B's MLP up, [3072, 1024], 66 tokens) and a slice of a
bf16 LM head ([16384, 1024]), forward and backward, as a train call runs them on a CPU.

    python benchmarks/cpu_4bit_profile.py bfloat16   # both in bf16 (what a CPU without a fast bf16 matmul did)
    python benchmarks/cpu_4bit_profile.py float32    # the 4-bit layer and the head in float32 (what it does now)

Results: benchmarks/results/2026-12-03-cpu/README.md.
"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from artrl.models.quantization import quantized_linear, quantized_weight, prepare_quantized
from artrl.train import logprobs
torch.manual_seed(0)
mode = sys.argv[1]
lin = torch.nn.Linear(1024, 3072, bias=False)
m = torch.nn.Sequential(quantized_linear(lin, "4bit", torch.bfloat16))
m[0].weight = quantized_weight(m[0], lin.weight.data.bfloat16(), torch.device("cpu"))
if mode == "float32":
    prepare_quantized(m, "4bit")
head = torch.randn(16384, 1024, dtype=torch.bfloat16)
x = torch.randn(66, 1024, dtype=torch.bfloat16, requires_grad=True)
def step():
    h = m(x)[:, :1024]
    logits = logprobs._head(h, head, None) if mode == "float32" else torch.nn.functional.linear(h, head).float()
    logits.sum().backward()
step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    step()
print(f"== {mode} (torch threads {torch.get_num_threads()})")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))
