"""GGUF linears that take one input (a block's q/k/v projections, its gate/up projections) multiply a decode row in
one call of the kernels (`runtime.ggml.weights.SharedInput`): each must still give its own product, bit for bit,
whatever order they are called in and however many threads run blocks at once."""

from __future__ import annotations

import copy
import threading

import torch

from swarmnode.runtime.ggml.formats import GGMLType
from swarmnode.runtime.ggml.weights import GGMLLinear, quantize_weight, share_inputs


def _attention(seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    parent = torch.nn.Module()
    for name, rows, kind in (("q_proj", 64, GGMLType.Q4_1), ("k_proj", 16, GGMLType.Q5_0),
                             ("v_proj", 16, GGMLType.Q8_0), ("o_proj", 256, GGMLType.Q4_0)):
        weight = torch.randn(rows, 256, generator=generator) * 0.05
        setattr(parent, name, GGMLLinear(quantize_weight(weight, kind)))
    return parent


def _alone(parent: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [GGMLLinear.forward(getattr(parent, name), x) if getattr(parent, name).shared is None else None
            for name in ("q_proj", "k_proj", "v_proj")]


def test_shared_products_equal_each_alone() -> None:
    reference, shared = _attention(), _attention()
    assert share_inputs(shared) == 1  # q, k and v; o_proj takes another input
    assert shared.o_proj.shared is None and shared.q_proj.shared is shared.v_proj.shared
    for step in range(3):
        x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(step))
        want = _alone(reference, x)
        order = ("v_proj", "q_proj", "k_proj") if step == 1 else ("q_proj", "k_proj", "v_proj")
        got = {name: getattr(shared, name)(x) for name in order}
        for name, w in zip(("q_proj", "k_proj", "v_proj"), want):
            assert torch.equal(got[name], w), (step, name)
    # several rows (a prompt chunk, a batch) go each on its own, with the same results
    xs = torch.randn(1, 5, 256)
    assert torch.equal(shared.k_proj(xs), reference.k_proj(xs))
    # a member called twice with one input, or a new input before the others took theirs: still its own product
    x1, x2 = torch.randn(1, 1, 256), torch.randn(1, 1, 256)
    first, again = shared.q_proj(x1), shared.q_proj(x1)
    assert torch.equal(first, reference.q_proj(x1)) and torch.equal(again, first)
    again.add_(1.0)  # each call's tensor is its own
    assert torch.equal(first, reference.q_proj(x1))
    assert torch.equal(shared.k_proj(x2), reference.k_proj(x2))
    assert torch.equal(shared.v_proj(x1), reference.v_proj(x1))


def test_a_copied_block_keeps_its_groups() -> None:
    shared = _attention()
    share_inputs(shared)
    x = torch.randn(1, 1, 256)
    shared.q_proj(x)  # something computed and held when the copy is made
    twin = copy.deepcopy(shared)
    assert twin.q_proj.shared is twin.k_proj.shared and twin.q_proj.shared is not shared.q_proj.shared
    assert twin.q_proj.shared.weights[0][0] is twin.q_proj.qweight
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(twin, name)(x), getattr(shared, name)(x))


def test_threads_do_not_see_each_others_products() -> None:
    reference, shared = _attention(), _attention()
    share_inputs(shared)
    errors: list[str] = []
    barrier = threading.Barrier(2)

    def run(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.randn(1, 1, 256, generator=generator)
            q = shared.q_proj(x)
            barrier.wait()  # the other thread computes its own group between our q and our k and v
            k, v = shared.k_proj(x), shared.v_proj(x)
            if not (torch.equal(q, reference.q_proj(x)) and torch.equal(k, reference.k_proj(x))
                    and torch.equal(v, reference.v_proj(x))):
                errors.append(f"thread {seed}")

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
