"""Does inductor's max-autotune give a training step its own C++ matrix products on a CPU?

The GPT-2 study's smallest shape (2L/32d/1h) runs at 43% of the full shape's FLOP rate, much of it in
matrix products whose inner dimension is 32 (docs/speed.md). Inductor's ``max_autotune`` with the
``CPP`` GEMM backend generates C++ micro-kernel products tuned to a shape, which could beat oneDNN's
on such small ones. This compiles one width-32 linear layer (2,048 positions into a 1,024-word
vocabulary, the small shape's output layer) under max-autotune with the C++ backend, once as a
training step (forward and backward) and once frozen for inference, and prints, for each, how many
of its products had the C++ template among the candidates autotuning times, and how many of the
generated code's products are ATen's (``extern_kernels.mm``) or the C++ template's.

    python experiments/probe_autotune_gemm.py

It times nothing, so it may run beside other work.
"""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch._inductor.kernel.mm as inductor_mm
import torch._inductor.mkldnn_lowerings as inductor_mkldnn
from torch._inductor.utils import run_and_get_code

ELIGIBLE = []


def counted(eligible):
    """``eligible`` (inductor's test of whether the C++ template may compute a product), recording each answer."""
    def wrapper(*args, **kwargs):
        ELIGIBLE.append(eligible(*args, **kwargs))
        return ELIGIBLE[-1]
    return wrapper


def generated_code(train: bool) -> str:
    torch.compiler.reset()
    ELIGIBLE.clear()
    layer = torch.nn.Linear(32, 1024)
    x = torch.randn(2048, 32)
    if train:
        _, code = run_and_get_code(torch.compile(lambda x: layer(x).square().mean().backward()), x)
    else:
        layer.requires_grad_(False)
        with inductor_config.patch(freezing=True), torch.no_grad():
            _, code = run_and_get_code(torch.compile(layer), x)
    return "\n".join(code)


def main() -> None:
    for module in (inductor_mm, inductor_mkldnn):  # the two places a float product may be lowered
        module.use_cpp_gemm_template = counted(module.use_cpp_gemm_template)
    with inductor_config.patch(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", fx_graph_cache=False):
        for train in (True, False):
            code = generated_code(train)
            aten = sum(code.count(f"extern_kernels.{op}(") for op in ("mm", "addmm", "bmm"))
            print(f"{'training step' if train else 'frozen inference'}: the C++ template a candidate for "
                  f"{sum(ELIGIBLE)} of {len(ELIGIBLE)} products; in the code: ATen products {aten}, C++ template "
                  f"{'yes' if 'micro_gemm' in code.lower() else 'no'} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
