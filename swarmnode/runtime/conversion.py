"""Checkpoint tensors converted as `from_pretrained` converts them, one target tensor at a time.

`transformers` 5 keeps some weights in another form than checkpoints store them: mixtures of experts hold all
experts of a block as fused 3-D parameters (`mlp.experts.gate_up_proj`) where Qwen3-MoE, DeepSeek and GLM
checkpoints store one 2-D tensor per expert and projection (`mlp.experts.7.gate_proj.weight`), Mixtral's
`block_sparse_moe.experts.7.w1.weight` is renamed and fused the same way, and older checkpoints carry legacy
names. The rules are the library's own (`transformers.conversion_mapping.get_model_conversion_mapping`) and so is
the code that applies them (`transformers.core_model_loading`): this module only feeds them a subset of the
checkpoint's tensors, lazily, so that a node reads just its blocks' tensors and holds at most one converted
target (and the sources it is made of) beside what it has already built. Each source is cast as it is read to
the dtype its target takes: the served dtype, or float32 for what the family keeps in float32 at lower
precisions (`_keep_in_fp32_modules_strict`, e.g. DeepSeek's router), as `from_pretrained`'s dtype plan does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from copy import deepcopy
from typing import TYPE_CHECKING

import torch

from swarmnode.runtime.checkpoint import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Conversion", "LazyTensor"]

#: A tensor read only when called, cast to the dtype given (None: as stored).
LazyTensor = Callable[[torch.dtype | None], torch.Tensor]


class Conversion:
    """The conversion rules of one model (a meta-device skeleton from `runtime.family.ModelFamily`)."""

    def __init__(self, skeleton: PreTrainedModel):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.skeleton = skeleton
        mapping = get_model_conversion_mapping(skeleton)
        self._renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self._converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._targets = skeleton.state_dict()  # meta tensors: names and shapes only, no memory
        self._base_prefix = getattr(skeleton, "base_model_prefix", None)
        self._fp32_plans: dict[torch.dtype, re.Pattern | None] = {}

    def dtype_for(self, target: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype model tensor `target` takes in a model served in `dtype`: `dtype`, or float32 where
        `from_pretrained`'s dtype plan keeps it so (`PreTrainedModel._get_dtype_plan`)."""
        from transformers.core_model_loading import build_glob_alternation

        if dtype not in self._fp32_plans:
            plan = self.skeleton._get_dtype_plan(dtype)
            self._fp32_plans[dtype] = build_glob_alternation(list(plan))[0] if plan else None
        pattern = self._fp32_plans[dtype]
        return torch.float32 if pattern is not None and pattern.search(target) else dtype

    @property
    def converts(self) -> bool:
        """Whether this model has any rule beyond legacy renames (its checkpoints store tensors in another form)."""
        return bool(self._converters)

    def _rename(self, name: str) -> tuple[str, str | None]:
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(name, self._renamings, self._converters, self._base_prefix,
                                             self._targets)
        if renamed not in self._targets and name in self._targets:
            renamed, pattern = name, None
        return renamed, pattern

    def convert(self, sources: Iterable[tuple[str, LazyTensor]], dtype: torch.dtype | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(model name, tensor) for every target the checkpoint tensors `sources` (full names, lazy readers)
        make, one target at a time, in the model's order. A tensor is read when its target is built, cast to
        the dtype its target takes in a model served in `dtype` (:meth:`dtype_for`; None keeps stored dtypes).

        Raises :class:`CheckpointError` naming the checkpoint tensors that no model tensor takes.
        """
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

        planned: dict[str, WeightRenaming | WeightConverter] = {}
        unplaced = []
        for name, read in sorted(sources, key=lambda item: dot_natural_key(item[0])):
            target, pattern = self._rename(name)
            if target not in self._targets:
                unplaced.append(name)
                continue
            if pattern is not None:
                step = planned.setdefault(target, deepcopy(self._by_pattern[pattern]))
            else:
                step = planned.setdefault(target, WeightRenaming(name, target))
                pattern = name
            cast = None if dtype is None else self.dtype_for(target, dtype)
            # transformers annotates a Future, and its synchronous loading takes a callable (core_model_loading)
            step.add_tensor(target, name, pattern, functools.partial(read, cast))  # type: ignore[arg-type]
        if unplaced:
            raise CheckpointError(f"the checkpoint has tensors this model has no place for: {unplaced[:6]}"
                                  f"{' ...' if len(unplaced) > 6 else ''} (is config.json the checkpoint's own?)")
        for first, step in planned.items():
            made = step.convert(first, model=self.skeleton, config=self.skeleton.config)
            for target, tensor in made.items():
                yield target, tensor[0] if isinstance(tensor, list) else tensor
            del made
