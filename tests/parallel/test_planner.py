"""`t5forge plan`: the ranking of layouts on two clusters, the time model's communication against
comm_model's bytes and the ring / alpha-beta formulas, the answer for a model too large for every layout,
the JSON output, and bad input (one line, exit 2). The model is xxl-wide but two blocks deep, so that
comm_model (one meta model per reading) stays fast; the planning time of mT5-xxl on 1024 GPUs is measured
by `t5forge bench planner`, not here."""

from __future__ import annotations

import json
import math

import pytest

from t5forge.cli import main
from t5forge.errors import ConfigError
from t5forge.models.hf import config_to_hf
from t5forge.models.t5 import T5Config
from t5forge.parallel.comm_model import step_requirements
from t5forge.parallel.memory_model import estimate_memory
from t5forge.parallel.planner import (
    ALPHA_INTER,
    ALPHA_INTRA,
    MEMORY_MARGIN,
    Candidate,
    Planner,
    SharedCores,
    Workload,
    affine_requirements,
    make_cluster,
    parse_bandwidth,
    parse_memory,
)

# mT5-xxl's width (d_model 4096, 64 heads, d_ff 10240), one encoder and one decoder block: 1.5 B parameters.
WIDE = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=1, num_decoder_layers=1,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False)
WORKLOAD = Workload(global_batch=16, inputs_length=512, targets_length=114)


@pytest.fixture(scope="module")
def wide() -> T5Config:
    return T5Config(**WIDE)


@pytest.fixture
def model_dir(tmp_path, wide):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(wide)))
    return tmp_path


