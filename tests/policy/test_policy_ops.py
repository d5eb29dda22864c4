"""Ops the policy lowers beyond its examples: in-place spellings, more activations, batch norm, reductions over
several or non-trailing dims, pooling. Each is checked for meaning on the CPU (the analysis' groups, run by the
executable spec, compute what Model computes) and, with the `gpu` marker, built and verified on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernelpilot.policy.cpu_spec import TORCH_OPS
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.problem import load_problem
from kp_testing import nonempty
from policy_testing import (
    analysed, assert_every_launch_candidate_verifies, assert_generated_kernels_verify, check_against_model, compile_cu,
    compile_each_cu,
    needs_nvcc, write_problem,
)  # fmt: skip

# name -> (forward, inputs, __init__ lines): small problems using the ops, each supported.
PROBLEMS = {
    # In-place ops on values computed in forward, and through a view of one: the functionalised trace.
    "in_place_activations": ("""
        def forward(self, x, y):
            h = x * 2.0
            h.relu_()
            h += y
            F.hardtanh_(h.mul_(0.5), -0.25, 0.25)
            return h
        """, "torch.randn(16, 64), torch.randn(16, 64)", ""),
    "in_place_residual_block": ("""
        def forward(self, x):
            out = self.linear(x)
            out += x
            out = torch.relu_(out)
            return out
        """, "torch.randn(32, 64)", "self.linear = nn.Linear(64, 64)"),
    # Activations: mish, and elu with SELU's and CELU's constants.
    "activations": ("""
        def forward(self, x):
            return F.mish(x) + F.elu(x, 0.7) + torch.selu(x) + F.celu(x, 1.3)
        """, "torch.randn(8, 1000) * 4", ""),
    # Batch norm in eval mode (running statistics), 1-d to 3-d, after a convolution and before an activation.
    "batch_norm_2d": ("""
        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)))
        """, "torch.randn(4, 8, 10, 12)",
        "self.conv = nn.Conv2d(8, 16, 3)\nself.bn = nn.BatchNorm2d(16)\n"
        "self.bn.running_mean.uniform_(-1, 1)\nself.bn.running_var.uniform_(0.5, 2)\n"
        "self.bn.weight.data.uniform_(0.5, 1.5)\nself.bn.bias.data.uniform_(-1, 1)"),
    "batch_norm_1d_3d": ("""
        def forward(self, x, y):
            return self.bn1(x) * 2, self.bn3(y)
        """, "torch.randn(32, 24), torch.randn(2, 6, 4, 5, 7)",
        "self.bn1 = nn.BatchNorm1d(24, affine=False)\nself.bn3 = nn.BatchNorm3d(6, eps=1e-3)\n"
        "self.bn1.running_var.uniform_(0.5, 2)\nself.bn3.running_mean.uniform_(-1, 1)"),
    # Normalising with the batch's own statistics: instance norm ((1, N*C, H, W) rows), and batch statistics
    # over (N, H, W) per channel.
    "instance_norm": ("""
        def forward(self, x):
            return self.norm(torch.tanh(x)) / 2.0
        """, "torch.randn(4, 6, 10, 12)", "self.norm = nn.InstanceNorm2d(6, affine=True)\n"
        "self.norm.weight.data.uniform_(0.5, 1.5)\nself.norm.bias.data.uniform_(-1, 1)"),
    "batch_statistics": ("""
        def forward(self, x):
            return F.batch_norm(x * 2.0, None, None, self.weight, self.bias, training=True, eps=1e-3)
        """, "torch.randn(5, 6, 7, 3)", "self.weight = nn.Parameter(torch.rand(6) + 0.5)\n"
        "self.bias = nn.Parameter(torch.randn(6))"),
    # Reductions over several trailing dims (a spatial mean), over non-adjacent dims, and over one dim before the
    # last for statistics column kernels do not compute (a variance, a softmax, logsumexp).
    "spatial_reductions": ("""
        def forward(self, x):
            return x.mean(dim=(2, 3)), x.sum(dim=[1, 2, 3], keepdim=True), x.amax(dim=(0, 2)), x.var(dim=1)
        """, "torch.randn(4, 6, 10, 12)", ""),
    "softmax_over_channels": ("""
        def forward(self, x):
            s = torch.softmax(x, dim=1)
            return torch.sigmoid(s) * 2, torch.log_softmax(x, dim=0), torch.logsumexp(x, dim=1, keepdim=True)
        """, "torch.randn(3, 7, 5, 6)", ""),
    "layer_norm_trailing_dims": ("""
        def forward(self, x):
            return self.norm(x) + 1.0
        """, "torch.randn(4, 6, 8, 10)", "self.norm = nn.LayerNorm((8, 10))\nself.norm.weight.data.uniform_(0.5, 1.5)"),
    # Pooling: windows read through strides from the input or from the expression computing it.
    "pooling": ("""
        def forward(self, x):
            y = torch.tanh(x) * 2.0
            return (F.max_pool2d(y, 2), F.avg_pool2d(x, 3, stride=2), F.max_pool2d(x, 3, stride=1, dilation=2),
                    F.avg_pool2d(x, 2, divisor_override=3))
        """, "torch.randn(2, 3, 11, 13)", ""),
    "pooling_3d_1d": ("""
        def forward(self, x, y):
            return F.max_pool3d(x, 2), F.avg_pool3d(torch.relu(x), (1, 2, 3)), F.max_pool1d(y, 4, stride=3)
        """, "torch.randn(2, 3, 6, 8, 9), torch.randn(4, 5, 50)", ""),
    "pooling_padded": ("""
        def forward(self, x):
            return (F.max_pool2d(torch.relu(x), 3, stride=2, padding=1), F.avg_pool2d(x, 4, stride=1, padding=2),
                    F.max_pool2d(x, 3, stride=2, ceil_mode=True),
                    F.max_pool2d(x, 2, stride=2, padding=1, ceil_mode=True))
        """, "torch.randn(2, 3, 9, 10)", ""),
    # KernelBench L1 41 and 46, smaller: windows over implicit padding, dilated, read in place.
    "pooling_padded_dilated": ("""
        def forward(self, x, z):
            return F.max_pool1d(x, 8, stride=1, padding=4, dilation=3), F.avg_pool3d(z, 3, stride=2, padding=1)
        """, "torch.randn(4, 6, 300), torch.rand(2, 3, 20, 17, 16)", ""),
    # Flips: loads through negative strides, in an elementwise kernel and under a row statistic.
    "flips": ("""
        def forward(self, x, y):
            return x.flip(1) * 2 + y.flip(0, 2), x.flip(-1).softmax(-1)
        """, "torch.randn(4, 5, 6), torch.randn(4, 5, 6)", ""),
    # Joining and padding: windowed loads in one elementwise kernel.
    "cat_stack_pad": ("""
        def forward(self, x, y):
            h = torch.sigmoid(y)
            return (torch.cat([x, h, x * 2], dim=1), torch.stack([x, y], dim=0) + 1, F.pad(x, (1, 2, 0, 3), value=-1.5),
                    torch.cat([x, y], dim=-1).sum(-1))
        """, "torch.randn(4, 6), torch.randn(4, 6)", ""),
    # A cat of convolutions (a dense block): each convolution is written by cuDNN, then joined.
    "cat_of_convolutions": ("""
        def forward(self, x):
            return torch.cat([x, self.conv1(x), torch.relu(self.conv2(x))], dim=1)
        """, "torch.randn(2, 4, 8, 8)", "self.conv1 = nn.Conv2d(4, 3, 3, padding=1)\nself.conv2 = nn.Conv2d(4, 5, 1)"),
    # Transposed convolutions: cuDNN's backward data, then the bias in the elementwise kernel after it.
    "conv_transpose_2d": ("""
        def forward(self, x):
            return torch.tanh(self.up(x)) * 0.5
        """, "torch.randn(2, 6, 7, 9)",
        "self.up = nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1)"),
    "conv_transpose_1d_3d": ("""
        def forward(self, x, y):
            return self.up1(x), F.relu(self.up3(y)).amax(dim=(2, 3, 4))
        """, "torch.randn(2, 4, 11), torch.randn(2, 4, 3, 4, 5)",
        "self.up1 = nn.ConvTranspose1d(4, 6, 4, stride=3, dilation=2, bias=False)\n"
        "self.up3 = nn.ConvTranspose3d(4, 6, 2, stride=2, groups=2)"),
    # Triangles of a product and of an input, any diagonal.
    "triangles": ("""
        def forward(self, a, b):
            return torch.tril(a @ b), torch.triu(a, 1) * 2.0, torch.tril(b.view(2, 8, 8), -2)
        """, "torch.randn(16, 8), torch.randn(8, 16)", ""),
    # A Model whose __init__ reads a value (built on the CPU, then moved to meta tensors).
    "init_reads_a_value": ("""
        def forward(self, x):
            return self.linear(x) * self.scale
        """, "torch.randn(8, 16)", "self.scale = torch.linspace(0, 1, 5)[2].item()\nself.linear = nn.Linear(16, 16)"),
    # Indices: argmax/argmin along the last dim and along dim 1, max(dim) with its indices, ties and NaN.
    "argmax_argmin": ("""
        def forward(self, x, y):
            values, indices = torch.max(y, dim=1)
            return torch.argmax(x, dim=-1), torch.argmin(x, dim=1, keepdim=True), values * 2, indices
        """, "torch.randn(6, 40, 50), torch.randint(0, 3, (6, 40, 5)).float()", ""),
    # A number made a tensor in forward is that number in the kernel.
    "number_tensors": ("""
        def forward(self, x):
            return torch.min(x, torch.tensor(0.25, device=x.device)) * torch.tensor(3)
        """, "torch.randn(8, 16)", ""),
    # Norms over every dim and over dims; smooth L1 (Huber) losses.
    "norms": ("""
        def forward(self, x):
            return (x / torch.norm(x, p="fro"), x / torch.norm(x, p=2, dim=1, keepdim=True),
                    torch.linalg.vector_norm(x, 1))
        """, "torch.randn(16, 40)", ""),
    "smooth_l1": ("""
        def forward(self, x, y):
            return (F.smooth_l1_loss(x, y), F.smooth_l1_loss(x, y, reduction="sum", beta=0.5),
                    F.huber_loss(x, y, reduction="none"))
        """, "torch.randn(32, 50) * 2, torch.randn(32, 50)", ""),
    "attention": ("""
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)
        """, "torch.randn(2, 3, 16, 8), torch.randn(2, 3, 20, 8), torch.randn(2, 3, 20, 8)", ""),
    # split, chunk and unbind are views of one tensor.
    "splits": ("""
        def forward(self, x):
            a, b, c = self.linear(x).split(32, dim=1)
            d, e = x.chunk(2, dim=0)
            return torch.sigmoid(a) * torch.tanh(b) + c, d - e, sum(x.unbind(1))
        """, "torch.randn(8, 96)", "self.linear = nn.Linear(96, 96)"),
}


def problem(folder, name: str):
    forward, inputs, init = PROBLEMS[name]
    return write_problem(folder, name, forward, inputs, init)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_ops_compute_what_the_model_computes(tmp_path, name):
    check_against_model(problem(tmp_path, name), atol=1e-5)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_every_launch_candidate_renders(tmp_path, name):
    path = problem(tmp_path, name)
    analysis = analysed(path)
    assert [file.path for file in render_all(load_problem(path), analysis)][-1] == "model_new.py"
    for group in analysis.generated_groups:
        for config in nonempty(launch_candidates(group), "launch candidates"):
            assert "__global__" in render_kernel(group, config).content or group.kind in ("matmul", "conv")


@needs_nvcc
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_first_launch_candidates_compile(tmp_path, name):
    groups = nonempty(analysed(problem(tmp_path, name)).generated_groups, "generated groups")
    compile_each_cu([render_kernel(group, launch_candidates(group)[0]).content for group in groups], tmp_path)


# c op -> (its arguments beyond x, what torch computes from x)
TORCH_MEANINGS = {
    "mish": ((), F.mish),
    "elu": ((0.7, 1.0, 1.0), lambda x: F.elu(x, 0.7)),
    "smooth_l1": ((0.5,), lambda d: F.smooth_l1_loss(d, torch.zeros_like(d), reduction="none", beta=0.5)),
    "huber": ((1.5,), lambda d: F.huber_loss(d, torch.zeros_like(d), reduction="none", delta=1.5)),
}


@pytest.mark.parametrize("op", sorted(TORCH_MEANINGS))
def test_each_new_c_op_means_what_torch_means(op):
    settings, meaning = TORCH_MEANINGS[op]
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    spec = TORCH_OPS[op](x, *(torch.tensor(value, dtype=torch.float64) for value in settings))
    torch.testing.assert_close(spec, meaning(x))


def test_selu_and_celu_are_elu_with_their_constants():
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    torch.testing.assert_close(TORCH_OPS["elu"](x, alpha, scale, 1.0), torch.selu(x))
    torch.testing.assert_close(TORCH_OPS["elu"](x, 1.3, 1.0, 1 / 1.3), F.celu(x, 1.3))


@pytest.mark.parametrize(
    "returned",
    ["x.sum((0, 2))", "x.var(1)", "torch.logsumexp(x, 0)", "x.amax((0, 2))", "torch.linalg.vector_norm(x)",
     "x.std((0, 1), keepdim=True) * x", "torch.log_softmax(x, 1) + x.mean((1, 2))[:, None, None]"],
)  # fmt: skip
def test_reductions_over_any_dims_compute_what_the_model_computes(tmp_path, returned):
    path = write_problem(tmp_path, "any_dims", f"def forward(self, x):\n    return {returned}", "torch.randn(4, 6, 8)")
    check_against_model(path, atol=1e-5)


def test_reductions_run_where_their_dims_lie_or_over_the_permuted_input(tmp_path):
    analysis = analysed(problem(tmp_path, "spatial_reductions"))
    mean, total, amax, variance = analysis.groups
    assert (mean.kind, mean.row_dims, mean.shape) == ("row", 2, (4, 6, 10, 12))  # rows of H x W, in place
    assert (total.kind, total.row_dims) == ("row", 3)
    # amax over (0, 2) and the variance over dim 1: rows of the input with those dims moved last
    assert (amax.kind, amax.shape, amax.row_dims) == ("row", (6, 12, 4, 10), 2)
    assert (variance.kind, variance.shape) == ("row", (4, 10, 12, 6))
    assert [a.strides for a in variance.accesses] == [(720, 12, 1, 120)]


def test_a_softmax_over_channels_is_written_in_the_permuted_order_and_read_back_through_strides(tmp_path):
    analysis = analysed(problem(tmp_path, "softmax_over_channels"))
    softmax = analysis.groups[0]
    assert softmax.kind == "row" and softmax.shape == (3, 5, 6, 7)
    # sigmoid(s) * 2 reads the softmax, written as (3, 5, 6, 7), in the (3, 7, 5, 6) order of forward
    (reader,) = [group for group in analysis.groups if group.tensors == [softmax.output]]
    assert reader.kind == "elementwise" and reader.ops == ["aten.sigmoid", "aten.mul"]
    assert reader.accesses[0].strides == (210, 1, 42, 7)


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        # A write into the caller's tensor is a side effect no generated kernel has.
        ("def forward(self, x):\n    x.relu_()\n    return x * 2", "writes in place into a forward argument"),
        ("def forward(self, x):\n    x.add_(1.0)\n    return x", "writes in place into a forward argument"),
    ],
)
def test_writes_into_forward_arguments_are_named(tmp_path, forward, reason):
    analysis = analysed(write_problem(tmp_path, "writes", forward, "torch.randn(8, 16)"))
    assert not analysis.supported and reason in analysis.blockers()


def test_a_constant_tensor_of_several_values_is_named(tmp_path):
    forward = "def forward(self, x):\n    return x * torch.tensor([1.0, 2.0], device=x.device)"
    analysis = analysed(write_problem(tmp_path, "constant", forward, "torch.randn(8, 2)"))
    assert not analysis.supported and "a constant tensor created in forward" in analysis.blockers()


def test_a_write_through_a_view_is_seen_by_every_later_reader_or_refused(tmp_path):
    # The slice's in-place add changes h too: a policy that ignored the alias would return h without it.
    forward = """
    def forward(self, x):
        h = x * 3.0
        h[:, :8].add_(1.0)
        return h + 1.0
    """
    analysis = analysed(write_problem(tmp_path, "view_write", forward, "torch.randn(8, 16)"))
    assert not analysis.supported and "slice_scatter" in analysis.blockers()


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_generated_kernels_verify_on_the_gpu(judge, tmp_path, name):
    assert_generated_kernels_verify(judge, problem(tmp_path, name), tmp_path)


@pytest.mark.gpu
def test_every_launch_candidate_of_guarded_pooling_windows_verifies(judge, tmp_path):
    # Teams of 1 to 16 threads per window, each reading its fill outside the input.
    assert_every_launch_candidate_verifies(judge, problem(tmp_path, "pooling_padded_dilated"), tmp_path)


def test_windows_over_implicit_padding_are_read_in_place_through_a_guarded_load(tmp_path):
    # No padded copy: an input in memory is read where each window coordinate lies inside it, -inf (max) or 0
    # (an average counting the padding) elsewhere; a computed input (the ReLU) is written first.
    groups = analysed(problem(tmp_path, "pooling_padded")).groups
    assert [g.kind for g in groups] == ["elementwise", "row", "row", "row", "row"] and groups[0].ops == ["aten.relu"]
    for group in groups[1:]:
        (access,) = group.accesses
        assert access.guard is not None and access.offset <= 0 and group.leading_free
    (max_pool, avg_pool, _, _) = groups[1:]
    assert max_pool.accesses[0].guard.fill == -float("inf") and avg_pool.accesses[0].guard.fill == 0.0
    # max_pool2d(relu(x), 3, stride=2, padding=1) over 9x10: row = 2x3x5x5 windows of 3x3, input rows -1 + 2 * out + k.
    assert max_pool.shape == (2, 3, 5, 5, 3, 3)
    assert max_pool.accesses[0].guard.checks == ((((2, 2), (4, 1)), -1, 9), (((3, 2), (5, 1)), -1, 10))
    kernel = render_kernel(max_pool, launch_candidates(max_pool)[0]).content
    assert "if (const int64_t c = -1 + row / 5 % 5 * 2 + column / 3 % 3 * 1; c < 0 || c >= 9) return false;" in kernel
    assert "= inside0(safe_row, col) ? to_float(row0[column_offset0(col)]) : (-INFINITY);" in kernel


@pytest.mark.parametrize("made", ["torch.zeros_like(x)", "torch.full_like(x, 2.5)", "torch.ones(4, 8, device=x.device)",
                                  "torch.full((4, 8), -1.0, device=x.device)"])  # fmt: skip
def test_tensors_of_one_value_made_in_forward_are_numbers_in_the_kernel(tmp_path, made):
    path = write_problem(tmp_path, "made", f"def forward(self, x):\n    return x * 3 + {made}\n", "torch.randn(4, 8)")
    analysis = check_against_model(path)
    assert analysis.supported and len(analysis.generated_groups) == 1, analysis.blockers()


@needs_nvcc
def test_many_short_rows_such_as_pooling_windows_also_get_a_one_thread_team_that_compiles(tmp_path):
    # KernelBench L1 41's shape: a 1-d max pool whose windows are rows of 8, 805M of them.
    path = write_problem(tmp_path, "max_pool_1d", "def forward(self, x):\n    return F.max_pool1d(x, 8, stride=1, padding=4, dilation=3)\n",
                         "torch.randn(64, 192, 65536)")  # fmt: skip
    short = [g for g in analysed(path).generated_groups if g.kind == "row"]
    assert [g.row_length for g in short] == [8]
    (group,) = short
    ones = [config for config in launch_candidates(group) if config.threads == 1]
    assert len(ones) == 1 and ones[0].rows_per_block == 256
    assert launch_candidates(group)[0].threads > 1  # the expected best stays first
    compile_cu(render_kernel(group, ones[0]).content, tmp_path)
    # A few short rows keep their teams: one thread each would leave most of the GPU idle.
    few = [g for g in analysed(problem(tmp_path, "pooling_3d_1d")).generated_groups if g.kind == "row"]
    assert few and all(config.threads > 1 for g in few for config in launch_candidates(g))
