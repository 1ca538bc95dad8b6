"""Per-step sizes and offsets never enter a kernel's compile key, so a new prompt length, batch size or buffer offset
does not compile a kernel in the middle of a run (0.1 s each on a cold cache; PERFORMANCE.md, thirteenth pass)."""

from __future__ import annotations

from importlib import import_module

import pytest

# Modules by path: some packages re-export a launcher under its module's name.
kv_write = import_module("attention_zoo.triton_kernels.kv_write")
unified_attention = import_module("attention_zoo.triton_kernels.unified_attention")
exponential_race = import_module("research_lm.ops.exponential_race")
rotary = import_module("research_lm.ops.rotary")
eagle3_kernels = import_module("spec_decode.eagle3_kernels")
rejection_kernel = import_module("research_lm.ops.rejection_kernel")
step_inputs = import_module("research_lm.ops.step_inputs")
ngram_kernel = import_module("spec_decode.ngram_kernel")

UNSPECIALIZED = [  # (kernel, ints that change per step, pointers that may start at any offset)
    (kv_write._reshape_and_cache_kernel, ["num_tokens"], ["slot_mapping_ptr"]),
    (unified_attention._unified_attention_kernel, ["num_reqs"], []),
    (unified_attention._reduce_splits_kernel, ["num_reqs"], []),
    (step_inputs._gather_step_inputs_kernel, ["b", "t_pad"], ["staging_ptr"]),
    (step_inputs._write_row_tokens_kernel, ["m"], ["rows_ptr", "delta_ptr", "src_ptr", "count_ptr"]),
    (rotary._rotary_kernel, [], ["positions_ptr"]),
    (eagle3_kernels._eagle3_input_kernel, [], ["ids_ptr"]),
    (eagle3_kernels._argmax_gather_kernel, [], ["out_ptr"]),
    (exponential_race._race_kernel, ["chunk", "splits"], ["keys_ptr"]),
    (exponential_race._reduce_splits_kernel, ["splits"], []),
    (ngram_kernel._ngram_kernel, ["width"], ["rows_ptr"]),
    (rejection_kernel._rejection_kernel, ["K", "ids_stride", "host_stride"], ["ids_ptr", "host_ptr", "valid_ptr"]),
]


def _options(kernel, name: str) -> list:
    """The decorator's list: a JITFunction keeps it as an attribute, the interpreter's wrapper in `kwargs`."""
    kwargs = getattr(kernel, "kwargs", None)
    return list((kwargs.get(name) if kwargs is not None else getattr(kernel, name)) or [])


@pytest.mark.parametrize("kernel, ints, pointers", UNSPECIALIZED, ids=lambda v: getattr(v, "__name__", None))
def test_per_step_arguments_are_not_specialized(kernel, ints, pointers):
    assert set(ints) <= set(_options(kernel, "do_not_specialize"))
    assert set(pointers) <= set(_options(kernel, "do_not_specialize_on_alignment"))
