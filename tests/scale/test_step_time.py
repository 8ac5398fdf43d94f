"""The step-time model's pieces on hand-written programs and small targets: a matmul's cost and the matrix unit's
tile, a collective's cost on a known topology, loop trip counts, and asynchronous collectives hidden behind
compute."""

import json
import math
import subprocess
import sys

import pytest

from olmax.scale import hardware, hlo, op_cost, simulator, step_time
from olmax.scale.targets import parse_target

TPU = hardware.Hardware("test tpu", "tpu", {"bf16": 100e12, "f32": 100e12}, 1.0, 1e12, 1.0, (8, 256, 256),
                         link_bandwidth=50e9, collective_efficiency=1.0, torus=(4, 4, 4), wraparound=True)


def program(entry: str, *computations: str) -> str:
    return "HloModule m, is_scheduled=true\n" + "\n".join(computations) + f"\nENTRY %main () -> f32[] {{\n{entry}\n}}\n"


def predict(text: str, hw=TPU, coords=None) -> dict:
    return step_time.predict(text, hw, coords)


def dot_program(m: int, n: int, k: int) -> str:
    return program(f"""  %a = bf16[{m},{k}]{{1,0}} parameter(0)
  %b = bf16[{k},{n}]{{1,0}} parameter(1)
  ROOT %d = bf16[{m},{n}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}""")


def test_a_matmul_costs_its_flops_at_the_peak_and_a_half_filled_unit_costs_a_full_one():
    big = predict(dot_program(8192, 8192, 8192))
    flops = 2 * 8192**3
    assert big["executed_flops"] == flops
    assert big["seconds"]["matmul"] == pytest.approx(flops / 100e12, rel=1e-6)
    # a contraction of 128 fills half of a 256-wide systolic array: the same time as 256 would take
    half = predict(dot_program(8192, 8192, 128))["seconds"]["matmul"]
    full = predict(dot_program(8192, 8192, 256))["seconds"]["matmul"]
    assert half == pytest.approx(full, rel=1e-6)
    # and on a 128-wide unit (v5p's) it runs at the full rate: half the time of 256
    v5p = hardware.Hardware(**{**TPU.__dict__, "tile": (8, 128, 128)})
    assert predict(dot_program(8192, 8192, 128), v5p)["seconds"]["matmul"] == pytest.approx(full / 2, rel=1e-6)


def test_a_small_matmul_is_bound_by_memory():
    """A matrix-vector product moves its matrix: its time is the bytes at the memory's bandwidth."""
    found = predict(dot_program(1, 8192, 8192))
    moved = 2 * (8192 * 8192 + 8192 + 8192)
    assert found["seconds"]["matmul"] == pytest.approx(moved / 1e12, rel=1e-6)


def test_a_convolution_that_pads_its_window_counts_only_the_taps_on_real_input():
    """The TPU compiler's batched matmul as a convolution: a window of 4 over an input of 1 padded by 3 each side
    touches one real element per output position (4 matmuls of 64 x 64 x 64, not 16)."""
    text = program("""  %l = bf16[64,64,1]{1,0,2} parameter(0)
  %r = bf16[4,64,64]{1,2,0} parameter(1)
  ROOT %c = bf16[4,64,64]{1,2,0} convolution(%l, %r), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=fb0_0oi->0fb""")
    assert predict(text)["executed_flops"] == 2 * 4 * 64 * 64 * 64


ALL_GATHER = """  %x = bf16[{shard}]{{0}} parameter(0)
  ROOT %g = bf16[{whole}]{{0}} all-gather(%x), replica_groups={groups}, dimensions={{0}}"""


