"""bench/cpu/op_count.py: the dispatched ops of one step per mode (issue 47, item 1)."""

from __future__ import annotations

import json

import torch
from bench_scripts import import_bench


def test_counts_each_modes_ops_with_the_noise_and_writes_the_table(tmp_path):
    oc = import_bench("op_count")
    assert oc.main(["--tiny", "--models", "gnresnet10", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "op_count.json").read_text())
    modes = report["results"][0]["modes"]
    assert list(modes) == ["nonprivate", "bk", "hooks", "ghost"]
    for m in modes.values():
        assert sum(m["by_op"].values()) == m["ops"] > 0 and m["bytes_allocated"] > 0
    assert modes["nonprivate"]["ratio"] == 1.0
    assert modes["nonprivate"]["by_op"]["convolution"] == modes["bk"]["by_op"]["convolution"]
    # the DP modes draw noise: one flat draw for the model (per_sample.optimizers.flat_noise),
    # not one per parameter tensor; the plain step none
    assert modes["bk"]["by_op"].get("normal", 0) == 1, modes["bk"]["by_op"]
    assert "normal" not in modes["nonprivate"]["by_op"]
    # the kept per-example gradients' norms and sums in one reduction and one product
    # (per_sample.arena): no square or matrix product per parameter tensor
    n_params = sum(
        1 for _ in oc.create_model(oc.SETTINGS["gnresnet10"].model, 10, 1, 0).parameters()
    )
    assert modes["bk"]["by_op"].get("pow", 0) < n_params // 4, modes["bk"]["by_op"]
    assert modes["bk"]["by_op"].get("mm", 0) < n_params // 4, modes["bk"]["by_op"]
    assert all(modes[m]["ops"] > modes["nonprivate"]["ops"] for m in ("bk", "hooks", "ghost"))
    assert "| gnresnet10 | 8 | bk |" in (tmp_path / "op_count.md").read_text()


def test_views_and_allocations_are_left_out():
    oc = import_bench("op_count")
    x = torch.randn(4, 3)
    with oc.OpCounter() as c:
        y = x.view(12)
        torch.empty(3)
        z = y * 2
        z.add_(1)
        with torch.autograd.profiler.record_function("an annotation"):  # launches nothing
            pass
    assert c.ops == {"mul": 1, "add_": 1}, c.ops
    assert c.views["view"] == 1 and c.views["empty"] == 1
    assert c.views["_record_function_enter_new"] == c.views["_record_function_exit"] == 1
    assert c.bytes == 12 * 4  # the product's storage; the in-place add allocates nothing


def test_as_a_gpu_runs_it_the_update_is_one_foreach_call_and_gn_one_kernel():
    """--as-gpu: SGD's CUDA default (one `_foreach` update, not one `add_` per tensor) in every
    mode, bk's choices where launches dominate; and in either count a GroupNorm's per-example
    gradients cost one kernel (`rules.group_norm_folded`), not a normalisation, a product and
    two sums, and that kernel gives the input gradient too."""
    oc = import_bench("op_count")
    args = (["nonprivate", "bk"], 8, True)
    cpu = oc.count_model("gnresnet10", *args)["modes"]
    gpu = oc.count_model("gnresnet10", *args, as_gpu=True)["modes"]
    n_params = sum(
        1 for _ in oc.create_model(oc.SETTINGS["gnresnet10"].model, 10, 1, 0).parameters()
    )
    for mode in ("nonprivate", "bk"):
        assert cpu[mode]["by_op"]["add_"] >= n_params - 1, cpu[mode]["by_op"]
        assert "add_" not in gpu[mode]["by_op"] and gpu[mode]["by_op"]["_foreach_add_"] == 1
        assert gpu[mode]["ops"] < cpu[mode]["ops"]
    # the forward's GroupNorms, and one backward kernel each for the input gradient and the
    # per-example gradients together (`norm_fusion`), as many as the non-private step's; the
    # weights repeated per example for all of them from one gather
    n_gn = cpu["nonprivate"]["by_op"]["native_group_norm"]
    for counts in (cpu, gpu):
        assert counts["bk"]["by_op"]["native_group_norm"] == n_gn
        assert counts["bk"]["by_op"]["native_group_norm_backward"] == n_gn
        assert counts["bk"]["by_op"]["index_select"] == 1


def test_an_unpadded_convs_patches_are_one_copy():
    """An unpadded conv's patches (the 1x1 downsampling convs) are one copy of its windows,
    where a channels-last copy of the whole input came first (issue 47); its ghost norm
    (`rules.ghost`) is two Grams, their product and a sum, and equals the per-example
    gradients' in float64."""
    from dpadapter.per_sample import conv, rules

    oc = import_bench("op_count")
    m = torch.nn.Conv2d(8, 16, 1, stride=2, bias=False).double()
    a = torch.randn(4, 8, 14, 14, dtype=torch.float64)  # NCHW, as a layer's input comes
    g = torch.randn(4, 16, 7, 7, dtype=torch.float64)
    workspace: dict = {}
    conv.patches(m, a, workspace)  # the buffer is made once, then reused
    with oc.OpCounter() as c:
        norms = rules.ghost(conv.patches(m, a, workspace), g.reshape(4, 16, 49))
    assert c.ops == {"copy_": 1, "bmm": 2, "mul": 1, "sum": 1}, c.ops
    per_example = torch.einsum(
        "nct,ndt->ncd", g.reshape(4, 16, 49), a[:, :, ::2, ::2].reshape(4, 8, 49)
    )
    torch.testing.assert_close(norms, per_example.pow(2).sum((1, 2)), rtol=1e-12, atol=0)


def test_a_ghost_group_is_its_grams_then_one_product_and_one_sum():
    """Three layers of one Gram shape (per_sample.ghost): their six Grams, then one product
    and one sum, where alone each took its own; the same norms bit for bit."""
    from dpadapter.per_sample.ghost import GhostGroups, ghost

    oc = import_bench("op_count")
    g = torch.Generator().manual_seed(0)
    layers = [
        (torch.randn(4, 9, 5 + i, generator=g, dtype=torch.float64),
         torch.randn(4, 3 + i, 9, generator=g, dtype=torch.float64))
        for i in range(3)
    ]  # fmt: skip
    alone = [ghost(a, g) for a, g in layers]
    groups = GhostGroups.plan([(a, a.shape[1]) for a, _ in layers], {})
    assert list(groups.sizes.values()) == [[3]]
    with oc.OpCounter() as c:
        parts = groups.resolve([groups.norm(a, g) for a, g in layers])
    assert c.ops == {"bmm": 6, "mul": 1, "sum": 1}, c.ops
    with oc.OpCounter() as c:
        [ghost(a, g) for a, g in layers]
    assert c.ops == {"bmm": 6, "mul": 3, "sum": 3}, c.ops
    for got, want in zip(parts, alone, strict=True):
        assert torch.equal(got, want)