def ring_bytes(kind: str, n: int, nbytes: int) -> float:
    """What one rank sends in a ring collective over n ranks (NCCL's algorithm, independent of the planner)."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}[kind] * nbytes


def test_one_node_and_two_nodes_rank_differently_and_tp_stays_inside_a_node(wide):
    one_node = Planner(wide, make_cluster(8, "A100", 8), WORKLOAD).plan(top=3)
    two_nodes = Planner(wide, make_cluster(8, "A100", 4), WORKLOAD).plan(top=3)
    slow = Planner(wide, make_cluster(8, "A100", 4, inter_node=parse_bandwidth("20Gbps")), WORKLOAD).plan(top=3)
    assert one_node.ranked[0].link_bytes["inter_node"] == 0
    for plan in (two_nodes, slow):
        assert plan.ranked[0].candidate.tp <= 4  # the winner keeps tensor parallelism off the network
    # A slower network moves the winner to a layout that sends less over it.
    fast_winner, slow_winner = two_nodes.ranked[0], slow.ranked[0]
    assert slow_winner.candidate != fast_winner.candidate
    slow_planner = Planner(wide, make_cluster(8, "A100", 4, inter_node=parse_bandwidth("20Gbps")), WORKLOAD)
    assert slow_winner.link_bytes["inter_node"] < slow_planner.predict(fast_winner.candidate).link_bytes["inter_node"]


def test_the_winner_is_the_fastest_fitting_layout_of_all(wide):
    planner = Planner(wide, make_cluster(8, "A100", 4), WORKLOAD)
    plan = planner.plan(top=3)
    everything = [planner.predict(c) for c in planner.candidates()[0]]
    fitting = [p for p in everything if p.memory_total <= (1 - MEMORY_MARGIN) * planner.cluster.memory]
    assert plan.ranked[0].step_s == pytest.approx(min(p.step_s for p in fitting))
    assert [p.step_s for p in plan.ranked] == sorted(p.step_s for p in plan.ranked)
    assert len({p.candidate.name for p in plan.ranked}) == len(plan.ranked)


def test_tensor_parallel_over_the_network_is_slower_than_inside_a_node(wide):
    planner = Planner(wide, make_cluster(8, "A100", 4), WORKLOAD)
    across = planner.explain("dp1_tp8_pp1_zero0_mb4_acnone")
    inside = planner.explain("dp2_tp4_pp1_zero0_mb4_acnone")
    assert across.link_bytes["inter_node"] == pytest.approx(across.dim_bytes["tp"] / 4)  # 4 ranks per node
    assert inside.link_bytes["inter_node"] == pytest.approx(inside.dim_bytes["dp"])  # tp's bytes stay inside
    assert across.parts["tp"] > inside.parts["tp"]


def test_the_data_parallel_bytes_are_comm_models_with_ring_factors(wide):
    """dp16 over two nodes of 8, ZeRO-1: what a GPU sends is comm_model's payload times the ring factor, and
    1/8 of it goes through its NIC (a ring with 8 channels, one per NIC, crosses each node boundary once)."""
    planner = Planner(wide, make_cluster(16, "A100", 8), WORKLOAD)
    c = Candidate(dp=16, zero_stage=1, micro_batch_size=1)
    planner.check(c)
    p = planner.predict(c)
    required = step_requirements(wide, planner.shapes(c), planner.layout(c))
    expected = sum(ring_bytes(r.kind, 16, r.nbytes) for r in required if r.dim == "dp")
    assert p.dim_bytes["dp"] == pytest.approx(expected)
    assert p.link_bytes["inter_node"] == pytest.approx(expected / 8)
    assert p.link_bytes["intra_node"] == pytest.approx(expected * 7 / 8)


def test_one_rank_per_node_sends_everything_through_its_nic(wide):
    """dp2 x tp8 on two nodes of 8: each data-parallel group has one rank per node."""
    cluster = make_cluster(16, "A100", 8)
    planner = Planner(wide, cluster, WORKLOAD)
    c = Candidate(dp=2, tp=8, zero_stage=0, micro_batch_size=8)
    planner.check(c)
    p = planner.predict(c)
    required = [r for r in step_requirements(wide, planner.shapes(c), planner.layout(c)) if r.dim == "dp"]
    assert p.link_bytes["inter_node"] == pytest.approx(sum(ring_bytes(r.kind, 2, r.nbytes) for r in required))


def test_tensor_parallel_time_is_alpha_beta_over_nvlink(wide):
    """tp8 inside one node, no data parallelism: the exposed tensor-parallel time of the step is, per
    collective of comm_model, its latency (a tree of log2(8) hops, twice for an all-reduce) plus its ring bytes
    over NVLink."""
    cluster = make_cluster(8, "A100", 8)
    planner = Planner(wide, cluster, WORKLOAD)
    c = Candidate(dp=1, tp=8, micro_batch_size=4)
    planner.check(c)
    required = [r for r in step_requirements(wide, planner.shapes(c), planner.layout(c)) if r.dim == "tp"]
    expected = sum(r.count * 3 * (2 if r.kind == "all_reduce" else 1) * ALPHA_INTRA
                   + ring_bytes(r.kind, 8, r.nbytes) / cluster.intra_node for r in required)
    assert planner.predict(c).parts["tp"] == pytest.approx(expected)
    assert ALPHA_INTER > ALPHA_INTRA


def by_purpose(requirements) -> dict:
    out: dict = {}
    for r in requirements:
        count, nbytes = out.get((r.kind, r.dim, r.what), (0, 0))
        out[(r.kind, r.dim, r.what)] = (count + r.count, nbytes + r.nbytes)
    return out


def test_pipelined_requirements_at_any_micro_batch_are_comm_models(wide):
    """Read at three micro-batch shapes, comm_model's requirements of a pipelined layout are those it gives at
    any other (per purpose: its gradient buckets are summed)."""
    deeper = T5Config(**{**WIDE, "num_layers": 2, "num_decoder_layers": 2})
    planner = Planner(deeper, make_cluster(8, "A100", 8), WORKLOAD)
    c = Candidate(dp=2, tp=2, pp=2, zero_stage=1, micro_batch_size=1)
    layout, shapes = planner.layout(c), planner.shapes(c)
    for rank in range(2):
        at = affine_requirements(deeper, shapes, layout, rank)
        for b, m in ((4, 2), (2, 4), (1, 8)):
            direct = step_requirements(deeper, shapes.__class__(b, m, 512, 114), layout, 0, rank)
            assert by_purpose(at(b, m)) == by_purpose(direct)


def test_a_model_too_large_for_every_layout_gets_the_memory_that_would_fit(wide, model_dir, capsys):
    planner = Planner(wide, make_cluster(1, "V100", memory=parse_memory("8GiB")), Workload(4, 512, 114))
    plan = planner.plan()
    assert plan.ranked == [] and plan.too_large is not None
    least = min(estimate_memory(wide, planner.layout(c), planner.shapes(c)).total for c in planner.candidates()[0])
    assert plan.too_large.memory_needed == math.ceil(least / (1 - MEMORY_MARGIN))
    assert plan.too_large.best.fits
    assert main(["plan", str(model_dir), "--gpus", "1", "--gpu", "V100", "--gpu-memory", "8GiB",
                 "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "No layout fits in 8.0 GiB" in out and plan.too_large.best.candidate.name in out
    assert "not built" in out  # CPU offload


def test_json_output(model_dir, capsys):
    assert main(["plan", str(model_dir), "--gpus", "8", "--gpus-per-node", "4", "--global-batch", "16",
                 "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["gpus"] == 8 and out["cluster"]["gpus_per_node"] == 4
    assert 1 <= len(out["layouts"]) <= 2
    first = out["layouts"][0]
    assert set(first["memory_bytes"]) == {"parameters", "gradients", "optimizer", "activations", "temporary", "total"}
    assert set(first["bytes_per_step"]) == {"intra_node", "inter_node"}
    assert first["samples_per_s"] == pytest.approx(16 / first["step_s"])
    assert first["why"] and out["too_large"] is None


def test_explain_prints_the_breakdown(model_dir, capsys):
    assert main(["plan", str(model_dir), "--gpus", "4", "--global-batch", "16", "--explain", "dp2_tp2_zero1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dp2_tp2_pp1_zero1_mb") and "step " in out and "tensor-parallel" in out


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--gpu", "B300"], "unknown GPU 'B300'"),
    (["--gpus", "8", "--gpu-memory", "80XB"], "memory size '80XB'"),
    (["--gpus", "8", "--inter-node-bandwidth", "fast"], "bandwidth 'fast'"),
    (["--gpus", "3", "--explain", "dp1_tp3_mb1"], "num_heads=64 is not divisible by parallel.tp=3"),
    (["--gpus", "4", "--explain", "dp1_pp4_mb4"], "the model has only 2 blocks"),
    (["--gpus", "8", "--explain", "dp2_tp2_mb1"], "dp x tp x pp = 2 x 2 x 1 = 4"),
])
def test_bad_input_is_one_line_and_exit_2(model_dir, capsys, args, message):
    assert main(["plan", str(model_dir), "--global-batch", "16", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("t5forge plan: error: ") and message in err


def test_sizes_and_rates_parse_with_their_units():
    assert parse_memory("80GiB") == parse_memory("80G") == 80 * 2**30
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_bandwidth("400Gbps") == parse_bandwidth("400Gb/s") == 50e9
    assert parse_bandwidth("200GB/s") == 200e9
    with pytest.raises(ConfigError):
        parse_memory("eighty")


# -- rank placement and links --------------------------------------------------------------------------------
def test_mesh_ranks_fill_the_innermost_dimension_with_consecutive_ranks():
    from itertools import permutations

    from t5forge.parallel.mesh import mesh_ranks

    sizes = {"pp": 2, "dp": 3, "tp": 2}
    for order in map("-".join, permutations(("tp", "dp", "pp"))):
        grid = mesh_ranks(sizes["pp"], sizes["dp"], sizes["tp"], order)
        assert sorted(grid.flatten().tolist()) == list(range(12))
        # Strides: 1 for the innermost dimension, times each size going outwards (Megatron's order).
        names, stride, strides = order.split("-"), 1, {}
        for name in names:
            strides[name], stride = stride, stride * sizes[name]
        for p in range(2):
            for d in range(3):
                for t in range(2):
                    assert grid[p, d, t] == p * strides["pp"] + d * strides["dp"] + t * strides["tp"], order
    assert mesh_ranks(1, 2, 2).tolist() == [[[0, 1], [2, 3]]]  # the default: tp groups {0, 1} and {2, 3}
    assert mesh_ranks(1, 2, 2, "dp-tp-pp").tolist() == [[[0, 2], [1, 3]]]


def test_link_totals_say_which_collectives_cross_nodes():
    from t5forge.parallel.comm_model import Layout, Shapes, group_ranks, link_totals

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_heads=4, num_layers=2, num_decoder_layers=2)
    shapes = Shapes(micro_batch_size=2, accumulation=1, inputs_length=8, targets_length=4)

    def crossing(layout, rank=0, per_node=2):
        totals = link_totals(step_requirements(config, shapes, layout, 0, 0), layout, per_node, rank)
        return {(kind, dim) for (kind, dim, link), v in totals.items() if link == "inter-node" and v["bytes"]}

    good, bad = Layout(dp=2, tp=2), Layout(dp=2, tp=2, rank_order="dp-tp-pp")
    assert group_ranks("tp", bad, 3) == [1, 3] and group_ranks("dp", bad, 3) == [2, 3]
    assert {dim for _, dim in crossing(good)} == {"dp"}  # tp stays inside the nodes
    assert {dim for _, dim in crossing(bad)} == {"tp"}  # and dp inside them here
    assert crossing(good, per_node=4) == set()  # one node


def test_pipeline_sends_cross_nodes_only_at_the_boundary_between_them():
    from t5forge.parallel.comm_model import Layout, Shapes, link_totals

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_heads=4, num_layers=2, num_decoder_layers=2)
    shapes = Shapes(micro_batch_size=2, accumulation=2, inputs_length=8, targets_length=4)
    layout = Layout(pp=4, pp_layers=(1, 1, 1, 1))  # one block per stage, two stages per node
    links = {}
    for pp_rank in range(4):
        requirements = [r for r in step_requirements(config, shapes, layout, 0, pp_rank) if r.kind == "send"]
        totals = link_totals(requirements, layout, ranks_per_node=2, rank=pp_rank)
        links[pp_rank] = {link for (_, _, link), v in totals.items() if v["count"]}
    # Stage 1 -> 2 (and its gradients back) is the only boundary between the nodes.
    assert links == {0: {"intra-node"}, 1: {"intra-node", "inter-node"}, 2: {"intra-node", "inter-node"},
                     3: {"intra-node"}}


def test_the_planner_times_tensor_parallelism_across_nodes_on_the_network(wide):
    from t5forge.parallel.planner import parse_layout

    cluster = make_cluster(4, "A100", 2, inter_node=parse_bandwidth("100Gbps"))
    planner = Planner(wide, cluster, WORKLOAD)
    assert parse_layout("dp2_tp2_zero1_mb2_dp-tp-pp")["rank_order"] == "dp-tp-pp"
    good = planner.explain("dp2_tp2_zero1_mb2")
    bad = planner.explain("dp2_tp2_zero1_mb2_dp-tp-pp")
    assert bad.candidate.name == "dp2_tp2_pp1_zero1_mb2_acnone_dp-tp-pp"

    def groups(p):
        return {(c["kind"], c["dim"]): c["group"] for c in p.collectives}

    assert groups(good)[("all_reduce", "tp")] == "in a node" and groups(good)[("reduce_scatter", "dp")] == "across nodes"
    assert groups(bad)[("all_reduce", "tp")] == "across nodes" and groups(bad)[("reduce_scatter", "dp")] == "in a node"
    # Each placement sends its crossing dimension's bytes through the NIC, the other's over NVLink.
    tp_wire, dp_wire = good.dim_bytes["tp"], good.dim_bytes["dp"]
    assert good.link_bytes["inter_node"] == pytest.approx(dp_wire + good.dim_bytes.get("dp_tp", 0.0) / 2)
    assert bad.link_bytes["inter_node"] == pytest.approx(tp_wire + bad.dim_bytes.get("dp_tp", 0.0) / 2)
    # Tensor parallelism's activations over the slower link cost more time, data parallelism's gradients less
    # (here, 1.5 B parameters at batch 16, the gradients weigh more: the planner prefers the bad mapping).
    assert bad.parts["tp"] > good.parts["tp"] and bad.parts["dp"] <= good.parts["dp"]


def test_gloo_reduce_scatter_moves_an_all_reduce_worth_of_bytes(wide):
    from dataclasses import replace

    c = Candidate(dp=4, zero_stage=1, micro_batch_size=4)
    nccl = Planner(wide, make_cluster(4, "A100", 4), WORKLOAD)
    gloo = Planner(wide, replace(nccl.cluster, backend="gloo"), WORKLOAD)  # ProcessGroupGloo: an all-reduce
    scatter = next(r for r in nccl.requirements(c, 0) if r.kind == "reduce_scatter")
    assert nccl.collective_time(scatter, c)[1] == ring_bytes("reduce_scatter", 4, scatter.nbytes)
    assert gloo.collective_time(scatter, c)[1] == ring_bytes("all_reduce", 4, scatter.nbytes)


def test_ranks_sharing_cores_take_at_least_all_their_cpu_seconds_over_the_cores(wide):
    """On shared cores (the CPU cluster of `t5forge bench cluster`), the micro-batches and the optimizer step
    take at least all ranks' CPU seconds over the cores: each rank's micro-batches at its tensor-parallel
    degree (measured with its tensor-parallel collectives inside a node), its share of the optimizer step and,
    per other collective of comm_model, its hops and the bytes it sends (gloo: a reduce-scatter runs as an
    all-reduce). Where the critical path is longer, the bound adds nothing."""
    from dataclasses import replace

    gloo = replace(make_cluster(2, "A100", 2), backend="gloo")
    c = Candidate(dp=1, tp=2, micro_batch_size=2)
    alone = Planner(wide, gloo, WORKLOAD)
    alone.check(c)
    without = alone.predict(c)
    assert "cpu" not in without.parts
    microbatches = WORKLOAD.global_batch // c.micro_batch_size  # dp 1
    hop, per_byte, micro, optimizer = 2e-3, 1e-9, 40.0, 6.0  # micro: at a micro-batch of 1
    all_reduce_like = ("all_reduce", "reduce_scatter")
    requirements = step_requirements(wide, alone.shapes(c), alone.layout(c))
    assert any(r.dim == "tp" for r in requirements)

    def comm_cpu(tp_included: bool) -> float:
        return sum(r.count * (2 if r.kind in all_reduce_like else 1) * hop
                   + ring_bytes("all_reduce" if r.kind in all_reduce_like else r.kind, 2, r.nbytes) * per_byte
                   for r in requirements if tp_included or r.dim != "tp")
    comm = comm_cpu(tp_included=False)  # the measured degree 2 holds its tensor-parallel collectives
    rank_cpu = microbatches * micro * c.micro_batch_size + optimizer / c.tp + comm
    shared = SharedCores(cores=1, micro_batch_size=1, microbatch_cpu_s=((1, 1.0), (2, micro)), optimizer_cpu_s=optimizer,
                         hop_cpu_intra=hop, hop_cpu_inter=0.0, byte_cpu_intra=per_byte, byte_cpu_inter=0.0)
    bound = Planner(wide, replace(gloo, shared_cores=shared), WORKLOAD).predict(c)
    critical = sum(without.parts[k] for k in ("compute", "tp", "p2p", "bubble"))
    assert 2 * rank_cpu / 1 > critical  # the bound is what limits this step
    assert bound.parts["cpu"] == pytest.approx(2 * rank_cpu - critical)
    assert bound.step_s == pytest.approx(2 * rank_cpu + without.parts["dp"] + without.parts["other"])
    # Cores that are plenty: the critical path as without them.
    idle = replace(shared, cores=10**6)
    assert Planner(wide, replace(gloo, shared_cores=idle), WORKLOAD).predict(c).step_s == pytest.approx(without.step_s)
    # A degree the probes did not measure: 1/tp of tp 1's, in proportion to the micro-batch, and its
    # tensor-parallel collectives counted apart.
    assert shared.microbatch(4, 2) == pytest.approx(1.0 / 4 * 2)
    unmeasured = replace(shared, microbatch_cpu_s=((1, 2 * micro),))
    apart = Planner(wide, replace(gloo, shared_cores=unmeasured), WORKLOAD).predict(c)
    assert apart.parts["cpu"] == pytest.approx(2 * (rank_cpu - comm + comm_cpu(tp_included=True)) - critical)
    # Tensor-parallel collectives across nodes: what a hop and a byte cost there more than inside a node.
    assert shared.collective(10, 1e6, crosses=True, in_microbatch=True) == 0.0  # inter costs less here
    dearer = replace(shared, hop_cpu_inter=3 * hop, byte_cpu_inter=2 * per_byte)
    assert dearer.collective(10, 1e6, crosses=True, in_microbatch=True) == pytest.approx(10 * 2 * hop + 1e6 * per_byte)
    assert dearer.collective(10, 1e6, crosses=False, in_microbatch=True) == 0.0
    assert dearer.collective(10, 1e6, crosses=True) == pytest.approx(10 * 3 * hop + 1e6 * 2 * per_byte)