def coords_4x4x4():
    return [{"x": i % 4, "y": i // 4 % 4, "z": i // 16, "core": 0} for i in range(64)]


def test_a_ring_collective_moves_its_share_over_the_links_its_group_spans():
    size = 2**30  # bytes of the gathered array a device ends with
    shard, whole = size // 2 // 4, size // 2
    # 4 devices along x, a ring with wraparound: (n-1)/n of the bytes over two links (both ways round)
    along_x = predict(program(ALL_GATHER.format(shard=shard, whole=whole, groups="[16,4]<=[64]")), coords=coords_4x4x4())
    expected = 3 / 4 * size / (2 * 50e9) + TPU.collective_latency
    assert along_x["collectives"]["total_seconds"] == pytest.approx(expected, rel=1e-6)
    # the same over all 64 chips spans three dimensions: six links a chip
    everyone = predict(program(ALL_GATHER.format(shard=size // 2 // 64, whole=whole, groups="[1,64]<=[64]")),
                       coords=coords_4x4x4())
    assert everyone["collectives"]["total_seconds"] == pytest.approx(63 / 64 * size / (6 * 50e9), rel=1e-6)
    # an all-reduce is a reduce-scatter and an all-gather: twice the bytes
    reduce = predict(program(f"""  %x = bf16[{whole}]{{0}} parameter(0)
  ROOT %r = bf16[{whole}]{{0}} all-reduce(%x), replica_groups=[16,4]<=[64], to_apply=%add"""), coords=coords_4x4x4())
    assert reduce["collectives"]["total_seconds"] == pytest.approx(2 * expected, rel=1e-6)
    # without wraparound (a slice smaller than a cube) a ring has one link a device: twice as long
    mesh = hardware.Hardware(**{**TPU.__dict__, "wraparound": False})
    assert predict(program(ALL_GATHER.format(shard=shard, whole=whole, groups="[16,4]<=[64]")), mesh,
                   coords_4x4x4())["collectives"]["total_seconds"] == pytest.approx(2 * expected, rel=1e-6)


def test_an_all_to_all_is_bound_by_the_bisection_and_a_gpu_host_by_its_network():
    size = 2**30
    text = program(f"""  %x = bf16[{size // 2}]{{0}} parameter(0)
  ROOT %a = bf16[{size // 2}]{{0}} all-to-all(%x), replica_groups=[16,4]<=[64], dimensions={{0}}""")
    # a ring of 4 with wraparound: k B / (8 L)
    assert predict(text, coords=coords_4x4x4())["collectives"]["total_seconds"] == pytest.approx(
        4 * size / (8 * 50e9), rel=1e-6)
    gpu = hardware.target_hardware(parse_target("gpu:h100x16"))
    coords = [{"host": i // 8, "device": i} for i in range(16)]
    gather = ALL_GATHER.format(shard=size // 2 // 8, whole=size // 2, groups="{{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}")
    across = ALL_GATHER.format(shard=size // 2 // 2, whole=size // 2, groups="{{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}}")
    inside = predict(program(gather), gpu, coords)["collectives"]["total_seconds"]
    between = predict(program(across), gpu, coords)["collectives"]["total_seconds"]
    assert inside == pytest.approx(7 / 8 * size / (450e9 * gpu.collective_efficiency) + gpu.collective_latency)
    assert between == pytest.approx(1 / 2 * size / (50e9 * gpu.collective_efficiency) + gpu.collective_latency)


LOOP = """%cond (p: (bf16[8192,8192], {t}[])) -> pred[] {{
  %p = (bf16[8192,8192], {t}[]) parameter(0)
  %i = {t}[]{{:T(128)}} get-tuple-element(%p), index=1
  %n = {t}[]{{:T(128)}} constant({bound})
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}
%body (p: (bf16[8192,8192], {t}[])) -> (bf16[8192,8192], {t}[]) {{
  %p = (bf16[8192,8192], {t}[]) parameter(0)
  %i = {t}[] get-tuple-element(%p), index=1
  %x = bf16[8192,8192]{{1,0}} get-tuple-element(%p), index=0
  %y = bf16[8192,8192]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %s = {t}[] constant({step})
  %next = {t}[] add(%i, %s)
  ROOT %t = (bf16[8192,8192], {t}[]) tuple(%y, %next)
}}"""


@pytest.mark.parametrize("start, bound, step, config, counter, trips", [
    (0, 6, 1, "", "s32", 6),  # a scan: its counter against one constant
    (1, 6, 1, "", "s32", 5),  # its first iteration peeled by the compiler: the counter starts at 1
    # a bidirectional windowed einsum (TPU's collective matmul over 32 shards): an unsigned counter, two windows
    # an iteration, so 16 / 2 iterations
    (0, 16, 2, "", "u32", 8),
    (0, 99, 1, ', backend_config={"known_trip_count":{"n":"3"}}', "s32", 3),  # the compiler's own count wins
])
def test_a_loop_costs_its_body_times_its_trip_count(start, bound, step, config, counter, trips):
    text = program(f"""  %x = bf16[8192,8192]{{1,0}} parameter(0)
  %zero = {counter}[] constant({start})
  %init = (bf16[8192,8192], {counter}[]) tuple(%x, %zero)
  ROOT %w = (bf16[8192,8192], {counter}[]) while(%init), condition=%cond, body=%body{config}""",
                   LOOP.format(bound=bound, t=counter, step=step))
    found = predict(text)
    assert found["executed_flops"] == trips * 2 * 8192**3
    assert found["loops"] == [] and found["warnings"] == []
    assert found["step_seconds"] == pytest.approx(trips * 2 * 8192**3 / 100e12, rel=1e-3)


ASYNC = """  %w = bf16[{shard}]{{0}} parameter(0)
  %a = bf16[8192,8192]{{1,0}} parameter(1)
  %s = (bf16[{shard}]{{0}}, bf16[{whole}]{{0}}) all-gather-start(%w), replica_groups=[16,4]<=[64], dimensions={{0}}
{between}  %g = bf16[{whole}]{{0}} all-gather-done(%s)
{after}"""
MATMUL = "  %{name} = bf16[8192,8192]{{1,0}} dot(%a, %a), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}\n"


def test_an_asynchronous_collective_is_hidden_behind_the_compute_between_its_start_and_done():
    size = 2**30
    gather = 3 / 4 * size / (2 * 50e9) + TPU.collective_latency  # 8.05 ms
    matmul = 2 * 8192**3 / 100e12  # 11 ms
    fields = dict(shard=size // 8, whole=size // 2)
    hidden = predict(program(ASYNC.format(**fields, between=MATMUL.format(name="m1"), after=MATMUL.format(name="m2"))),
                     coords=coords_4x4x4())
    assert hidden["collectives"]["exposed_seconds"] == 0
    assert hidden["collectives"]["hidden_seconds"] == pytest.approx(gather, rel=1e-6)
    assert hidden["step_seconds"] == pytest.approx(2 * matmul, rel=1e-6)
    # nothing scheduled between start and done: the compute waits for all of it
    exposed = predict(program(ASYNC.format(**fields, between="", after=MATMUL.format(name="m1") + MATMUL.format(name="m2"))),
                      coords=coords_4x4x4())
    assert exposed["collectives"]["exposed_seconds"] == pytest.approx(gather, rel=1e-6)
    assert exposed["step_seconds"] == pytest.approx(2 * matmul + gather, rel=1e-6)
    # on the timeline the wait is one red (exposed) stretch of the links' lane
    assert [e["category"] for e in exposed["timeline"] if e["lane"] == "links"] == ["exposed"]
    # and among the op groups, by its kind; a hidden one is in none
    assert ({g["group"]: g["seconds"] for g in exposed["costliest"] if g["category"] == "collective"}
            == {"other: all-gather (exposed)": pytest.approx(gather, rel=1e-6)})
    assert not [g for g in hidden["costliest"] if g["category"] == "collective" and g["seconds"] > 0]


def test_replica_groups_in_every_form_xla_prints():
    instruction = hlo.parse_instruction(
        "  %r = f32[8]{0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add")
    assert hlo.replica_groups(instruction, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    instruction = hlo.parse_instruction(
        "  %r = f32[8]{0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add")
    assert hlo.replica_groups(instruction, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # a sub-axis: axis_1 (4) as a pre-size of 2 times the 2 the group varies along (its minor part)
    instruction = hlo.parse_instruction(
        "  %r = f32[8]{0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}, to_apply=%add")
    assert hlo.replica_groups(instruction, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    instruction = hlo.parse_instruction("  %r = f32[8]{0} all-reduce(%x), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add")
    assert hlo.replica_groups(instruction, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]


BLOCK_LOOP = """%cond (p: (s32[], s32[], bf16[128,1024])) -> pred[] {
  %p = (s32[], s32[], bf16[128,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
%body (p: (s32[], s32[], bf16[128,1024])) -> (s32[], s32[], bf16[128,1024]) {
  %p = (s32[], s32[], bf16[128,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  %x = bf16[128,1024]{1,0} get-tuple-element(%p), index=2
  %w = bf16[1024,1024]{1,0} constant({...})
  %y = bf16[128,1024]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], s32[], bf16[128,1024]) tuple(%next, %n, %y)
}"""


def block_loop_program(scope: str) -> str:
    """A loop over one expert's blocks of 128 rows, from and to bounds that are data (the block loop's inner loop)."""
    return program(f"""  %first = s32[] parameter(0)
  %last = s32[] parameter(1)
  %x = bf16[128,1024]{{1,0}} parameter(2)
  %init = (s32[], s32[], bf16[128,1024]) tuple(%first, %last, %x)
  ROOT %w = (s32[], s32[], bf16[128,1024]) while(%init), condition=%cond, body=%body, metadata={{op_name="jit(step)/layer0.global/{scope}/while"}}""",
                   BLOCK_LOOP)


def test_a_data_dependent_block_loop_costs_the_blocks_the_routing_gives_each_expert():
    """The block loop's loop over an expert's blocks has no trip count in the program: it runs ceil(rows / block)
    times for the rows the routing sends an expert, and the plan says what it assumed. The same loop outside the
    scope the model knows is named as a warning, never silently counted once."""
    per_block = 2 * 128 * 1024 * 1024
    costs = {}
    for rows in (256, 1000, 4096):
        experts = op_cost.ExpertBlocks(rows_per_expert=rows, block=128, routing="learned",
                                           scope="expert_block_loop")
        found = step_time.predict(block_loop_program("expert_block_loop"), TPU, experts=experts)
        assert found["executed_flops"] == -(-rows // 128) * per_block
        assert found["loops"] == [{"scope": "expert_block_loop", "trips": -(-rows // 128), "basis": experts.basis(),
                                   "loops": 1}] and found["warnings"] == []
        costs[rows] = found["step_seconds"]
    assert costs[256] < costs[1000] < costs[4096]
    assert costs[4096] == pytest.approx(16 * costs[256], rel=1e-6)
    unknown = step_time.predict(block_loop_program("some_scan"), TPU)
    assert unknown["executed_flops"] == per_block and unknown["loops"] == []
    assert unknown["warnings"] == ["loop w (jit(step)/layer0.global/some_scan/while): its trip count is data the "
                                   "model cannot derive; counted once"]


def test_the_costliest_op_groups_account_for_the_compute_and_name_its_pass():
    """The prediction lists its op groups by seconds a step: each op counted as often as it runs, all of the
    compute's seconds in them; a group says the op's region, its pass and what made it."""
    experts = op_cost.ExpertBlocks(rows_per_expert=1000, block=128, routing="learned", scope="expert_block_loop")
    found = step_time.predict(block_loop_program("expert_block_loop"), TPU, experts=experts)
    groups = found["costliest"]
    assert [(g["category"], g["group"], g["ops"]) for g in groups] == [("matmul", "global: dot", 8),
                                                                       ("memory", "global: add", 8)]
    assert sum(g["seconds"] for g in groups) == pytest.approx(sum(found["seconds"].values()), rel=1e-12)
    module = hlo.Module(program("  ROOT %c = f32[8]{0} parameter(0)"))
    name = ("jit(train_step)/while/body/closed_call/transpose(jvp())/while/body/closed_call/checkpoint/"
            "rematted_computation/layer3.global/vmap()/scatter-add")
    scatter = hlo.parse_instruction(f'  %s = f32[8]{{0}} scatter(%a, %b, %c), metadata={{op_name="{name}"}}')
    assert simulator.op_group(module, scatter, "global") == "global recomputed: scatter-add"
    backward = name.replace("checkpoint/rematted_computation/", "").replace("scatter-add", "shard_map/mul")
    multiply = hlo.parse_instruction(f'  %m = f32[8]{{0}} multiply(%a, %b), metadata={{op_name="{backward}"}}')
    assert simulator.op_group(module, multiply, "global") == "global backward: shard_map/mul (multiply)"


@pytest.mark.parametrize("name", ["jit(step)/while/body/closed_call/layer2.sliding/shard_map/dot_general",
                                  "jit(step)/while/body/closed_call/transpose(jvp(layer2.sliding))/shard_map/mul"])
def test_an_op_of_a_layer_is_the_layers_whether_its_layers_are_scanned_or_unrolled(name):
    """Unrolled (`impl.scan_layers=false`), JAX writes a layer's named scope as its transform's argument, not as a
    part of the path: every op of the 47B's unrolled step was booked to the embedding and head."""
    op = hlo.parse_instruction(f'  %m = f32[8]{{0}} multiply(%a, %b), metadata={{op_name="{name}"}}')
    assert simulator.layer_of(op) == ("layer2.sliding", "sliding")
    mine = hlo.parse_instruction(f'  %m = f32[8]{{0}} multiply(%a), metadata={{op_name="{name.replace("layer2", "my_layer2")}"}}')
    assert simulator.layer_of(mine) == (None, None)


def test_a_bounded_exchange_costs_the_rounds_the_routing_is_expected_to_take():
    """A bounded dropless exchange's loop over its rounds past the first (olmax.parallel.expert.overflow) states no
    trip count: the model takes ceil(expected assignments / a round's) - 1, none where they fit, and says
    so; without a bounded buffer the loop is named as one it cannot count."""
    text = block_loop_program("expert_exchange_overflow")
    per_round = 2 * 128 * 1024 * 1024
    for received, buffer, trips in ((1000.0, 1250, 0), (1000.0, 1000, 0), (1000.0, 400, 2)):
        experts = op_cost.ExpertBlocks(100, 128, "learned", "expert_block_loop", 800.0, received, buffer,
                                         "expert_exchange_overflow")
        found = step_time.predict(text, TPU, experts=experts)
        assert found["executed_flops"] == trips * per_round
        assert found["loops"] == [{"scope": "expert_exchange_overflow", "trips": trips, "loops": 1,
                                   "basis": experts.overflow_basis()}] and found["warnings"] == []
    unbounded = op_cost.ExpertBlocks(100, 128, "learned", "expert_block_loop", 1000.0)
    assert step_time.predict(text, TPU, experts=unbounded)["warnings"][0].endswith("counted once")


def test_a_ragged_all_to_all_moves_the_rows_the_routing_sends_not_its_static_buffer():
    """The dropless exchange's buffers hold the worst case (every token of the group); the model costs the rows
    the routing is expected to send (ExpertBlocks.exchanged_rows) at the operand's row size, never more than the
    buffer, and the static buffer where no expectation is given."""
    rows, width = 4096, 1024
    text = program(f"""  %x = bf16[{rows},{width}]{{1,0}} parameter(0)
  %o = bf16[{4 * rows},{width}]{{1,0}} parameter(1)
  %s = s32[4]{{0}} parameter(2)
  ROOT %r = bf16[{4 * rows},{width}]{{1,0}} ragged-all-to-all(%x, %o, %s, %s, %s, %s), replica_groups=[16,4]<=[64]""")

    def seconds(exchanged):
        experts = op_cost.ExpertBlocks(100, 128, "learned", "expert_block_loop", exchanged)
        found = step_time.predict(text, TPU, coords_4x4x4(), experts=experts)["collectives"]
        return found["total_seconds"], found["bytes_by_kind"]["ragged-all-to-all"]

    static_seconds, static_bytes = seconds(None)
    assert static_bytes == 5 * rows * width * 2 + 4 * 4 * 4  # its inputs: the send and receive buffers, the offsets
    expected_seconds, expected_bytes = seconds(1500.0)
    assert expected_bytes == 1500 * width * 2
    latency = TPU.collective_latency
    assert expected_seconds - latency == pytest.approx((static_seconds - latency) * expected_bytes / static_bytes,
                                                       rel=1e-9)
    assert seconds(1e9)[1] == static_bytes


def test_a_token_reaches_the_expected_number_of_peers():
    """Devices a token with top_k distinct experts is sent to: every device with one expert each; one device when
    they all sit there; ep x P(a device holds one of them) between (128 experts, top-4, 8 devices: 3.34)."""
    from olmax.parallel import moe_sizing

    assert moe_sizing.expected_peers(8, 2, 8) == pytest.approx(2)
    assert moe_sizing.expected_peers(8, 2, 1) == pytest.approx(1)
    assert moe_sizing.expected_peers(128, 4, 8) == pytest.approx(8 * (1 - math.comb(112, 4) / math.comb(128, 4)))
    assert 3.3 < moe_sizing.expected_peers(128, 4, 8) < 3.4


RAGGED_DOT = """  %offsets = s32[9]{{0}} parameter(0)
  %x = bf16[{m},{k}]{{1,0}} parameter(1)
  %w = bf16[8,{k},{n}]{{2,1,0}} parameter(2)
  ROOT %ragged-dot-none.1 = bf16[{m},{n}]{{1,0}} custom-call(%offsets, %x, %w), custom_call_target="tpu_custom_call", frontend_attributes={{mosaic_fusion_entry_point="true",ragged_dot_tiling="128,512,1024"}}, metadata={{op_name="jit(f)/ragged_dot_general/ragged-dot-none"}}"""


def test_a_ragged_dot_kernel_costs_its_flops_and_an_unknown_kernel_is_named():
    """The TPU's grouped matmul (jax.lax.ragged_dot's `ragged-dot-*` kernels) multiplies each of its rows by one
    group's [K, N]: 2 M K N FLOPs, at the matrix unit's rate. A kernel the model does not know costs its bytes and
    is listed by name."""
    m, k, n = 8192, 2048, 4096
    found = predict(program(RAGGED_DOT.format(m=m, k=k, n=n)))
    assert found["executed_flops"] == 2 * m * k * n
    assert found["seconds"]["matmul"] == pytest.approx(2 * m * k * n / 100e12, rel=1e-6)
    assert found["warnings"] == [] and found["unknown_kernels"] == {}
    other = predict(program(RAGGED_DOT.format(m=m, k=k, n=n).replace("ragged-dot-none", "mystery_kernel")))
    assert other["executed_flops"] == 0 and other["unknown_kernels"] == {"mystery_kernel": 1}
    assert other["warnings"][0].startswith("custom call mystery_kernel (1 a step): an unknown kernel")


def test_a_small_gemm_on_sm_100_costs_more_per_flop_than_a_large_one_by_xlas_table():
    """XLA's measured GEMM table for sm_100 (B200; B300 takes it): bf16 256 x 1024 x 4096 at 205.86 TFLOP/s, 4096^3
    at 1,416.87 (of 2,250 peak); a shape between the table's sizes is interpolated."""
    hw = hardware.target_hardware(parse_target("gpu:b300x8"))
    small, large = predict(dot_program(256, 1024, 4096), hw), predict(dot_program(4096, 4096, 4096), hw)
    per_flop = {name: p["seconds"]["matmul"] / p["executed_flops"] for name, p in (("small", small), ("large", large))}
    assert per_flop["small"] == pytest.approx(1 / 205.86e12, rel=1e-3)
    assert per_flop["large"] == pytest.approx(1 / 1416.87e12, rel=1e-3)
    assert hardware.gemm_rate("sm_100", "bf16", 256, 1024, 4096) < hardware.gemm_rate(
        "sm_100", "bf16", 362, 1024, 4096) < hardware.gemm_rate("sm_100", "bf16", 512, 1024, 4096)


def test_a_v5p_op_costs_libtpus_estimated_cycles_at_the_chips_clock():
    text = dot_program(8192, 8192, 8192).replace(
        "rhs_contracting_dims={0}", 'rhs_contracting_dims={0}, backend_config={"window_config":{"estimated_cycles":"3500000"}}')
    hw = hardware.target_hardware(parse_target("tpu:v5p:2x2x1"))
    found = predict(text, hw)
    assert found["step_seconds"] == pytest.approx(3.5e6 / hw.clock, rel=1e-9)
    assert found["libtpu_estimate"]["ops"] == 1
    assert found["libtpu_estimate"]["roofline_seconds"] == pytest.approx(
        2 * 8192**3 / (hw.matmul_flops["bf16"] * hw.matmul_efficiency) + hw.op_overhead, rel=1e-6)


@pytest.mark.parametrize("ratio", [1.3, 1.05, 0.95, 0.7])
def test_where_libtpus_estimate_and_the_roofline_disagree_by_over_a_tenth_the_prediction_is_a_range(ratio):
    """On v5p the 7B's ops cost 6.10 s a step at libtpu's estimated cycles and 4.80 s by the roofline, and the
    published run fell between the two steps; the plan showed only the one at libtpu's estimate. Both steps are
    predicted now, and where they are more than 10% apart the prediction is their range (shortest first), said first
    where the plan and compile say where the time goes, with the point figure still libtpu's estimate."""
    from olmax.scale.plan import format_prediction

    hw = hardware.target_hardware(parse_target("tpu:v5p:2x2x1"))
    roofline = 2 * 8192**3 / (hw.matmul_flops["bf16"] * hw.matmul_efficiency) + hw.op_overhead
    cycles = round(ratio * roofline * hw.clock)
    text = dot_program(8192, 8192, 8192).replace(
        "rhs_contracting_dims={0}", 'rhs_contracting_dims={0}, backend_config={"window_config":{"estimated_cycles":'
        f'"{cycles}"}}}}')
    found = step_time.predict(text, hw, model_flops_per_device=2 * 8192**3)
    step = cycles / hw.clock
    assert found["step_seconds"] == pytest.approx(step, rel=1e-9)
    assert found["libtpu_estimate"]["roofline_step_seconds"] == pytest.approx(roofline, rel=1e-9)
    lines = format_prediction(found)
    if abs(ratio - 1) < 0.1:
        assert "step_range" not in found and step_time.range_line(found) is None
        assert lines[0].startswith("predicted step ") and "where the time goes" in lines[0]
        return
    assert found["step_range"] == pytest.approx(sorted([step, roofline]), rel=1e-9)
    low, high = sorted([step, roofline])
    mfu = found["mfu"] * step
    assert lines[0] == (f"predicted step {low * 1e3:.4g}-{high * 1e3:.4g} ms, MFU {100 * mfu / high:.3g}%-"
                        f"{100 * mfu / low:.3g}% (exact count): {step * 1e3:.4g} ms with its 1 ops at libtpu's "
                        f"estimated cycles, {roofline * 1e3:.4g} ms with them at the roofline, {high / low - 1:.0%} "
                        "apart; the point figure follows libtpu's estimate")
    assert lines[1].startswith(f"predicted step {step * 1e3:.4g} ms, where the time goes")


def test_the_plan_and_the_page_state_the_counts_assumed_and_name_what_was_not_counted():
    from olmax.scale.plan import format_prediction
    from olmax.scale.layout_page import _step_time

    experts = op_cost.ExpertBlocks(rows_per_expert=1000, block=128, routing="random", scope="expert_block_loop")
    counted = step_time.predict(block_loop_program("expert_block_loop"), TPU, experts=experts)
    unknown = predict(program(RAGGED_DOT.format(m=256, k=256, n=256).replace("ragged-dot-none", "mystery_kernel")))
    for prediction, said in ((counted, "1 expert_block_loop loops at 8 trips each: 1,000 rows an expert (a device's "
                              "tokens x top_k / its experts; random routing taken as balanced) in blocks of 128"),
                             (unknown, "warning: custom call mystery_kernel (1 a step): an unknown kernel")):
        assert any(line.startswith(said) for line in format_prediction(prediction))
        assert said.replace("'", "&#x27;") in _step_time({"step_time": prediction})


PALLAS_CALL = """  %x = bf16[512,256]{{1,0}} parameter(0)
  %y = bf16[256,512]{{1,0}} parameter(1)
  ROOT %{instruction} = bf16[512,512]{{1,0}} custom-call(%x, %y), custom_call_target="{target}", metadata={{op_name="jit(mm)/probe_matmul/pallas_call"}}, backend_config={config}"""


@pytest.mark.parametrize("target, instruction, config, grid", [
    ("__gpu$xla.gpu.triton", "pallas_call.1", "{debug = false, grid_x = 4 : i32, grid_y = 4 : i32, grid_z = 1 : i32}",
     (4, 4, 1)),  # Pallas Triton states its grid
    ("mosaic_gpu_v2", "pallas_call.1", '{kernel_hash = "x", module = "ML"}', None),  # Mosaic serializes it
    ("tpu_custom_call", "probe_matmul.1", '{"custom_call_config":{"body":"TUzvUgFN"}}', None),
])
def test_a_pallas_kernel_is_costed_by_the_work_registered_under_its_name(monkeypatch, target, instruction, config, grid):
    """A Pallas call's name (`pl.pallas_call(..., name=...)`) is the part of its op name before /pallas_call on every
    backend; the step-time model costs it from olmax.model.kernel_registry's entry for that name: here a 4 x 4 grid of
    128 x 128 output blocks, each contracting 256."""
    from olmax.model import kernel_registry, kernel_work

    seen = []

    def probe_matmul(call: kernel_work.KernelCall) -> kernel_work.Work:
        seen.append(call.grid)
        blocks = math.prod(call.grid or (4, 4))
        return kernel_work.Work(blocks * 2 * 128 * 128 * 256, kernel_work.moved(call), (128, 128, 256), "bf16")

    monkeypatch.setitem(kernel_registry.WORK, "probe_matmul", probe_matmul)
    found = predict(program(PALLAS_CALL.format(target=target, instruction=instruction, config=config)))
    assert seen == [grid] and found["executed_flops"] == 2 * 512 * 512 * 256 and found["warnings"] == []


def _simulated_launched(routed, block: int, trials: int = 300) -> float:
    """The busiest device's rows with each group padded to `block`, averaged over `trials` routings drawn as the
    distribution says: each token of the group picks top_k distinct experts, each equally likely."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens, experts = routed.devices * routed.tokens, routed.experts
    found = []
    for _ in range(trials):
        chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :routed.top_k]
        counts = np.bincount(chosen.ravel(), minlength=experts)
        padded = -(-counts // block) * block
        found.append(padded.reshape(routed.devices, routed.groups).sum(axis=1).max())
    return float(np.mean(found))


@pytest.mark.parametrize("experts, top_k, devices, tokens, block", [(32, 4, 8, 512, 64), (16, 2, 4, 2048, 256),
                                                                    (8, 2, 1, 1024, 64)])
def test_the_routed_rows_count_the_padding_and_the_busiest_device(experts, top_k, devices, tokens, block):
    """An expert's rows vary under routing: padded to a block, a group whose mean is a multiple of the block (the
    47B's 4,096 rows in 256-row blocks) still wastes about half a block, and the busiest device of the group, which
    the others wait for, runs more than the mean. The distribution's expectation against routings drawn at
    random, to within their own spread."""
    from olmax.model.kernel_work import RoutedRows

    routed = RoutedRows(experts, top_k, devices, tokens)
    assert routed.per_group * routed.groups == tokens * top_k
    assert block / 4 < routed.padding(block) < 3 * block / 4
    assert routed.launched(block) == pytest.approx(_simulated_launched(routed, block), rel=0.01)
    assert (routed.busiest(block) > 0) == (devices > 1)


def test_the_47bs_kernels_run_four_percent_more_rows_than_the_mean():
    """The 47B on 8 B300s: 16 experts a GPU of 4,096 rows each on average, a multiple of the 256-row block. The
    expectation alone counted no padding; the distribution counts 127 rows a group and 610 more on the busiest
    GPU: 4.0% more work launched."""
    from olmax.model.kernel_work import RoutedRows

    routed = RoutedRows(128, 4, 8, 2 * 8192)
    assert routed.per_group == 4096
    assert routed.padding(256) == pytest.approx(127, abs=1)
    assert routed.busiest(256) == pytest.approx(610, abs=2)
    assert routed.launched(256) / (16 * 4096) == pytest.approx(1.040, abs=0.001)


def _array(*dims, dtype="bf16", size=2):
    from types import SimpleNamespace

    return SimpleNamespace(dims=dims, dtype=dtype, bytes=size * math.prod(dims))


def test_a_hopper_grouped_kernel_costs_the_rows_routed_and_blackwells_its_whole_grid():
    """The Hopper kernels skip the row tiles after the last group: given the routing's distribution they cost the
    busiest device's rows, each group padded to whole 64-row tiles, not the static buffer; without it, the buffer
    (an upper bound). So does Blackwell's weight gradient, its groups padded to 256-row blocks. JAX's Blackwell
    kernel runs every tile of its grid and costs it whatever the routing. Each counts the bytes its tiles load (x
    once a column tile, w[g] once a row tile) beside each operand's once, and its design's rate."""
    from olmax.model import kernel_work
    from olmax.model.moe.kernels import blackwell as blackwell_kernels
    from olmax.model.moe.kernels import hopper

    array = _array
    rows, k, n, groups = 4096, 512, 1024, 8
    routed = kernel_work.RoutedRows(experts=groups, top_k=1, devices=1, tokens=800)  # 100 rows a group
    forward = [array(groups + 1, dtype="s32", size=4), array(rows, k), array(groups, k, n)]
    weight_grad = [array(groups + 1, dtype="s32", size=4), array(k, rows), array(rows, n)]

    def work(entry, operands, outputs, routed):
        return entry(kernel_work.KernelCall("k", operands, outputs, routed=routed))

    whole = work(hopper.matmul_work, forward, [array(rows, n)], None)
    y = work(hopper.matmul_work, forward, [array(rows, n)], routed)
    used = routed.launched(64)
    assert used == pytest.approx(groups * 128, rel=0.01)  # 100 rows a group, padded to two 64-row tiles
    assert (whole.flops, y.flops) == (2.0 * rows * k * n, 2.0 * used * k * n)
    assert y.bytes == pytest.approx(groups * k * n * 2 + 2 * used * (k + n) + 4 * (groups + 1))
    assert y.loaded == pytest.approx(2 * used * k * (n // 128) + 2 * used / 64 * k * n + 2 * used * n)
    assert y.of_cublas == kernel_work.OF_CUBLAS["pipelined"]
    assert work(hopper.matmul_work, forward, [array(rows, n)],
                kernel_work.RoutedRows(groups, 1, 1, 10**6)).flops == whole.flops  # at most the buffer
    dw = work(hopper.weight_grad_work, weight_grad, [array(groups, k, n, dtype="f32", size=4)], routed)
    assert dw.flops == 2.0 * k * used * n
    assert dw.loaded == pytest.approx(2 * used * k * (n // 128) + 2 * used * n * (k // 128) + 4 * groups * k * n)
    blackwell_dw = work(blackwell_kernels.weight_grad_work, weight_grad, [array(groups, k, n)], routed)
    used = routed.launched(256)
    assert blackwell_dw.flops == 2.0 * k * used * n and blackwell_dw.tile == (128, 256, 256)
    assert blackwell_dw.bytes == pytest.approx(2 * groups * k * n + 2 * used * (k + n) + 4 * (groups + 1))
    assert blackwell_dw.of_cublas == kernel_work.OF_CUBLAS["warp-specialized"]
    assert work(blackwell_kernels.weight_grad_work, weight_grad, [array(groups, k, n)], None).flops == whole.flops
    blackwell = [array(rows, k), array(groups, k, n), array(groups, dtype="s32", size=4)]
    ragged = work(blackwell_kernels.ragged_dot_work, blackwell, [array(rows, n)], routed)
    assert ragged.flops == work(blackwell_kernels.ragged_dot_work, blackwell, [array(rows, n)], None).flops
    tiles = rows // 256 + groups - 1
    assert ragged.loaded == pytest.approx(2 * tiles * 256 * k * (n // 256) + 2 * tiles * k * n + 2 * rows * n)
    assert ragged.of_cublas == 1.0


def test_blackwells_mxfp8_kernels_cost_the_rows_routed_at_the_float8_rate():
    """impl.fp8=mxfp8's grouped kernels skip the tiles after the last group as the bf16 ones do (groups padded to
    256-row blocks), move their e4m3 values and e8m0 scales (a byte per 32 values), and name e4m3 as their
    operands' dtype (the step-time model's float8 rate)."""
    from olmax.model import kernel_work
    from olmax.model.moe.kernels import mxfp8

    def array(*dims, dtype="f8e4m3fn", size=1):
        return _array(*dims, dtype=dtype, size=size)

    rows, k, n, groups = 4096, 512, 1024, 8
    routed = kernel_work.RoutedRows(experts=groups, top_k=1, devices=1, tokens=800)

    def scales(r, c):
        return array(r // 128, c // 128, 32, 16, dtype="f8e8m0fnu")

    forward = [array(rows // 128, dtype="s32", size=4), array(rows, k), array(groups, n, k), scales(rows, k),
               array(groups, n // 128, k // 128, 32, 16, dtype="f8e8m0fnu")]
    weight_grad = [array(groups + 1, dtype="s32", size=4), array(k, rows), array(n, rows), scales(k, rows),
                   scales(n, rows)]

    def work(entry, operands, outputs, routed):
        return entry(kernel_work.KernelCall("k", operands, outputs, routed=routed))

    y = work(mxfp8.matmul_work, forward, [array(rows, n, dtype="bf16", size=2)], routed)
    used = routed.launched(256)
    assert y.flops == 2.0 * used * k * n and y.dtype == "f8e4m3fn"
    assert y.bytes == pytest.approx(groups * n * k * 33 / 32 + used * k * 33 / 32 + 2 * used * n + 4 * rows // 128)
    assert y.loaded == pytest.approx(used * k * 33 / 32 * (n // 256) + used / 128 * k * n * 33 / 32 + 2 * used * n)
    dw = work(mxfp8.weight_grad_work, weight_grad, [array(groups, k, n, dtype="bf16", size=2)], routed)
    assert dw.flops == 2.0 * k * used * n and dw.tile == (128, 256, 256)
    assert dw.bytes == pytest.approx(used * (k + n) * 33 / 32 + 2 * groups * k * n + 4 * (groups + 1))
    whole = work(mxfp8.weight_grad_work, weight_grad, [array(groups, k, n, dtype="bf16", size=2)], None)
    assert whole.flops == 2.0 * k * rows * n


GROUPED_CALL = """  %starts = s32[{tiles}]{{0}} parameter(0)
  %x = bf16[{rows},{k}]{{1,0}} parameter(1)
  %w = bf16[{groups},{k},{n}]{{2,1,0}} parameter(2)
  ROOT %y = bf16[{rows},{n}]{{1,0}} custom-call(%starts, %x, %w), custom_call_target="mosaic_gpu_v2", metadata={{op_name="jit(step)/grouped_matmul/mpmd_map"}}, backend_config={{kernel_hash = "x"}}"""


def test_a_grouped_kernels_time_is_a_range_of_what_it_assumes():
    """A Hopper grouped matmul on an H100: at the fast end its tiles' re-reads come from L2 at cuBLAS's rate; at
    the slow end every tile load comes from HBM at its design's fraction of cuBLAS's rate (59.4%, one pipelined
    warpgroup); each assumption alone between them. The step is a range where its ends are over a tenth apart, and
    the plan says what each end assumed; the point figure is the fast end."""
    from olmax.model.kernel_work import RoutedRows
    from olmax.scale.plan import format_prediction

    rows, k, n, groups = 8192, 2048, 1024, 8
    text = program(GROUPED_CALL.format(tiles=rows // 64, rows=rows, k=k, n=n, groups=groups))
    hw = hardware.target_hardware(parse_target("gpu:h100x8"))
    experts = op_cost.ExpertBlocks(1024, 64, "learned", "expert_block_loop", routed=RoutedRows(groups, 1, 1, 8192))
    found = step_time.predict(text, hw, None, None, experts=experts)
    ends = found["kernel_range"]["seconds"]
    assert found["step_seconds"] == pytest.approx(ends["fast"])
    assert ends["fast"] < min(ends["hbm"], ends["own_rate"]) <= max(ends["hbm"], ends["own_rate"]) < ends["slow"] + 1e-12
    assert ends["own_rate"] - hw.op_overhead == pytest.approx((ends["fast"] - hw.op_overhead) / 0.594)
    assert found["kernel_range"]["slow_step_seconds"] == pytest.approx(ends["slow"])
    assert found["step_range"] == [found["step_seconds"], ends["slow"]]
    lines = "\n".join(format_prediction(found))
    assert "with its 1 grouped-matmul kernels' re-reads from L2 at cuBLAS's rate" in lines
    assert "with every tile load from HBM" in lines and "the point figure follows L2 and cuBLAS's rate" in lines


def test_a_fresh_process_costs_every_grouped_gpu_kernel_from_its_work():
    """The grouped kernels' work was registered as a side effect of importing their module (olmax.model.moe.grouped),
    so a process that had not imported it (a compile whose MoE was dense in the model built so far; `olmax plan`)
    costed them by their bytes alone, as unknown kernels. The registry names every kernel module: a fresh interpreter
    that imports only the step-time model costs each of olmax's six GPU kernels, by the name its compiled program
    shows, from its work."""
    from olmax.model.moe.kernels.blackwell import RAGGED_DOT

    m, k, n, g = 1024, 256, 512, 4
    calls = [  # (kernel name, output, operands) as the kernels launch them (olmax.model.moe.kernels)
        ("grouped_matmul", f"bf16[{m},{n}]", [f"s32[{m // 64}]", f"bf16[{m},{k}]", f"bf16[{g},{k},{n}]"]),
        ("grouped_weight_grad", f"f32[{g},{k},{n}]", [f"s32[{g + 1}]", f"bf16[{k},{m}]", f"bf16[{m},{n}]"]),
        (f"ragged_dot_kernel_{RAGGED_DOT}", f"bf16[{m},{n}]", [f"bf16[{m},{k}]", f"bf16[{g},{k},{n}]", f"s32[{g}]"]),
        ("blackwell_weight_grad", f"bf16[{g},{k},{n}]", [f"s32[{g + 1}]", f"bf16[{k},{m}]", f"bf16[{m},{n}]"]),
        ("blackwell_mx_grouped_matmul", f"bf16[{m},{n}]",
         [f"s32[{m // 128}]", f"f8e4m3fn[{m},{k}]", f"f8e4m3fn[{g},{n},{k}]", f"f8e8m0fnu[{m // 128},{k // 128},32,16]",
          f"f8e8m0fnu[{g},{n // 128},{k // 128},32,16]"]),
        ("blackwell_mx_weight_grad", f"bf16[{g},{k},{n}]",
         [f"s32[{g + 1}]", f"f8e4m3fn[{k},{m}]", f"f8e4m3fn[{n},{m}]", f"f8e8m0fnu[{k // 128},{m // 128},32,16]",
          f"f8e8m0fnu[{n // 128},{m // 128},32,16]"]),
    ]
    lines, outputs = [], []
    for i, (name, out, operands) in enumerate(calls):
        names = [f"%p{i}_{j}" for j in range(len(operands))]
        lines += [f"  {a} = {t} parameter({6 * i + j})" for j, (a, t) in enumerate(zip(names, operands))]
        lines.append(f'  %kernel{i} = {out} custom-call({", ".join(names)}), custom_call_target="mosaic_gpu_v2", '
                     f'metadata={{op_name="jit(step)/{name}/mpmd_map"}}, backend_config={{kernel_hash = "x"}}')
        outputs.append(f"%kernel{i}")
    lines.append(f"  ROOT %all = ({', '.join(out for _, out, _ in calls)}) tuple({', '.join(outputs)})")
    code = ("import json, sys\n"
            "from olmax.scale import hardware, step_time\n"
            "from olmax.scale.targets import parse_target\n"
            "imported = sorted(m for m in sys.modules if m.startswith('olmax.model'))\n"
            "found = step_time.predict(sys.stdin.read(), hardware.target_hardware(parse_target('gpu:b300x8')))\n"
            "print(json.dumps({'imported': imported, 'unknown': found['unknown_kernels'], "
            "'flops': found['executed_flops'], 'warnings': found['warnings']}))\n")
    run = subprocess.run([sys.executable, "-c", code], input=program("\n".join(lines)), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.splitlines()[-1])
    assert not any(module.startswith("olmax.model.moe") for module in found["imported"])  # the kernels not imported
    assert found["unknown"] == {} and found["warnings"] == []
    assert found["flops"] >= 6 * 2 * m * k * n  # each kernel's matmul, costed from its work
