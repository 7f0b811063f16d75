"""Loading a range of blocks holds the range plus about one tensor, never a block's full-precision weights.

A checkpoint with two wide bfloat16 blocks (1B-model widths: 45M parameters, 90 MB a block) is written by
`scripts/make_random_checkpoint.py`. A fresh process loads both blocks, and the growth of its peak resident
set (VmHWM, reset just before) is compared with what the loaded range holds. Quantized to int8, the range is
45 MB a block: a loader that read a whole block before quantizing it would peak 90 MB above the range; this
one reads tensor by tensor and quantizes each linear as soon as it is read, so it peaks about one tensor
(23 MB, the largest) above it. Cast to float32, each tensor is converted as it is read.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
SLACK = 40 * MIB  # allocator and interpreter noise, and a quantizer's scratch, around a load of this size

_PROBE = r"""
import json, sys, gc
from pathlib import Path
import torch
from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint import Checkpoint

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024

checkpoint = Checkpoint(sys.argv[1])
dtype, quantization = getattr(torch, sys.argv[2]), sys.argv[3]
BlockStack(checkpoint, 0, 1, dtype=torch.bfloat16, random_weights=True)  # imports and lazy set-up, not weights
gc.collect()
Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
base = status("VmRSS")
stack = BlockStack(checkpoint, 0, 2, dtype=dtype, quantization=quantization)
held = sum(t.numel() * t.element_size() for layer in stack.layers.values()
           for t in [*layer.parameters(), *layer.buffers()])
print(json.dumps({"peak_growth": status("VmHWM") - base, "held": held}))
"""


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", ROOT / "scripts/make_random_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    shape = module.Shape("wide", 1024, 2048, 5632, 2, 32, 8, 2048, 10000.0, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("wide") / "ckpt"
    module.make_random_checkpoint(shape, out)
    return out


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "int8"), ("float32", "none")])
def test_loading_peaks_at_the_range_plus_one_tensor(wide_checkpoint, dtype, quantization):
    result = subprocess.run([sys.executable, "-c", _PROBE, str(wide_checkpoint), dtype, quantization],
                            capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    largest_tensor = 2048 * 5632 * 2  # an MLP weight, as stored (bfloat16)
    one_block_stored = 45_088_768 * 2  # what holding a whole block before converting it would add
    bound = figures["held"] + largest_tensor + SLACK
    assert bound < figures["held"] + one_block_stored  # the bound can tell the two loaders apart
    assert figures["peak_growth"] <= bound, (
        f"loading peaked {figures['peak_growth'] / MIB:.0f} MiB above the start for a range holding "
        f"{figures['held'] / MIB:.0f} MiB (bound {bound / MIB:.0f} MiB)")
