"""One-off investigation (kept for the record): the two elements of the `scaled_grid` bf16 corpus
case where a bare torch.compile(QuantFP8.forward_native) and epilora-quant's INDUCTOR mode
disagreed (run 3). Finding (run 5): vLLM's own compiled dispatch gives our code (3), the same
scale and the same approximate reciprocal; only the bare torch.compile oracle rounded the tie up."""
import torch

from epilora_quant import quantize_fp8_per_token
from epilora_quant.gpu_reciprocal import triton_reciprocal_sm90
from epilora_testing import vllm_oracles as v
from epilora_testing.corpora import scaled_grid

x = scaled_grid(5, 256, torch.bfloat16).cuda()
q_v, s_v = v.quant_fp8_compiled(x, "token")
q_e, s_e = quantize_fp8_per_token(x)
hx = lambda t: hex(t.view(torch.int32).item())  # noqa: E731
print("vllm scale", hx(s_v[1].float()), "ours", hx(s_e[1]))
print("codes vllm", q_v[1, 124].view(torch.uint8).item(),
      "ours", q_e[1, 124].view(torch.uint8).item())
r_t = triton_reciprocal_sm90(s_v[1].float())
compiled_r = torch.compile(lambda t: t.reciprocal())(s_v[1].float())
print("r table", hx(r_t), "r inductor", hx(compiled_r), "r exact", hx(torch.reciprocal(s_v[1])))
xi = x[1, 124].float()
for name, r in (("table", r_t), ("inductor", compiled_r)):
    print(name, "x*r", (xi * r).item(), (xi * r).to(torch.float8_e4m3fn).view(torch.uint8).item())
f = torch.compile(
    lambda a, s: (a.float() * s.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn))
print("compiled x*recip(s)", f(x[1:2, 124:125], s_v[1:2]).view(torch.uint8).item())
