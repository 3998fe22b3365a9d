"""The tuner's parallel compile against its search, kernel by kernel, for sm_90 and without a
GPU (run as a script, TRITON_INTERPRET unset: see test_tuner.py). The launchers run on CPU
tensors with the kernels' `run` replaced by aot_launchers_sm90's recorder; a kernel is the
recorded launch's kernel, constexprs and argument types. Every kernel the search may launch
(the settings in use, each K2 candidate beside K1's in use, each K1 candidate beside any K2
candidate, since any may win) must be among those the compile workers launched: one missing
is a compile inside the timed search, against its budget (at ba2f1be each K1 candidate beside
a swapped K2 was, and the H200's tuner ran out of its 60 s on most models). Prints the
missing ones as JSON."""

import functools
import json

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from epilora_kernels import fused, tuner

from aot_launchers_sm90 import SM90, record_launches

# Small shapes with the decode cases' variety: three slices (qkv, 64-wide: swapped K2 fits),
# one slice over a deep K (down)
PROJECTIONS = {"qkv": (1024, (256, 128, 128)), "down": (2048, (256,))}
TOKENS = (1, 8, 32)


def kernels(launch) -> set:
    """What each launch compiles from, as Triton keys it: the kernel, its constexprs and
    options, each tensor's type, each other integer's specialization (1, a multiple of 16,
    else none; nothing where the kernel does not specialize it)."""
    def describe(kernel, name, value):
        param = params[kernel].get(name)
        if isinstance(value, TensorDescriptor):
            return ("desc", str(value.base.dtype), tuple(value.block_shape))
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype))
        if (isinstance(value, int) and not isinstance(value, bool) and param is not None
                and not param.is_constexpr):
            return None if param.do_not_specialize else (value == 1, value % 16 == 0)
        return value
    out = set()
    for kernel, args, kwargs in record_launches(launch):
        params.setdefault(kernel, {p.name: p for p in kernel.params})
        named = {**dict(zip(kernel.arg_names, args, strict=False)), **kwargs}
        out.add((kernel.fn.__name__,
                 tuple((k, describe(kernel, k, v)) for k, v in sorted(named.items()))))
    return out


params: dict = {}  # each kernel's parameters by name


def in_use(problem: tuple, codes: bool) -> list:
    """The settings in use (`fused.decode_settings`, on sm_90: the search's first)."""
    found: list = []
    kernels(lambda: found.extend(fused.decode_settings(*problem, codes=codes)))
    return found


def missing(rank: int, slots: int, codes: bool) -> list[str]:
    cpu = torch.device("cpu")
    problem = functools.lru_cache(None)(
        lambda t, k, slices: tuner._problem(t, k, slices, rank, slots, cpu))

    def decode(k, slices, t, k1, k2):
        x, weight, scale, lora, batch = problem(t, k, slices)
        return lambda: tuner._decode(x, weight, scale, lora, batch, k1, k2,
                                     codes and fused.quantize(x))

    launches = tuner._launches(SM90, PROJECTIONS, TOKENS, rank, slots, codes)
    compiled = kernels(lambda: tuner._compile(launches, rank, slots, codes, device=cpu))
    out = []
    for k, slices in PROJECTIONS.values():
        for t in TOKENS:
            k1, k2 = in_use(problem(t, k, slices), codes)
            k2s = [k2, *tuner.k2_candidates(k2, sum(slices), k, slices, tokens=t)]
            pairs = [(k1, c) for c in k2s]
            if tuner.k1_tuned(codes, slots, t):
                pairs += [(c, c2) for c in tuner.k1_candidates(k1, k, rank, len(slices),
                                                                tokens=t, codes=codes)
                          for c2 in k2s]
            for a, b in pairs:
                if kernels(decode(k, slices, t, a, b)) - compiled:
                    out.append(f"K={k} slices={slices} tokens={t} K1 {a} K2 {b}")
    return out


def main() -> None:
    print(json.dumps({f"rank {rank}, {slots} slot(s){', codes' if codes else ''}":
                      missing(rank, slots, codes)
                      for rank, slots, codes in ((16, 1, False), (16, 1, True),
                                                 (32, 4, False))}))


if __name__ == "__main__":
    main()
