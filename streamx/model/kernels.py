"""Which kernels a model's layers take, for the run's header: its attention, and the kernel packages its linear-
attention and state-space layers call where installed.

Attention: the implementation the model was loaded with (sdpa, eager, flash_attention_2/3), and for packed batches
streamx's own (streamx.model.attention). Linear-attention and state-space layers (gated delta-net, Mamba, short
convolutions): transformers declares, in each family's modeling code, each function it takes from a kernel package
where that package is installed and runs on the inputs' device, falling back to its own PyTorch reference (right,
much slower) elsewhere: `@use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")` above
`def torch_chunk_gated_delta_rule`. Those declarations are read from the code of the modules the decoder's layers
are made of, and a layer takes a function where its modules' code (or a function of that code's module that it
calls) names it: what the model itself calls, whatever its family.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .capture import find_decoder
from .packing import NATIVE_VARLEN, own_attention

DECLARED = re.compile(r'use_kernel_func_from_hub_with_fallback\(\s*"(\w+)",\s*"(\w+)"[^)]*\)\s*def (\w+)')
DISTRIBUTIONS = {"fla": "flash-linear-attention"}  # a package's pip name where it is not its import name's
KERNEL_DEVICES = ("cuda",)  # where the kernel packages run (transformers: fla also on xpu, npu, mlu)


@dataclass(frozen=True)
class Kernel:
    """A kernel package some of a model's layers call: its import name, the functions, the layers that call them."""

    package: str
    functions: tuple[str, ...]
    layers: int

    @property
    def distribution(self) -> str:
        """What `pip install` names it."""
        return DISTRIBUTIONS.get(self.package, self.package.replace("_", "-"))

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None


def layer_kernels(model: nn.Module) -> list[Kernel]:
    """The kernel packages the decoder's layers call (none in a plain transformer), by package."""
    calls: dict[str, tuple[set[str], int]] = {}
    for layer in find_decoder(model).layers:
        found: dict[str, set[str]] = {}
        for module in {type(m) for m in layer.modules()}:
            for package, function in _called(module):
                found.setdefault(package, set()).add(function)
        for package, functions in found.items():
            known, layers = calls.get(package, (set(), 0))
            calls[package] = (known | functions, layers + 1)
    return [Kernel(package, tuple(sorted(functions)), layers) for package, (functions, layers) in sorted(calls.items())]


@functools.cache
def _called(cls: type) -> frozenset[tuple[str, str]]:
    """(package, function) of each kernel function the code of `cls` names, or a function of its module it calls."""
    declared = _declared(cls.__module__)
    if not declared:
        return frozenset()
    try:
        names = _names(inspect.getsource(cls))
    except (OSError, TypeError):  # (a class with no source file)
        return frozenset()
    module = sys.modules[cls.__module__]
    for name in list(names):  # one step into the module's own functions the class calls (causal_conv1d_forward)
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__ == cls.__module__:
            names |= _names(inspect.getsource(helper))
    return frozenset(declared[name] for name in names if name in declared)


@functools.cache
def _declared(module_name: str) -> dict[str, tuple[str, str]]:
    """The kernel functions a module declares: the decorated function's name -> (package, kernel function)."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return {}
    return {name: (package, function) for function, package, name in DECLARED.findall(source)}


def _names(source: str) -> set[str]:
    return set(re.findall(r"\b\w+\b", source))


def kernel_note(model: nn.Module, device: str, packed: bool) -> str:
    """The run's header line: the attention each kind of batch takes, and each kernel package the layers call,
    installed or not (and then what is lost, and the install line)."""
    own = own_attention(model)
    on_gpu = device.startswith(KERNEL_DEVICES)
    half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    streamx = ("torch's flash attention over variable-length rows" if on_gpu and half else
               "its segments' products joined by log-sum-exp")
    said = [f"attention {own}" + (f" (padded rows, the check and the audit); packed rows streamx's ({streamx})"
                                  if packed and own not in NATIVE_VARLEN else "")]
    for kernel in layer_kernels(model):
        calls = f"{kernel.layers} layers call {', '.join(kernel.functions)}"
        if not on_gpu:
            said.append(f"{calls}: transformers' PyTorch reference on {device} ({kernel.distribution} runs on GPUs)")
        elif kernel.installed:
            said.append(f"{calls} from {kernel.distribution}")
        else:
            said.append(f"{calls}: {kernel.distribution} NOT INSTALLED, so transformers runs its PyTorch reference "
                        f"there, right but much slower: pip install {kernel.distribution} (docs/install.md)")
    return "; ".join(said)
